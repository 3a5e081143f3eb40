"""Ahead-of-time compile scenarios of the gathered LoRA kernels (``kernels/lora.py``).

``python tests/kernels/aot_lora.py --tool ../shared/tools/triton_aot_check.py . --only lora --dtypes bf16,fp16`` runs
the shared ``triton_aot_check.py`` with these scenarios added to its built-in ones (it has none for LoRA).

Shapes: Llama-3-8B's fused linears (qkv 4096 -> 6144 with q/k/v adapted, o 4096 -> 4096, gate_up 4096 -> 28672,
down 14336 -> 4096), 4 adapter slots, per-part ranks 16 and 64 (a fused qkv stacks three parts: R = 48 / 192),
a decode batch of 32 tokens and a 2048-token prefill.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

Scenario = tuple[str, str, Callable[[], None]]

# (name, in, out, parts): the fused linears of Llama-3-8B and how many adapted projections each stacks.
LINEARS = [("qkv", 4096, 6144, 3), ("o", 4096, 4096, 1), ("gate_up", 4096, 28672, 2), ("down", 14336, 4096, 1)]
LORAS = 4


def lora_scenarios(launchers: Any, dtypes: tuple[str, ...] = ("bf16", "fp16", "fp32")) -> list[Scenario]:
    """``(label, dtype name, thunk)`` per launch; ``launchers`` is the module with ``lora_add_triton``."""
    import torch

    dts = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    meta = torch.device("meta")

    def E(*shape, dtype):
        return torch.empty(*shape, device=meta, dtype=dtype)

    def thunk(n, k, o, rank, dt):
        def run():
            y, x = E(n, o, dtype=dt), E(n, k, dtype=dt)
            a, b = E(LORAS, rank, k, dtype=dt), E(LORAS, o, rank, dtype=dt)
            launchers.lora_add_triton(y, x, a, b, E(n, dtype=torch.int32))

        return run

    out = []
    for dn in dtypes:
        dt = dts[dn]
        for name, k, o, parts in LINEARS:
            for r in (16, 64):
                for label, n in (("decode B32", 32), ("prefill T2048", 2048)):
                    if label.startswith("prefill") and (r != 16 or dn != dtypes[0]):
                        continue
                    out.append((f"lora {name} K{k} O{o} R{parts * r} {dn} {label}", dn, thunk(n, k, o, parts * r, dt)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the shared ``triton_aot_check.py`` with the LoRA scenarios appended to its own."""
    from aot_paged import run_tool_with  # this folder is on sys.path (script dir, or added by the test)

    return run_tool_with(argv, "lora", "lora", lora_scenarios, __doc__.split("\n\n")[0])

if __name__ == "__main__":
    sys.exit(main())
