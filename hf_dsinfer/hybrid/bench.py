"""The Hybrid Engine benchmark: generation inside a LoRA training loop, HF ``generate`` vs the engine.

The setup follows the RLHF-style measurement of DeepSpeed's Hybrid Engine (e.g. OPT-1.3B shape, batch 8, prompt
256, 128 new tokens, LoRA): every iteration generates ``new_tokens`` tokens for ``batch`` prompts, then takes one
training step (LM loss on the prompts, AdamW on the LoRA factors). Two contenders run the same loop on the same
random-weight model:

* ``hf``: ``peft_model.generate`` in eval mode (HF's loop over unmerged LoRA layers), then ``train()``;
* ``hybrid``: ``HybridEngine.eval()`` (refresh: LoRA fused into the packed inference copy), ``generate``, ``train()``.

Each reports per-iteration medians: generate, refresh (hybrid only), training and end-to-end milliseconds, generated
tokens per second and peak memory. ``run_hybrid_bench`` returns the rows; the CLI (``hf-dsinfer bench --hybrid``)
prints them.
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


def _lora_model(preset: str, device: torch.device, dtype: torch.dtype, rank: int, seed: int) -> nn.Module:
    """A random-weight model of ``preset`` with LoRA on every linear layer (non-zero B, so fusing matters)."""
    from peft import LoraConfig, get_peft_model

    from ..bench import build_random_model, preset_config  # the shared shape presets

    model = build_random_model(preset_config(preset), device, dtype, seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
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


def _row(peer: str, preset: str, batch: int, prompt_len: int, new_tokens: int, times: dict[str, list[float]],
         device: torch.device, note: str = "", **extra: Any) -> dict:  # fmt: skip
    med = {k: round(statistics.median(v), 3) if v else None for k, v in times.items()}
    gen_ms = med.get("generate_ms")
    return dict(
        peer=peer, name={"hf": "HF generate (peft)", "hybrid": "hf_dsinfer HybridEngine"}[peer], preset=preset,
        batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, **med,
        tokens_per_s=round(batch * new_tokens * 1e3 / gen_ms, 2) if gen_ms else None,
        peak_mem_mib=_peak_mib(device), note=note, **extra,
    )  # fmt: skip


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
) -> list[dict]:
    """Run both contenders for ``iterations`` measured iterations (after one warm-up); one row each.

    Rows: ``peer``, ``name``, ``preset``, ``batch``, ``prompt_len``, ``new_tokens``, ``generate_ms``,
    ``refresh_ms`` (hybrid), ``train_ms``, ``e2e_ms`` (medians), ``tokens_per_s`` (generated tokens over generate
    time), ``peak_mem_mib`` (CUDA only), ``injected`` (hybrid: fused layers in use) and ``note``. A contender that
    fails is reported with its error in ``note``.
    """
    from .engine import HybridEngine

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = DTYPES[dtype]
    model = _lora_model(preset, dev, torch_dtype, lora_rank, seed)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=g).to(dev)
    gen_kw = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
    )  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rows = []

    # -- HF generate inside training ---------------------------------------------------------------------------
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times: dict[str, list[float]] = {"generate_ms": [], "train_ms": [], "e2e_ms": []}
    try:
        for i in range(iterations + 1):
            t0 = _now(dev)
            model.eval()
            with torch.no_grad():
                model.generate(**gen_kw)
            t1 = _now(dev)
            _train_step(model, optimizer, ids)
            t2 = _now(dev)
            if i:  # iteration 0 is the warm-up
                times["generate_ms"].append((t1 - t0) * 1e3)
                times["train_ms"].append((t2 - t1) * 1e3)
                times["e2e_ms"].append((t2 - t0) * 1e3)
        rows.append(_row("hf", preset, batch, prompt_len, new_tokens, times, dev))
    except Exception as e:  # noqa: BLE001 - reported in the row, the other contender still runs
        rows.append(_row("hf", preset, batch, prompt_len, new_tokens, times, dev, note=f"n/a: {e!s:.160}"))

    # -- the Hybrid Engine -------------------------------------------------------------------------------------
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = {"generate_ms": [], "refresh_ms": [], "train_ms": [], "e2e_ms": []}
    try:
        he = HybridEngine(
            model, inference_config=dict(
                dtype=dtype, max_out_tokens=prompt_len + new_tokens, max_batch_size=batch,
                enable_cuda_graph=dev.type == "cuda",
            ),
        )  # fmt: skip
        from ..policies import get_injection

        for i in range(iterations + 1):
            t0 = _now(dev)
            he.eval()
            he.generate(**gen_kw)
            he.train()
            t1 = _now(dev)
            _train_step(model, optimizer, ids)
            t2 = _now(dev)
            it = he.stats.last
            if i:
                times["generate_ms"].append(it.generate_ms)
                times["refresh_ms"].append(it.refresh_ms)
                times["train_ms"].append((t2 - t1) * 1e3)
                times["e2e_ms"].append((t2 - t0) * 1e3)
        copy_mib = sum(p.numel() * p.element_size() for p in he.module.parameters()) / 2**20
        rows.append(_row(
            "hybrid", preset, batch, prompt_len, new_tokens, times, dev,
            injected=get_injection(he.module) is not None, inference_copy_mib=round(copy_mib, 1),
        ))  # fmt: skip
    except Exception as e:  # noqa: BLE001
        rows.append(_row("hybrid", preset, batch, prompt_len, new_tokens, times, dev, note=f"n/a: {e!s:.160}"))
    return rows
