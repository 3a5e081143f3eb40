"""The Hybrid Engine benchmark: generation inside a training loop, HF ``generate`` vs the engine, in one run.

Every iteration generates ``new_tokens`` tokens for ``batch`` prompts, then takes one training step (LM loss on the
prompts, AdamW). Two training setups, each on one random-weight model of ``preset`` that both contenders share
(their iterations alternate, so a busy machine slows both alike):

* ``full`` (full fine-tune, every weight trained): ``hf`` = ``model.generate`` in eval mode (HF's loop over the
  training model's modules) vs ``hybrid`` = ``HybridEngine.eval()`` (refresh), ``generate``, ``train()``;
* ``lora`` (peft LoRA on every linear layer, non-zero B): ``peft`` = ``peft_model.generate`` (HF's loop over the
  unmerged LoRA layers) vs ``hybrid`` (LoRA fused into the packed inference copy at each refresh).

The setup DeepSpeed published for its Hybrid Engine is OPT-1.3B, batch 8, prompt 256, 128 new tokens, LoRA.
Rows report per-iteration medians: generate, refresh (hybrid), training and end-to-end milliseconds, generated tokens
per second, peak memory (CUDA), and on hybrid rows ``speedup`` (the peer's generate time over the engine's, generate
+ refresh counted for the engine) and ``e2e_speedup``. ``run_hybrid_bench`` returns the rows; ``hf-dsinfer bench
--hybrid`` prints and saves them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def _peak_mib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return None  # the process-wide RSS peak cannot be split between contenders on CPU


def _training_model(preset: str, device: torch.device, dtype: torch.dtype, lora_rank: int, seed: int) -> nn.Module:
    """A random-weight model of ``preset``; with ``lora_rank`` > 0, peft LoRA on every linear layer (non-zero B)."""
    from .decode import build_random_model, preset_config  # the shared shape presets

    model = build_random_model(preset_config(preset), device, dtype, seed)
    if lora_rank <= 0:
        return model.requires_grad_(True)  # full fine-tune: every weight trains
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=gen)
    return peft_model


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


_NAMES = {"hf": "HF generate (training model)", "peft": "HF generate (peft, unmerged LoRA)",
          "hybrid": "hf_dsinfer HybridEngine"}  # fmt: skip


def _row(
    peer: str,
    mode: str,
    preset: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    times: dict[str, list[float]],
    device: torch.device,
    error: str | None = None,
    **extra: Any,
) -> dict:
    """One contender's row; ``error`` (``Type: message``) marks a contender that raised: no figures, ``failed``."""
    med = {k: round(statistics.median(v), 3) if v and error is None else None for k, v in times.items()}
    gen_ms = med.get("generate_ms")
    return dict(
        peer=peer, mode=mode, name=_NAMES[peer], preset=preset, batch=batch, prompt_len=prompt_len,
        new_tokens=new_tokens, **med, tokens_per_s=round(batch * new_tokens * 1e3 / gen_ms, 2) if gen_ms else None,
        peak_mem_mib=_peak_mib(device), failed=error is not None, error=error,
        note=f"FAILED: {error}" if error else "", **extra,
    )  # fmt: skip


