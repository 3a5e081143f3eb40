"""Ahead-of-time compile scenarios of the paged-attention kernels (``kernels/paged_attention_triton.py``).

Used two ways:

* ``aot_compile.py`` (the project's AOT test) adds :func:`paged_scenarios` to its own list;
* ``python tests/kernels/aot_paged.py --tool /path/to/triton_aot_check.py [tool args...]`` runs the shared
  ``triton_aot_check.py`` with these scenarios added to its built-in ones (it has none for paged attention), e.g.
  ``python tests/kernels/aot_paged.py --tool ../shared/tools/triton_aot_check.py . --only paged --dtypes bf16,fp16``.

Shapes: a pool of 4096 blocks of 16 slots (65536 tokens), block tables 512 wide (8192 keys per sequence); decode
batches of 1 and 32 (one token per sequence: the split-KV kernel), a mixed step of one 2048-token prefill chunk with
31 decode tokens (the varlen kernel), and the KV store of that step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

Scenario = tuple[str, str, Callable[[], None]]

# (name, H, KVH, D, window, softcap): Llama-3-8B, head dims 64/80/96 (non powers of two), Gemma-2-9B.
PAGED_MODELS = [
    ("llama3-8b", 32, 8, 128, None, None),
    ("hd64", 32, 8, 64, None, None),
    ("hd80-mha", 32, 32, 80, None, None),
    ("hd96-gqa3", 24, 8, 96, None, None),
    ("gemma2-9b", 16, 8, 256, 4096, 50.0),
]
NUM_BLOCKS, BLOCK_SIZE, TABLE_WIDTH = 4096, 16, 512


def paged_scenarios(launchers: Any, dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")) -> list[Scenario]:
    """``(label, dtype name, thunk)`` per launch; ``launchers`` is the module with ``paged_attention_triton`` and
    ``store_paged_kv_triton`` (imported however the caller imports the kernel package)."""
    import torch

    dts = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    meta = torch.device("meta")

    def E(*shape, dtype):
        return torch.empty(*shape, device=meta, dtype=dtype)

    def step(S, T, hq, hk, d, dt, window, cap):
        """One call: S sequences, T new tokens in all (T == S: decode)."""

        def thunk():
            qkv = E(T, hq + 2 * hk, d, dtype=dt)  # the fused qkv output: q is a strided view
            kc = E(NUM_BLOCKS, BLOCK_SIZE, hk, d, dtype=dt)
            vc = E(NUM_BLOCKS, BLOCK_SIZE, hk, d, dtype=dt)
            tables = E(S, TABLE_WIDTH, dtype=torch.int32)
            cu, lens = E(S + 1, dtype=torch.int32), E(S, dtype=torch.int32)
            launchers.paged_attention_triton(qkv[:, :hq], kc, vc, tables, cu, lens, d**-0.5, cap, window)

        return thunk

    out = []
    for name, hq, hk, d, window, cap in PAGED_MODELS:
        extra = (f" window{window}" if window else "") + (f" softcap{cap:g}" if cap else "")
        shape = f"{name} H{hq}/KVH{hk} D{d}{extra}"
        for dn in dtypes if name in ("llama3-8b", "gemma2-9b") else dtypes[:1]:
            dt = dts[dn]
            for S in (1, 32) if name == "llama3-8b" and dn == dtypes[0] else (32,):
                label = f"paged decode {shape} {dn} B{S} BS{BLOCK_SIZE}"
                out.append((label, dn, step(S, S, hq, hk, d, dt, window, cap)))
            label = f"paged prefill {shape} {dn} T2048+31 decodes"
            out.append((label, dn, step(32, 2079, hq, hk, d, dt, window, cap)))

    def store(dt):
        qkv = E(2079, 48, 128, dtype=dt)
        kc = E(NUM_BLOCKS, BLOCK_SIZE, 8, 128, dtype=dt)
        launchers.store_paged_kv_triton(qkv[:, 32:40], qkv[:, 40:], kc, kc.clone(), E(2079, dtype=torch.int64))

    out.append((f"paged store llama3-8b KVH8 D128 {dtypes[0]} T2079", dtypes[0], lambda: store(dts[dtypes[0]])))
    return out


def run_tool_with(argv: list[str] | None, kind: str, module: str, scenarios: Callable, description: str) -> int:
    """Run the shared ``triton_aot_check.py`` (``--tool PATH``, the other arguments its own) with ``scenarios(launchers,
    dtypes)`` of kernels/``module``.py appended to its built-in scenarios under ``kind``."""
    parser = argparse.ArgumentParser(description=description, add_help=False)
    parser.add_argument("--tool", required=True, help="path of triton_aot_check.py")
    args, rest = parser.parse_known_args(argv)
    spec = importlib.util.spec_from_file_location("triton_aot_check", args.tool)
    tool = importlib.util.module_from_spec(spec)
    sys.modules["triton_aot_check"] = tool
    spec.loader.exec_module(tool)
    builtin = tool.build_scenarios

    def with_extra(mods: dict, dtypes: list[str], full: bool) -> list:
        launchers = mods.get(module)
        if launchers is None or isinstance(launchers, Exception):
            raise RuntimeError(f"kernels/{module}.py did not import: {launchers!r}")
        extra = [(kind, label, thunk) for label, _, thunk in scenarios(launchers, tuple(dtypes))]
        return builtin(mods, dtypes, full) + extra

    # Worker processes are forked, so they inherit the patched function.
    tool.build_scenarios = with_extra
    return tool.main(rest)


def main(argv: list[str] | None = None) -> int:
    """Run the shared ``triton_aot_check.py`` with the paged scenarios appended to its own."""
    return run_tool_with(argv, "paged_attention", "paged_attention_triton", paged_scenarios,
                         __doc__.split("\n\n")[0])  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
