"""What ``hf-dsinfer serve`` sizes before it starts: the context length and the paged KV cache.

Context (``--max-model-len``): the model's own limit (``max_position_embeddings`` or its family's name for it; for
``dynamic`` / ``longrope`` rotary scaling the original length, past which the fused layers' one table is not exact)
unless the user asks for less. It becomes the inference config's ``max_out_tokens`` (the position tables and the
longest request). That costs little by itself: the rotary table is ``max_out_tokens x head_dim`` floats and the static
KV cache of ``generate`` is allocated only if ``generate`` runs, which the server never calls.

KV cache (``--num-blocks``, ``--kv-cache-memory``, ``--gpu-memory-utilization``): see :func:`plan_kv_cache`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CPU_KV_CACHE_BYTES", "KVPlan", "model_context_limit", "parse_bytes", "plan_kv_cache"]

#: The CPU default's ceiling for the KV cache (raise it with --kv-cache-memory).
CPU_KV_CACHE_BYTES = 1 << 30
_CONTEXT_NAMES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30,
          "ti": 1 << 40}  # fmt: skip


def model_context_limit(config: Any) -> tuple[int | None, str]:
    """(the longest sequence ``config`` supports, where that number comes from); (None, why) when it says none."""
    configs = [config, getattr(config, "text_config", None)]
    for cfg in [c for c in configs if c is not None]:
        for name in _CONTEXT_NAMES:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
                rope = rope if isinstance(rope, dict) else {}
                original = rope.get("original_max_position_embeddings")
                if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope") and original:
                    return min(value, int(original)), f"{name}, capped at the rotary scaling's original length"
                return value, f"the model's {name}"
    return None, "the model's config states no maximum length"


def parse_bytes(text: str | int) -> int:
    """``"2GiB"``, ``"1.5G"``, ``"500M"`` or a plain number of bytes -> bytes (ValueError naming the format)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().removesuffix("b")
    digits = s.rstrip("kmgtib")
    unit = s[len(digits) :]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"--kv-cache-memory {text!r}: give bytes, e.g. 2147483648, 2GiB or 2G") from None
    if value < 1:
        raise ValueError(f"--kv-cache-memory {text!r} must be positive")
    return int(value)


@dataclass(frozen=True)
class KVPlan:
    """The paged cache ``hf-dsinfer serve`` builds: ``num_blocks`` of ``block_size`` tokens, and why that many."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    dtype: torch.dtype
    reason: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self, max_model_len: int) -> str:
        full = self.tokens // max(1, max_model_len)
        return (f"KV cache {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens, "
                f"{self.nbytes / 2**30:.2f} GiB ({str(self.dtype).removeprefix('torch.')}, "
                f"{self.bytes_per_token / 1024:.1f} KiB per token; {full} request(s) of the full context at once; "
                f"{self.reason})")  # fmt: skip


def kv_bytes_per_token(model: Any) -> tuple[int, torch.dtype]:
    """Bytes one token's keys and values take in every layer of the injected ``model``, and their dtype."""
    from ..policies.injection import get_injection

    record = get_injection(model)
    if record is None:
        raise ValueError("the model has no fused layers (kernel injection): the serving engine cannot run it")
    from ..modules.quant_linear import activation_dtype

    dtype = activation_dtype(model.get_output_embeddings())  # a quantized LM head stores integers
    specs = [layer.attn.spec for layer in record.runtime.layers]
    return 2 * dtype.itemsize * sum(s.num_kv_heads * s.head_dim for s in specs), dtype


def plan_kv_cache(model: Any, *, block_size: int, max_num_seqs: int, max_model_len: int, max_batch_tokens: int,
                  num_blocks: int | None = None, kv_cache_memory: int | None = None,
                  gpu_memory_utilization: float | None = None) -> KVPlan:  # fmt: skip
    """How many KV blocks to build, by the first that applies:

    * ``num_blocks``: that many;
    * ``kv_cache_memory`` (bytes, vLLM's ``--kv-cache-memory``): as many blocks as fit in it;
    * on a GPU, ``gpu_memory_utilization`` (default 0.9, vLLM's): the share of the device's memory this server may
      use, minus what is in use now (weights, other processes) and room for one step's activations;
    * on a CPU: what the limits can need, ``max_num_seqs x max_model_len`` tokens, capped at
      :data:`CPU_KV_CACHE_BYTES` (1 GiB; a full cache preempts, it does not fail).

    Never fewer blocks than one request of ``max_model_len`` tokens needs (the engine refuses longer requests).
    """
    bpt, dtype = kv_bytes_per_token(model)
    block_bytes = bpt * block_size
    floor = -(-max_model_len // block_size)
    device = model.get_output_embeddings().weight.device
    need = -(-max_num_seqs * max_model_len // block_size)
    if num_blocks is not None:
        return KVPlan(num_blocks, block_size, bpt, dtype, "--num-blocks")
    if kv_cache_memory is not None:
        blocks = kv_cache_memory // block_bytes
        if blocks < floor:
            raise ValueError(f"--kv-cache-memory {kv_cache_memory} bytes holds {blocks * block_size} tokens but one "
                             f"request of --max-model-len {max_model_len} needs {floor * block_size}: raise it to at "
                             f"least {floor * block_bytes} or lower --max-model-len")  # fmt: skip
        return KVPlan(blocks, block_size, bpt, dtype, "--kv-cache-memory")
    if device.type == "cuda":
        util = 0.9 if gpu_memory_utilization is None else gpu_memory_utilization
        if not 0 < util <= 1:
            raise ValueError(f"--gpu-memory-utilization {util}: pass a fraction in (0, 1]")
        free, total = torch.cuda.mem_get_info(device)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        hidden, vocab = int(getattr(cfg, "hidden_size", 4096)), int(getattr(cfg, "vocab_size", 32000))
        activations = max_batch_tokens * hidden * 4 * 32 + max_num_seqs * vocab * 4 * 3  # a step's peak, estimated
        budget = int(util * total) - (total - free) - activations
        blocks = budget // block_bytes
        if blocks < floor:
            raise ValueError(f"--gpu-memory-utilization {util} leaves {max(0, budget) / 2**30:.2f} GiB for the KV "
                             f"cache ({(total - free) / 2**30:.2f} GiB of {total / 2**30:.2f} GiB in use), less than "
                             f"one request of --max-model-len {max_model_len}: raise it, lower --max-model-len, or set "
                             "--kv-cache-memory")  # fmt: skip
        return KVPlan(blocks, block_size, bpt, dtype, f"--gpu-memory-utilization {util}")
    if gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization applies to a GPU; on a CPU use --kv-cache-memory or --num-blocks")
    blocks = min(need, CPU_KV_CACHE_BYTES // block_bytes)
    reason = (f"the CPU default: --max-num-seqs {max_num_seqs} x --max-model-len {max_model_len} tokens"
              if blocks == need else f"the CPU default: capped at {CPU_KV_CACHE_BYTES / 2**30:.0f} GiB; "
              "--kv-cache-memory raises it")  # fmt: skip
    if blocks < floor:
        blocks, reason = floor, "the CPU default: one request of --max-model-len (more than 1 GiB)"
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else None
    if ram and blocks * block_bytes > ram // 2:
        raise ValueError(f"the KV cache for one request of --max-model-len {max_model_len} needs "
                         f"{blocks * block_bytes / 2**30:.1f} GiB, more than half of this machine's "
                         f"{ram / 2**30:.1f} GiB: lower --max-model-len")  # fmt: skip
    return KVPlan(blocks, block_size, bpt, dtype, reason)