def _bench_mode(mode: str, preset: str, batch: int, prompt_len: int, new_tokens: int, dev: torch.device,
                dtype: str, iterations: int, lora_rank: int, seed: int) -> list[dict]:  # fmt: skip
    """Both contenders of one training setup, alternating on one shared model; a row each."""
    from ..hybrid.engine import HybridEngine
    from ..log import logger
    from ..policies import get_injection
    from .report import error_text

    model = _training_model(preset, dev, DTYPES[dtype], lora_rank if mode == "lora" else 0, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).to(dev)
    gen_kw = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
    )  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    peer = "peft" if mode == "lora" else "hf"
    errors: dict[str, str] = {}  # contender -> its error; a contender that raised is not called again
    try:
        he = HybridEngine(
            model, inference_config=dict(
                dtype=dtype, max_out_tokens=prompt_len + new_tokens, max_batch_size=batch,
                enable_cuda_graph=dev.type == "cuda",
            ),
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the engine failing is the bench's finding, the HF peer still runs
        logger.debug("bench --hybrid: HybridEngine failed to start", exc_info=True)
        errors["hybrid"] = error_text(e)
    times = {peer: {"generate_ms": [], "train_ms": [], "e2e_ms": []},
             "hybrid": {"generate_ms": [], "refresh_ms": [], "train_ms": [], "e2e_ms": []}}  # fmt: skip

    def run_peer(record: bool) -> None:
        t0 = _now(dev)
        model.eval()
        with torch.no_grad():
            model.generate(**gen_kw)
        t1 = _now(dev)
        _train_step(model, optimizer, ids)
        t2 = _now(dev)
        if record:
            for key, value in (("generate_ms", t1 - t0), ("train_ms", t2 - t1), ("e2e_ms", t2 - t0)):
                times[peer][key].append(value * 1e3)

    def run_hybrid(record: bool) -> None:
        t0 = _now(dev)
        he.eval()
        he.generate(**gen_kw)
        he.train()
        t1 = _now(dev)
        _train_step(model, optimizer, ids)
        t2 = _now(dev)
        it = he.stats.last
        if record:
            times["hybrid"]["generate_ms"].append(it.generate_ms)
            times["hybrid"]["refresh_ms"].append(it.refresh_ms)
            times["hybrid"]["train_ms"].append((t2 - t1) * 1e3)
            times["hybrid"]["e2e_ms"].append((t2 - t0) * 1e3)

    def attempt(name: str, run: Any, record: bool) -> None:
        if name in errors:
            return
        try:
            run(record)
        except Exception as e:  # noqa: BLE001 - reported in its row, the other contender still runs
            logger.debug("bench --hybrid: %s failed", name, exc_info=True)
            errors[name] = error_text(e)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(iterations + 1):  # iteration 0 warms both up (allocations, compiled steps, graphs)
        order = ((peer, run_peer), ("hybrid", run_hybrid))
        for name, run in order if i % 2 == 0 else order[::-1]:
            attempt(name, run, i > 0)
    peer_row = _row(peer, mode, preset, batch, prompt_len, new_tokens, times[peer], dev, errors.get(peer))
    if "hybrid" in errors:
        return [
            peer_row,
            _row("hybrid", mode, preset, batch, prompt_len, new_tokens, times["hybrid"], dev, errors["hybrid"]),
        ]
    copy_mib = sum(p.numel() * p.element_size() for p in he.module.parameters()) / 2**20
    hybrid_row = _row(
        "hybrid", mode, preset, batch, prompt_len, new_tokens, times["hybrid"], dev,
        injected=get_injection(he.module) is not None, inference_copy_mib=round(copy_mib, 1),
    )  # fmt: skip
    if peer not in errors:  # a ratio needs both contenders
        engine_ms = hybrid_row["generate_ms"] + (hybrid_row["refresh_ms"] or 0.0)
        hybrid_row["speedup"] = round(peer_row["generate_ms"] / engine_ms, 3)
        hybrid_row["e2e_speedup"] = round(peer_row["e2e_ms"] / hybrid_row["e2e_ms"], 3)
    return [peer_row, hybrid_row]


def run_hybrid_bench(
    preset: str = "tiny",
    batch: int = 8,
    prompt_len: int = 256,
    new_tokens: int = 128,
    device: str | torch.device | None = None,
    dtype: str = "fp16",
    iterations: int = 3,
    lora_rank: int = 16,
    seed: int = 0,
    modes: tuple[str, ...] = ("full", "lora"),
) -> list[dict]:
    """Run each training setup of ``modes`` (``full``, ``lora``) for ``iterations`` measured iterations per contender
    (after one warm-up); two rows per setup: the HF peer (``hf`` or ``peft``), then ``hybrid``.

    Row keys: ``peer``, ``mode``, ``name``, ``preset``, ``batch``, ``prompt_len``, ``new_tokens``, ``generate_ms``,
    ``refresh_ms`` (hybrid), ``train_ms``, ``e2e_ms`` (medians), ``tokens_per_s`` (generated tokens over generate
    time), ``peak_mem_mib`` (CUDA only), ``failed``, ``error``, ``note``; hybrid rows add ``injected``,
    ``inference_copy_mib``, ``speedup`` (peer generate / engine generate + refresh) and ``e2e_speedup`` (when both
    ran). A contender that raises gets ``failed=True``, its error and no figures; the other one still runs.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows: list[dict] = []
    for mode in modes:
        if mode not in ("full", "lora"):
            raise ValueError(f"unknown hybrid bench mode {mode!r}; use 'full' and/or 'lora'")
        try:
            rows += _bench_mode(mode, preset, batch, prompt_len, new_tokens, dev, dtype, iterations, lora_rank, seed)
        except Exception as e:  # noqa: BLE001 - the setup failed (model, peft): both rows failed, the other setup runs
            from .report import error_text

            peer = "peft" if mode == "lora" else "hf"
            error = f"setup: {error_text(e)}"
            no_times = {"generate_ms": [], "train_ms": [], "e2e_ms": []}  # the row's keys, no figures
            rows += [
                _row(p, mode, preset, batch, prompt_len, new_tokens, no_times, dev, error) for p in (peer, "hybrid")
            ]
    return rows
