"""``HybridEngine``: generate fast with the weights of a model that is being trained, and go back to training.

The engine owns an *inference copy* of the training model's architecture: built once, on the meta device and then
materialized in the inference dtype, with fused layers injected (``hf_dsinfer.policies.inject``). Its parameters
are persistent buffers. ``eval()`` copies the training model's effective weights into them **in place** (gathering
shards, fusing LoRA, re-packing into the fused qkv / gate_up layout through ``Policy.pack_into``), so their
addresses never change and captured CUDA graphs stay valid. ``generate()`` runs the inference copy's ``generate``:
hf_dsinfer's fast decoding loop (per-bucket CUDA graphs on CUDA with ``enable_cuda_graph``).
``train()`` only puts the training model back in training mode: the training model, its weights and the optimizer
state are never touched. See docs/hybrid.md.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .. import hf_compat
from ..generation.api import GEN_ATTR
from ..log import logger
from ..modules import cpu_packed
from ..policies import get_injection, inject
from .build import match_layer_lists, retie, row_major_head
from .config import read_hybrid_engine_config, resolve_inference_config, section_inference_fields
from .engine_generate import GenerateMixin
from .stats import HybridStats
from .tp import make_inference_tp
from .weights import TrainingWeights

_OPTIMIZER_STEPS = [0]  # process-wide count of optimizer steps (a global post-step hook bumps it)
_HOOK: list[Any] = []


def _count_optimizer_steps() -> None:
    """Register (once) a global optimizer post-step hook: refresh="auto" refreshes after any step."""
    if not _HOOK:

        def bump(*_: Any) -> None:
            _OPTIMIZER_STEPS[0] += 1

        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(bump))


def _first_param(model: nn.Module) -> torch.Tensor | None:
    return next(model.parameters(), None)


def _local_device(t: torch.Tensor) -> torch.device:
    to_local = getattr(t, "to_local", None)  # DTensor: the device of this rank's shard
    return to_local().device if callable(to_local) else t.device


class HybridEngine(GenerateMixin):
    """Switch a training model (HF ``PreTrainedModel`` or peft ``PeftModel`` with LoRA) into fast generation and back.

    Args:
        model: the model being trained. It may be wrapped (DDP, DeepSpeed), sharded (FSDP2, ZeRO-3) and carry LoRA
            adapters; it is only ever read.
        inference_config: ``InferenceConfig``, dict, JSON path or None (defaults: training dtype, kernel injection
            on). ``config_kwargs`` are merged in as config fields. ``tensor_parallel.tp_size`` > 1 (or ``config``'s
            ``inference_tp_size``), under torchrun: the copy is split over groups of ranks (:mod:`.tp`).
        release_inference_cache: free the static KV cache (and any CUDA graphs that read it) whenever the engine
            leaves inference mode (default: ``config``'s value, else False); the next generation allocates and
            re-captures them. Saves memory for training at the cost of that re-capture.
        refresh: ``"always"`` (default) copies the weights at every ``eval()``; ``"auto"`` skips the copy when no
            tracked change happened (an optimizer step, an in-place update of a parameter, a change of active LoRA
            adapters). Writes through ``.data`` are not tracked: call :meth:`mark_dirty` after them.
        device: where the inference copy lives (default: the training weights' device).
        config: a DeepSpeed config (dict or JSON path) or its ``hybrid_engine`` section: DeepSpeed's names and
            defaults (:mod:`hf_dsinfer.hybrid.config`). ``max_out_tokens`` and ``inference_tp_size`` set the inference
            config, ``release_inference_cache`` the argument of that name (when it is not given), ``enabled=false``
            (DeepSpeed's default) builds no inference copy: ``generate`` runs on the training model.
        sampling: ``"fast"`` (default) samples in hf_dsinfer's loop: the same distribution as HF's ``generate`` but
            its own random stream (see docs/hybrid.md). ``"hf"`` runs sampled requests through transformers' own
            loop on the inference copy (fused layers, static cache): HF's processors and draws from torch's global
            RNG in HF's order, so a seeded rollout reproduces HF ``generate``. Greedy requests always use the fast loop.
        rollout_rows: rows of one rollout batch (the Trainer callback passes its generation batch): when the inference
            config leaves ``max_batch_size`` unset, the static cache and CUDA-graph buckets are sized for it (<= 256).

        logp_probe_rows: > 0 turns on the ``logp_diff`` probe (off by default): at each ``eval()`` (refreshed or
            skipped by ``refresh="auto"``), the first ``generate`` call's first rows are scored by the inference copy
            and the training model; the mean absolute difference of the generated tokens' log-probs goes to
            ``stats.last.logp_diff`` (stale weights show at once). Costs two teacher-forced forwards of those rows
            per iteration. One inference rank only.

        share_base: ``"auto"`` (default): training weights in the inference dtype share their storage with the
            inference copy (:mod:`.shared_base`): frozen ones (peft LoRA's base, ``requires_grad=False``, LoRA added
            as a side path) and, for full fine-tuning of a plain model, trainable ones (the optimizer updates the
            inference buffers in place: the refresh copies nothing). In another dtype, frozen tensors without LoRA
            are cast into the copy once; adapted ones (``W + BA`` fused) and trainable ones are written at each
            refresh. ``False``: copy everything.

    Fast defaults: ``enable_cuda_graph`` unset or ``"auto"`` is on for a CUDA copy (an explicit False wins).

    ``he.eval(); he.generate(...); he.train()``, or ``with he.inference(): he.generate(...)``. ``he.stats`` holds
    per-iteration timings (:class:`~hf_dsinfer.hybrid.stats.HybridStats`).
    """

    def __init__(
        self,
        model: nn.Module,
        inference_config: Any = None,
        release_inference_cache: bool | None = None,
        refresh: str = "always",
        device: torch.device | str | None = None,
        sampling: str = "fast",
        config: Any = None,
        rollout_rows: int | None = None,
        logp_probe_rows: int = 0,
        share_base: bool | str = "auto",
        **config_kwargs: Any,
    ):
        if refresh not in ("always", "auto"):
            raise ValueError(f"refresh={refresh!r}: use 'always' or 'auto'")
        if sampling not in ("fast", "hf"):
            raise ValueError(
                f"sampling={sampling!r}: use 'fast' (hf_dsinfer's loop, same distribution as HF) or 'hf' "
                "(transformers' sampling loop on the inference copy: HF's random stream, rollouts reproducible vs HF)"
            )
        if isinstance(logp_probe_rows, bool) or not isinstance(logp_probe_rows, int) or logp_probe_rows < 0:
            raise ValueError(f"logp_probe_rows must be an integer >= 0 (0: probe off), got {logp_probe_rows!r}")
        self.logp_probe_rows = logp_probe_rows
        if share_base not in ("auto", True, False):
            raise ValueError(f"share_base={share_base!r}: use 'auto' (share frozen weights) or False (copy them)")
        self.share_base = share_base
        self._shared: Any = None  # SharedBase once built (hybrid/shared_base.py)
        self._asleep: Any = None  # [(tensor, bytes)] freed by sleep() (hybrid/memory.py)
        self.sampling = sampling
        self.training_model = model
        self.weights = TrainingWeights(model)
        first = _first_param(self.weights.hf_model)
        if first is None:
            raise ValueError("the training model has no parameters")
        self.settings = read_hybrid_engine_config(config) if config is not None else None
        if self.settings is not None:
            config_kwargs = section_inference_fields(self.settings, inference_config, config_kwargs)
            if release_inference_cache is None:
                release_inference_cache = self.settings.release_inference_cache
        # hybrid_engine.enabled=false (DeepSpeed's default): no inference copy, generate runs on the training model.
        self.enabled = self.settings is None or self.settings.enabled
        self.device = torch.device(device) if device is not None else _local_device(first)
        # Rollout defaults: CUDA graphs on for a CUDA copy, cache rows / graph buckets for the rollout batch.
        self.config = resolve_inference_config(
            inference_config, config_kwargs, first.dtype, self.device.type, rollout_rows
        )
        # inference_tp_size > 1: the copy is split over an inference group of ranks (hybrid/tp.py); None: one rank
        self.tp = make_inference_tp(self.config, self.settings is not None) if self.enabled else None
        if self.config.checkpoint is not None:
            raise ValueError("HybridEngine takes its weights from the training model; remove `checkpoint`.")
        # quant (dtype="int8" too): a weight-only quantized inference copy of the float training model (QLoRA-style
        # rollouts); each refresh quantizes the fresh training weights into the copy's buffers in place.
        self._quant = self.config.quant_settings
        if self._quant is not None and (self.tp is not None or not self.config.injects):
            raise ValueError(
                "the Hybrid Engine's inference config sets `quant`: a quantized inference copy needs kernel injection "
                "and one inference rank (no inference_tp_size > 1); remove `quant` or those settings."
            )
        self.release_inference_cache = bool(release_inference_cache)
        self.refresh_policy = refresh
        self.stats = HybridStats()
        self._in_inference = False
        self._mode_before: bool | None = None
        self._t_eval: float | None = None
        self._t_train: float | None = None
        self._fingerprint: Any = None
        self._dirty = True
        if refresh == "auto":
            _count_optimizer_steps()
        self.module: nn.Module | None = self._build() if self.enabled else None
        if not self.enabled:
            logger.warning(
                "hf_dsinfer: hybrid_engine.enabled is false in the DeepSpeed config: no inference copy is built and "
                'generate runs on the training model (HF\'s loop). Set "enabled": true to use the Hybrid Engine.'
            )

    # -- building the inference copy --------------------------------------------------------------------------------

    def _build(self) -> nn.Module:
        """The inference copy: same class and config, inference dtype, fused layers, filled from the training model."""
        hf = self.weights.hf_model
        quantizer = getattr(hf, "hf_quantizer", None)
        if quantizer is not None or getattr(hf, "is_quantized", False):
            method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "?")
            raise ValueError(
                f"the training model is quantized ({method}); the Hybrid Engine needs plain base weights to copy "
                "(QLoRA is not supported). Train on a bf16/fp16/fp32 base model."
            )
        config = copy.deepcopy(hf.config)
        config.use_cache = True  # training often turns it off (gradient checkpointing); generation needs it
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        dtype = self.config.torch_dtype
        with torch.device("meta"):  # structure only: no memory, no random init
            infer = hf_compat.model_from_config(type(hf), config, dtype=dtype)
        match_layer_lists(self.weights, infer)
        self.weights.check_modules(infer)  # unknown adapters are refused before any memory is allocated
        if self.tp is not None:
            self.tp.shard(infer)  # on meta: only this rank's slices are allocated below
        aliases: dict[int, list[str]] = {}
        for name, p in infer.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        infer.to_empty(device=self.device)
        retie(infer, [names for names in aliases.values() if len(names) > 1])
        with torch.no_grad():
            # Buffers (rotary frequencies) come from the training model: injection builds its tables from them.
            for name, buf in infer.named_buffers():
                src = self.weights.buffer(name)
                if src is None:
                    raise RuntimeError(f"the training model has no buffer {name!r} to copy into the inference copy")
                buf.copy_(self.weights.full(src.detach()))
        infer.eval().requires_grad_(False)
        from ..integration.apply import CONFIG_ATTR  # the attribute the generation layer reads the config from

        setattr(infer, CONFIG_ATTR, self.config)
        if self.config.replace_with_kernel_inject:
            from ..integration.apply import tp_layout  # None unless the copy was split above

            # no policy: one warning, the copy keeps HF's modules (split by AutoTP under TP; still correct)
            infer = inject(infer, self.config, tp_layout(infer))
            row_major_head(infer)  # re-packed at each switch: a K-major head was transposed first
        if self._quant is not None:
            record = get_injection(infer)
            if record is None:
                raise ValueError(
                    f"the Hybrid Engine's inference config sets `quant` but {type(hf).__name__} has no fused layers "
                    "(no kernel-injection policy); a quantized inference copy needs them. Remove `quant`."
                )
            from ..integration.quant_config import quantize_fused_layers_

            quantize_fused_layers_(record.runtime.layers, self._quant)  # values come with the first refresh
        # hf_dsinfer's decoding loop (and, with enable_cuda_graph on CUDA, the per-bucket decode graphs), exactly as
        # on a model loaded with an inference config. The graphs read the parameters refreshed in place below.
        from ..generation import install_generate

        install_generate(infer, self.config, get_injection(infer))
        self._plan(infer)
        self._refresh(infer)
        self._share(infer)
        self._fingerprint = self._current_fingerprint()
        self._dirty = False
        return infer

    def _share(self, infer: nn.Module) -> None:
        """Frozen (and, full fine-tuning, trainable) weights: the training model's storage becomes the inference
        buffers' (:mod:`.shared_base`)."""
        record = get_injection(infer)
        if self.share_base is False or record is None:
            return
        if self.tp is not None or self._quant is not None:
            why = "inference_tp_size > 1 (resharded)" if self.tp is not None else "a quantized copy"
            logger.info("hf_dsinfer HybridEngine: %s: the frozen base weights are copied, not shared", why)
            return
        from .shared_base import SharedBase

        shared = SharedBase(self, infer, record)
        if shared.shared:
            self._shared = shared
            shared.refresh_lora(self.weights)
            cpu_packed.invalidate(infer)

    def _plan(self, infer: nn.Module) -> None:
        """Which inference parameters come from fused weight maps and which are copied by name; every one must be
        covered, or a refresh would leave stale values behind."""
        record = get_injection(infer)
        fused: set[str] = set()
        if record is not None:
            for i, wmap in enumerate(record.weight_maps):
                layer = record.runtime.layers[i]
                names = {n for n, _ in layer.named_parameters()}
                missing = names - set(wmap)
                if missing:
                    raise RuntimeError(
                        f"{type(record.policy).__name__}: fused layer {i} has parameters {sorted(missing)} that its "
                        "weight map does not fill; the Hybrid Engine cannot refresh them."
                    )
                fused.update(f"{record.layers_prefix}.{i}.{n}" for n in names)
        self._plain = [(n, p) for n, p in infer.named_parameters() if n not in fused]

    # -- the weight refresh -----------------------------------------------------------------------------------------

    def _refresh(self, infer: nn.Module) -> None:
        """Copy (gather, LoRA-fuse, re-pack) every training weight into the inference buffers, in place."""
        w = self.weights
        record = get_injection(infer)
        shared = self._shared.shared if self._shared is not None else set()
        with torch.no_grad():
            if record is not None:
                train_layers = w.module(record.layers_prefix)
                for i, wmap in enumerate(record.weight_maps):
                    prefix = f"{record.layers_prefix}.{i}."
                    layer = record.runtime.layers[i]
                    if shared:  # the frozen base slices are the training weights themselves: never written
                        wmap = {k: v for k, v in wmap.items() if id(layer.get_parameter(k)) not in shared}
                    with w.gathered(train_layers[i]):
                        get = lambda n, p=prefix: self._read(p + n)  # noqa: E731
                        if self._quant is not None:  # quantized copy: quantize into the existing buffers
                            from ..integration.quant_config import refresh_fused_quantized

                            refresh_fused_quantized(record.runtime.layers[i], wmap, get)
                        else:
                            record.policy.pack_into(infer, i, record.runtime.layers[i], get, wmap)
            for name, param in self._plain:
                if id(param) in shared:
                    continue
                with w.gathered(w.module(name.rpartition(".")[0])):
                    value = self._read(name)
                    if value.shape != param.shape:
                        raise ValueError(f"{name}: training shape {tuple(value.shape)} != {tuple(param.shape)}")
                    param.data.copy_(value)
        unchanged: set[int] = set()
        if self._shared is not None:
            self._shared.copy_unlinked(w)  # shared tensors whose .data was rebound since: copied, never stale
            recast = self._shared.recast_changed(w)  # frozen tensors cast once: again only if they changed
            self._shared.refresh_lora(w)  # LoRA side paths of the shared base, in place
            unchanged = self._shared.unchanged() - recast
        # The writes above go through .data, which the version counter does not see, and the optimizer's writes to
        # shared trainable weights bump the training tensors' counters, not these: the CPU packed GEMM copies of every
        # weight that may have changed are re-packed now, so the switch (refresh_ms) pays for them, not the generate.
        from .memory import repack

        repack(infer, unchanged)

    def _read(self, name: str) -> torch.Tensor:
        """The effective training value of HF parameter ``name`` (LoRA fused, gathered): this rank's slice under TP."""
        value = self.weights.get(name)
        return self.tp.local(name, value) if self.tp is not None else value

    def _current_fingerprint(self) -> Any:
        if self.refresh_policy != "auto":
            return None
        return _OPTIMIZER_STEPS[0], self.weights.fingerprint()

    def mark_dirty(self) -> None:
        """Force a refresh at the next ``eval()`` (after writing weights through ``.data``, with refresh="auto")."""
        self._dirty = True

    def refresh(self) -> None:
        """Copy the training weights into the inference buffers now (``eval()`` does this for you)."""
        if self.module is None:
            return
        self._refresh(self.module)
        self._fingerprint = self._current_fingerprint()
        self._dirty = False

    # -- switching --------------------------------------------------------------------------------------------------

    def _now(self) -> float:
        """Host time after the device finished its queued work (so phases are measured, not just launched)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def in_inference(self) -> bool:
        """True between ``eval()`` and ``train()``."""
        return self._in_inference

    def eval(self) -> HybridEngine:
        """Enter inference mode: refresh the inference buffers from the training weights, training model to eval."""
        if self._in_inference:
            return self
        now = self._now()
        last = self.stats.last
        if last is not None and not last.complete and self._t_eval is not None:
            train_ms = (now - self._t_train) * 1e3 if self._t_train is not None else 0.0
            self.stats.finish(last, (now - self._t_eval) * 1e3, train_ms)
        it = self.stats.start()
        self._t_eval, self._t_train = now, None
        self._mode_before = self.training_model.training
        self.training_model.eval()
        if self._asleep is not None:  # sleep() freed the copy: storage back and a full refresh, timed as the wake
            t0 = self._now()
            self.wake()
            it.wake_ms = (self._now() - t0) * 1e3
            it.refreshed = True
        fingerprint = self._current_fingerprint()
        stale = self.refresh_policy == "always" or self._dirty or fingerprint != self._fingerprint
        if self.tp is not None and self.refresh_policy == "auto":
            stale = self.tp.any_rank(stale, self.device)  # a group refreshes together: no rank keeps stale slices
        if self.module is not None and stale and not it.wake_ms:
            self.weights.gather_s = 0.0
            t0, c0 = self._now(), time.process_time()
            self.refresh()
            it.refresh_ms = (self._now() - t0) * 1e3
            it.refresh_cpu_ms = (time.process_time() - c0) * 1e3
            it.gather_ms = self.weights.gather_s * 1e3
            it.refreshed = True
        self._in_inference = True
        return self

    def _leave(self, mode: bool) -> HybridEngine:
        if not self._in_inference:
            self.training_model.train(mode)
            return self
        if self.release_inference_cache:
            self.release_cache()
        self.training_model.train(mode)
        self._in_inference = False
        self._t_train = self._now()
        return self

    def train(self, mode: bool = True) -> HybridEngine:
        """Leave inference mode and put the training model in training mode (``train(False)`` is ``eval()``)."""
        if not mode:
            return self.eval()
        return self._leave(True)

    def restore(self) -> HybridEngine:
        """Leave inference mode, putting the training model back in the mode it had at ``eval()``."""
        mode = self._mode_before if self._mode_before is not None else self.training_model.training
        return self._leave(mode)

    @contextmanager
    def inference(self) -> Iterator[HybridEngine]:
        """``with he.inference(): ...``: ``eval()`` on entry (unless already in it), ``restore()`` on exit."""
        entered = not self._in_inference
        self.eval()
        try:
            yield self
        finally:
            if entered:
                self.restore()

    def release_cache(self) -> None:
        """Free the inference copy's static KV cache and drop CUDA graphs that read it (re-captured on next use)."""
        if self.module is None:
            return
        record = get_injection(self.module)
        if record is not None:
            record.runtime.cache.release()
        state = getattr(self.module, GEN_ATTR, None)
        graphs = getattr(state, "graphs", None)
        if graphs is not None and graphs.runner is not None:
            # The graphs replay the freed cache's addresses: drop them with their memory pool and static inputs;
            # DecodeGraphs.prepare builds and captures a new runner over the next cache.
            graphs.runner.reset()
            graphs.runner = None

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds on top of the training model (:func:`.memory.engine_memory`).

        ``weights``: the inference copy's own parameters and buffers (LoRA side paths included; storage shared with
        the training model's frozen base not counted), ``kv_cache``: the static KV cache as allocated now,
        ``cpu_packed``: oneDNN-packed CPU copies of its linears, ``cuda_graphs``: the decode graphs' memory pool,
        ``shared_with_training``: bytes of the frozen base both models use (informative, not held twice).
        """
        from .memory import engine_memory

        return engine_memory(self)

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and the next :meth:`wake` / ``eval()``."""
        return self._asleep is not None

    def sleep(self) -> int:
        """Free the inference copy's own weights, the KV cache, packed CPU copies and decode graphs until the next
        ``eval()`` (which wakes it: storage back, then a full refresh; the time is ``stats.last.wake_ms``). For full
        fine-tuning, where the copy is as large as the model. Storage shared with the training model stays. Returns
        the bytes freed."""
        if self.module is None or self._asleep is not None:
            return 0
        if self._in_inference:
            self.restore()
        from .memory import sleep

        return sleep(self)

    def wake(self) -> None:
        """Give the inference copy its memory back and refresh it (``eval()`` does this for you)."""
        if self._asleep is None:
            return
        from .memory import wake

        wake(self)
        self.refresh()

    def buffer_pointers(self) -> dict[str, int]:
        """``{name: data_ptr}`` of the inference buffers (constant for the engine's lifetime)."""
        return {n: p.data_ptr() for n, p in self.module.named_parameters()} if self.module is not None else {}

    def __repr__(self) -> str:
        mode = "inference" if self._in_inference else "training"
        if self.module is None:
            return f"HybridEngine(disabled: generate runs on the training model, mode={mode}, {self.stats!r})"
        return (
            f"HybridEngine({type(self.module).__name__}, dtype={self.config.dtype}, "
            f"injected={get_injection(self.module) is not None}, "
            f"{f'inference_tp_size={self.tp.group.size}, ' if self.tp is not None else ''}mode={mode}, {self.stats!r})"
        )
