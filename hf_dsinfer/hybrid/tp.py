"""A tensor-parallel inference copy for the Hybrid Engine (``inference_tp_size > 1``, DeepSpeed's name).

Under ``torchrun`` (gloo on CPU, NCCL on GPU) every rank holds the training model (DDP-replicated or FSDP2-sharded)
and the world is cut into *inference groups* of ``inference_tp_size`` consecutive ranks (``tp_size`` must divide the
world size, as for an inference model). Within a group the inference copy is split by AutoTP
(:mod:`hf_dsinfer.parallel`) before kernel injection, so each rank holds only its slice of the fused weights:

* **Building** (:meth:`InferenceTP.shard`): the plan (:func:`~hf_dsinfer.parallel.build_plan`) is made and applied on
  the *meta* copy, so only this rank's slices are ever allocated.
* **Refreshing** (:meth:`InferenceTP.local`): the engine reads each training weight as before (LoRA fused, FSDP2
  DTensors gathered to the full tensor with ``full_tensor()``) and copies only this rank's slice of it into the
  persistent buffer, in place. Peak extra memory during a refresh: one full (LoRA-fused) tensor.
* **Generating** (:meth:`InferenceTP.generate`): the ranks of a group run one forward together, so they must
  generate one batch together. Each rank's prompts are gathered (left-padded to the group's widest prompt, rows of
  the ranks in rank order), the group generates the concatenated batch with rank 0's RNG state (so sampled tokens
  agree on every rank), and each rank gets back its own rows, cut to the width and length a ``tp_size=1`` engine
  would have returned for them. ``__call__`` (scoring) gathers the same way (right-padded for HF's modules).

Every rank of a group must call ``eval()`` / ``generate`` / ``generate_batch`` / ``__call__`` the same number of
times, in the same order, with the same generation settings (checked: settings that differ raise on every rank
instead of hanging). The prompts, and their number, may differ.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
from torch import nn

from ..generation.processors import resolve_generation_config
from ..log import logger
from ..parallel.groups import TPGroup, init_distributed, resolve_tp_group

# keyword arguments whose output or effect cannot be split back into per-rank rows
_REFUSED = ("streamer", "inputs_embeds", "position_ids", "past_key_values", "output_attentions",
            "output_hidden_states")  # fmt: skip


def inference_group(tp_size: int, setting: str, tp_group: Any = None, mpu: Any = None) -> TPGroup:
    """The inference group of this rank: ``tp_size`` consecutive ranks of the world (or the given group / mpu).

    ``setting`` names the option in error messages (``hybrid_engine.inference_tp_size`` or
    ``tensor_parallel.tp_size``). Refuses, naming it: no process group (not launched with torchrun), a size larger
    than the world, and a world size that is not a multiple of it.
    """
    import torch.distributed as dist

    if not init_distributed():
        raise ValueError(
            f"{setting}={tp_size} splits the inference copy over {tp_size} processes, but torch.distributed is not "
            f"initialized and WORLD_SIZE is not set: launch one process per rank (`torchrun --nproc_per_node "
            f"{tp_size} train.py`, or accelerate launch) or set {setting} to 1."
        )
    world = dist.get_world_size()
    if tp_group is None and mpu is None:
        if tp_size > world:
            raise ValueError(
                f"{setting}={tp_size} is larger than the world size {world} (the number of launched processes); "
                f"set {setting} to at most {world}, or launch more processes."
            )
        if world % tp_size:
            raise ValueError(
                f"{setting}={tp_size} does not divide the world size {world}: inference groups are blocks of "
                f"{setting} consecutive ranks, so the world size must be a multiple of it; use a divisor of {world}."
            )
    return resolve_tp_group(tp_size, tp_group, mpu)


def _digest(value: Any) -> int:
    """A 63-bit hash of ``repr(value)``: equal settings give equal numbers on every rank (object addresses, which
    differ between processes, are left out)."""
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little") >> 1


class InferenceTP:
    """This rank's share of a tensor-parallel inference copy: its group, the AutoTP plan, the gathered generation."""

    def __init__(self, group: TPGroup, grain: int, injection_policy: Any = None, ep_size: int = 1):
        self.group = group
        self.grain = grain
        self.injection_policy = injection_policy
        self.ep_size = ep_size
        self.plan: Any = None

    # -- building and refreshing ------------------------------------------------------------------------------------

    def shard(self, infer: nn.Module) -> None:
        """Split the (meta) inference copy in place: parameters shrink to this rank's slice shapes, row-parallel
        wrappers, vocab-parallel hooks and local head counts are installed (the same plan as an inference model)."""
        from ..parallel.apply import apply_plan
        from ..parallel.autotp import build_plan

        g = self.group
        self.plan = build_plan(infer, g.size, g.rank, self.grain, self.injection_policy, self.ep_size)
        apply_plan(infer, self.plan, g)  # on meta: Shard.take only computes shapes

    def local(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full training value of HF parameter ``name`` (a view; copied by the caller)."""
        shard = self.plan.shards.get(name)
        if shard is None:
            return value  # replicated (norms, biases of row-parallel projections, ...)
        # checks that the training tensor is the full one; MoE experts may be cut twice (experts, then features)
        return shard.narrow(value)

    # -- collectives ------------------------------------------------------------------------------------------------

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        pieces = [torch.empty_like(tensor) for _ in range(self.group.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group.group)
        return pieces

    def _agree(self, device: torch.device, values: list[int], error: BaseException | None) -> torch.Tensor:
        """All-gather ``values`` (plus an error flag) from every rank: ``[ranks, len(values) + 1]``. A rank whose
        request failed locally raises its own error; the others raise naming it, so no rank waits forever."""
        mine = torch.tensor([*values, 1 if error is not None else 0], dtype=torch.long, device=device)
        table = torch.stack(self._all_gather(mine)).cpu()
        if error is not None:
            raise error
        failed = [r for r in range(self.group.size) if table[r, -1]]
        if failed:
            raise RuntimeError(
                f"rank(s) {failed} of this inference group (inference_tp_size={self.group.size}) refused their "
                "request; this rank stops too (see their error)."
            )
        return table[:, :-1]

    def any_rank(self, flag: bool, device: torch.device) -> bool:
        """True when ``flag`` is true on any rank of the group (``refresh="auto"``: refresh together or not at all)."""
        return bool(self._agree(device, [int(flag)], None)[:, 0].any())

    def max_count(self, n: int, device: torch.device) -> int:
        """The largest ``n`` over the group (``generate_batch``: every rank makes the same number of calls)."""
        return int(self._agree(device, [n], None)[:, 0].max())

    def _sync_rng(self) -> dict[str, torch.Tensor]:
        """Give every rank rank 0's RNG state (the draws agree); returns this rank's own state, to put back after."""
        from ..parallel.rng import broadcast_rng_state

        saved = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            saved["cuda"] = torch.cuda.get_rng_state()
        broadcast_rng_state(self.group)
        return saved

    def _restore_rng(self, saved: dict[str, torch.Tensor]) -> None:
        # The group's first rank keeps the state the generation advanced (as a tp=1 engine would leave it); the other
        # ranks get their own stream back, so training randomness (dropout) stays per rank.
        if self.group.rank != 0:
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved:
                torch.cuda.set_rng_state(saved["cuda"])

    # -- generation -------------------------------------------------------------------------------------------------

    def generate(self, run: Any, module: nn.Module, device: torch.device, args: tuple, kwargs: dict) -> Any:
        """``run(**kwargs)`` on the group's concatenated batch; this rank's rows of the output.

        ``run`` is the engine's single-copy generate (fast loop or HF's), ``module`` the inference copy (for its
        generation defaults). Returns what a ``tp_size=1`` engine returns for this rank's prompts: same rows, same
        width (the group's extra left padding removed), same length (steps after all of this rank's rows finished
        removed), scores / logits per step cut the same way.
        """
        kwargs = dict(kwargs)
        error: BaseException | None = None
        ids = mask = None
        lengths: list[int] = [0, 0, 0, 0]
        try:
            ids, mask, kwargs = self._rows(args, kwargs, module, device)
            gen_config = resolve_generation_config(module, kwargs)
            if gen_config is None:
                raise ValueError("the generation config of this call is invalid (transformers' generate says why)")
            settings = {k: v for k, v in kwargs.items() if k != "generation_config"}
            lengths = [ids.shape[0], ids.shape[1], _digest((sorted(settings.items()), repr(gen_config))), 0]
            if gen_config.min_length:
                lengths[3] = 1  # min_length counts the prompt: refused below when the group's widths differ
        except Exception as e:  # noqa: BLE001 - re-raised by _agree after the other ranks learned of it
            error = e
        table = self._agree(device, lengths, error)
        rows, widths, digests = table[:, 0].tolist(), table[:, 1].tolist(), table[:, 2].tolist()
        if len(set(digests)) > 1:
            raise ValueError(
                "the ranks of an inference group passed different generation settings to generate(); with "
                f"inference_tp_size={self.group.size} they generate one batch together, so every setting except the "
                "prompts (max_new_tokens, sampling, eos / pad ids, generation_config, ...) must be equal on all ranks."
            )
        width = max(widths)
        if bool(table[:, 3].any()) and len(set(widths)) > 1:
            raise ValueError(
                "generate(min_length=...) counts the prompt, whose width differs between the ranks of this inference "
                "group; pass min_new_tokens instead."
            )
        own_new = None
        if gen_config.max_new_tokens is None:
            # max_length counts the prompt: the group generates enough steps for its narrowest prompt, each rank
            # keeps what max_length gives its own width.
            max_length = gen_config.max_length if gen_config.max_length is not None else 20
            own_new = max(max_length - ids.shape[1], 1)
            kwargs["max_new_tokens"] = max(max_length - min(widths), 1)
            kwargs.pop("max_length", None)
        pad = self._pad_id(gen_config)
        batch_ids, batch_mask = self._gather_rows(ids, mask, rows, width, pad, left=True)
        offset, mine = sum(rows[: self.group.rank]), ids.shape[0]
        if batch_ids.shape[0] == 0:
            return ids  # nothing to generate anywhere in the group
        saved = self._sync_rng()
        try:
            out = run(input_ids=batch_ids, attention_mask=batch_mask, **kwargs)
        finally:
            self._restore_rng(saved)
        return self._own_rows(out, offset, mine, batch_ids.shape[0], width, ids.shape[1], gen_config, own_new)

    def _rows(self, args: tuple, kwargs: dict, module: nn.Module, device: torch.device) -> tuple:
        """(input_ids [B, P], attention_mask [B, P], the other kwargs) of one rank's request; refuses what cannot be
        split back into rows."""
        for name in _REFUSED:
            value = kwargs.get(name)
            if value is not None and value is not False:
                raise ValueError(
                    f"generate({name}=...) is not supported with inference_tp_size > 1: the group generates one "
                    "concatenated batch, whose per-row extras cannot be handed back to each rank; drop it or set "
                    "inference_tp_size to 1."
                )
        if len(args) > 1:
            raise ValueError("with inference_tp_size > 1 pass generate's arguments by keyword (input_ids=...).")
        ids = args[0] if args else kwargs.pop("input_ids", None)
        if ids is None:
            ids = kwargs.pop("inputs", None)
        kwargs.pop("input_ids", None)
        mask = kwargs.pop("attention_mask", None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise ValueError("with inference_tp_size > 1, generate needs input_ids as a [batch, prompt] id tensor.")
        extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        if extra:
            raise ValueError(
                f"generate({', '.join(extra)}=<tensor>) is not supported with inference_tp_size > 1 (only input_ids "
                "and attention_mask are gathered over the inference group)."
            )
        ids = ids.to(device)
        if mask is None:
            mask = self._default_mask(ids, module, kwargs)
        mask = mask.to(device=device, dtype=torch.long)
        if ids.shape[0]:  # an empty prompt, a mask of another shape, ids outside the vocab: refused on this rank
            from ..generation.api import _check_input_ids

            _check_input_ids(module, ids, mask)
        return ids, mask, kwargs

    @staticmethod
    def _default_mask(ids: torch.Tensor, module: nn.Module, kwargs: dict) -> torch.Tensor:
        """The mask transformers infers without one: padding positions are masked when the pad id is set, occurs in
        the prompt and differs from every eos id; otherwise every position counts."""
        config = kwargs.get("generation_config") or module.generation_config
        pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
        eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
        eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        if pad is not None and pad not in eos_ids and bool((ids == pad).any()):
            return ids.ne(pad).long()
        return torch.ones_like(ids)

    @staticmethod
    def _pad_id(gen_config: Any) -> int:
        pad = gen_config.pad_token_id
        if pad is None:
            eos = gen_config.eos_token_id
            pad = (eos[0] if eos else 0) if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
        return int(pad)

    def _gather_rows(
        self, ids: torch.Tensor, mask: torch.Tensor, rows: list[int], width: int, pad: int, left: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``ids`` / ``mask`` padded to ``width`` columns (left or right, mask 0) and concatenated in rank
        order: ``[sum(rows), width]`` each. Collectives need equal shapes: rows are padded to the largest count for
        the exchange and dropped after."""
        most = max(rows)
        cols = width - ids.shape[1]
        full_ids = torch.full((most, width), pad, dtype=ids.dtype, device=ids.device)  # [R, W]
        full_mask = torch.zeros((most, width), dtype=torch.long, device=ids.device)  # [R, W]
        span = slice(cols, width) if left else slice(0, ids.shape[1])
        full_ids[: ids.shape[0], span] = ids
        full_mask[: ids.shape[0], span] = mask
        both = torch.stack([full_ids.long(), full_mask])  # [2, R, W]: one collective for both
        pieces = self._all_gather(both)
        merged = torch.cat([p[:, :n] for p, n in zip(pieces, rows)], dim=1)  # [2, sum(rows), W]
        return merged[0].to(ids.dtype), merged[1]

    @staticmethod
    def _own_rows(
        out: Any, offset: int, mine: int, total: int, width: int, own_width: int, gen_config: Any, own_new: int | None
    ) -> Any:
        """This rank's rows of the group's output, as a ``tp_size=1`` engine would have returned them."""
        seqs = out if isinstance(out, torch.Tensor) else out.sequences  # [total * k, width + N]
        k = seqs.shape[0] // total  # num_return_sequences: each prompt's k rows are adjacent
        rows = seqs[offset * k : (offset + mine) * k]  # [mine * k, width + N]
        new = rows[:, width:]  # [mine * k, N]
        steps = new.shape[1] if own_new is None else min(own_new, new.shape[1])
        eos = gen_config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        if eos_ids and new.shape[0] and steps:
            # transformers stops after the first step at which every row has finished (emitted an eos)
            hit = torch.isin(new[:, :steps], torch.tensor(eos_ids, device=new.device))  # [rows, steps]
            first = hit.float().argmax(1) + 1  # [rows] 1-based step of the first eos (argmax: the first maximum)
            steps = int(torch.where(hit.any(1), first, steps).max())
        elif not new.shape[0]:
            steps = 0
        kept = rows[:, width - own_width : width + steps]  # [mine * k, P + steps]
        if isinstance(out, torch.Tensor):
            return kept
        fields = {"sequences": kept}
        for name in ("scores", "logits"):
            per_step = getattr(out, name, None)
            if per_step is not None:
                fields[name] = tuple(s[offset * k : (offset + mine) * k] for s in per_step[:steps])
        if getattr(out, "past_key_values", None) is not None:
            logger.debug("hf_dsinfer: inference_tp_size > 1: the group's past_key_values are not returned")
        return type(out)(**fields)

    # -- scoring (forward) ------------------------------------------------------------------------------------------

    def forward(self, run: Any, device: torch.device, args: tuple, kwargs: dict) -> Any:
        """``run(input_ids=..., attention_mask=...)`` on the group's concatenated rows; this rank's ``logits [B, P, V]``
        in a ``CausalLMOutput``.

        The rows are left-padded for fused layers (which take positions from the first unmasked token, so padding
        changes nothing) and right-padded for HF's modules (which count positions from column 0; causal attention
        keeps real positions blind to padding on their right).
        """
        from transformers.modeling_outputs import CausalLMOutput

        from ..policies import get_injection

        kwargs = dict(kwargs)
        error: BaseException | None = None
        ids = mask = None
        values = [0, 0]
        try:
            ids = args[0] if args else kwargs.pop("input_ids", None)
            mask = kwargs.pop("attention_mask", None)
            if len(args) > 1 or kwargs or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
                raise ValueError(
                    "with inference_tp_size > 1 the engine's forward takes input_ids [batch, tokens] and an optional "
                    f"attention_mask only (got {sorted(kwargs) or 'positional arguments'})."
                )
            ids = ids.to(device)
            mask = torch.ones_like(ids) if mask is None else mask.to(device=device, dtype=torch.long)
            values = [ids.shape[0], ids.shape[1]]
        except Exception as e:  # noqa: BLE001 - re-raised by _agree after the other ranks learned of it
            error = e
        table = self._agree(device, values, error)
        rows, widths = table[:, 0].tolist(), table[:, 1].tolist()
        left = get_injection(run) is not None
        width = max(widths)
        batch_ids, batch_mask = self._gather_rows(ids, mask, rows, width, 0, left=left)
        offset = sum(rows[: self.group.rank])
        logits = run(input_ids=batch_ids, attention_mask=batch_mask).logits  # [total, W, V]
        cols = slice(width - ids.shape[1], width) if left else slice(0, ids.shape[1])
        return CausalLMOutput(logits=logits[offset : offset + ids.shape[0], cols])


def make_inference_tp(config: Any, from_section: bool) -> InferenceTP | None:
    """The :class:`InferenceTP` for an engine's inference config, or None when its copy runs on one rank.

    ``from_section``: the size came from DeepSpeed's ``hybrid_engine.inference_tp_size`` (named in errors), else from
    the inference config's ``tensor_parallel.tp_size``.
    """
    from ..parallel import tp_requested

    tp_cfg = config.tensor_parallel
    if not tp_requested(tp_cfg):
        return None
    setting = "hybrid_engine.inference_tp_size" if from_section else "tensor_parallel.tp_size"
    group = inference_group(tp_cfg.tp_size, setting, tp_cfg.tp_group, tp_cfg.mpu)
    if group.size == 1:
        return None
    ep_size = config.moe.expert_parallel_size if getattr(config, "moe", None) is not None else 1
    return InferenceTP(group, tp_cfg.tp_grain_size, config.injection_policy, ep_size)
