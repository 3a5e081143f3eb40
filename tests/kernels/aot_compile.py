"""Ahead-of-time compilation of the Triton kernels for NVIDIA GPUs, on a machine without one.

``python tests/kernels/aot_compile.py --arch 90 [--arch 80] [--json out.json]`` (run in its own process: Triton
decides at decoration time whether ``@triton.jit`` builds interpreter kernels, so ``TRITON_INTERPRET`` must be unset
before the kernels are imported; ``test_aot_compile.py`` starts it that way).

1. Capture: every ``@triton.jit`` global of the kernel modules is swapped for a recorder, and the real launchers
   (``*_triton``) run on meta tensors with realistic shapes inside ``assume_target(cc, sms)``, so each records the
   exact arguments, constexprs, ``num_warps`` and ``num_stages`` it would launch with on that GPU. Nothing runs.
2. Compile: each launch goes through Triton's own JIT path (``JITFunction.run(..., warmup=True)``) with a stub
   driver reporting ``GPUTarget("cuda", cc, 32)``, so argument specialization is what a real launch gets; the
   wheel's ptxas builds the cubin.
3. Measure: registers, stack frame and local memory per thread from ``cuobjdump --dump-resource-usage`` on that
   cubin (a stack frame or local memory in a Triton kernel means register spills), dynamic shared memory from the
   kernel metadata.

Prints (or writes) one JSON object: ``{"triton": version, "rows": [...]}`` with a row per launch and arch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")

# Per-arch facts: SM count (split-KV decode sizes its grid from it) and the opt-in shared memory per block.
ARCHS = {
    90: {"sms": 132, "smem_block": 232448},  # H100 SXM
    80: {"sms": 108, "smem_block": 166912},  # A100
    86: {"sms": 84, "smem_block": 101376},  # A10 / RTX 3090
    89: {"sms": 58, "smem_block": 101376},  # L4 / RTX 4090
}
CONSUMER_SMEM_BLOCK = 101376  # sm_86 / sm_89: what the portable tile tables must fit
MODULES = ("norms", "activations", "rotary", "kv_cache", "prefill_attention", "decode_attention",
           "encoder_attention", "moe_gemm", "quant_gemm", "paged_attention_triton", "lora")  # fmt: skip
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
PACKAGE = "aot_kernels"  # the checkout's kernels/ imported under a private name (see kernel_package)


@dataclass
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call made by a launcher during capture."""

    label: str  # the scenario, e.g. "prefill llama3-8b D128 bf16 B1 T2048"
    dtype: str  # the activation dtype of the scenario (bf16, fp16, fp32)
    kernel: str  # module.function
    fn: Any  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)


class _Recorder:
    """Stands in for a JITFunction while capturing: ``k[grid](...)`` records the call instead of launching it."""

    def __init__(self, name: str, fn: Any, sink: list[Launch], state: dict):
        self._name, self._fn, self._sink, self._state = name, fn, sink, state

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self._sink.append(Launch(self._state["label"], self._state["dtype"], self._name, self._fn, tuple(grid),
                                     args, dict(kwargs)))  # fmt: skip

        return launch


def kernel_package() -> str:
    """Import the checkout's ``kernels/`` on its own (as ``PACKAGE``) and return its name.

    Importing it as ``hf_dsinfer.kernels`` would run ``hf_dsinfer/__init__`` and pull in transformers, which costs
    seconds and is not needed: the kernel package imports only torch and triton.
    """
    if PACKAGE not in sys.modules:
        init = KERNELS_DIR / "__init__.py"
        spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[str(KERNELS_DIR)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = pkg
        spec.loader.exec_module(pkg)
    return PACKAGE


def kernel_modules() -> dict[str, Any]:
    """The kernel submodules present in this checkout (a module added later is picked up once listed above)."""
    kernel_package()
    mods = {}
    for name in MODULES:
        if (KERNELS_DIR / f"{name}.py").exists():
            mods[name] = importlib.import_module(f"{PACKAGE}.{name}")
    return mods


@contextlib.contextmanager
def _recording(mods: dict[str, Any], sink: list[Launch], state: dict):
    from triton.runtime.jit import JITFunction

    saved = []
    try:
        for mod in mods.values():
            for gname, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    setattr(mod, gname, _Recorder(f"{mod.__name__.rsplit('.', 1)[-1]}.{gname}", obj, sink, state))
                    saved.append((mod, gname, obj))
        yield
    finally:
        for mod, gname, obj in saved:
            setattr(mod, gname, obj)


# ----------------------------------------------------------------------------------------------------------------------
# Scenarios: a small representative set of launcher calls (decode and prefill token counts, head dims 64-256,
# window + softcap, every dtype for the attention kernels whose registers depend on it).
# ----------------------------------------------------------------------------------------------------------------------

CACHE_BMAX, CACHE_S = 32, 8192


def scenarios(mods: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """``(label, dtype name, thunk)``: each thunk calls one launcher on meta tensors."""
    import torch

    dts = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    meta = torch.device("meta")

    def E(*shape, dtype):
        return torch.empty(*shape, device=meta, dtype=dtype)

    out: list[tuple[str, str, Any]] = []
    bf16 = torch.bfloat16
    if "norms" in mods:
        n = mods["norms"]
        out.append(("rms_norm C4096 +residual decode B32", "bf16",
                    lambda: n.rms_norm_triton(E(32, 1, 4096, dtype=bf16), E(4096, dtype=bf16), 1e-5,
                                              E(32, 1, 4096, dtype=bf16))))  # fmt: skip
        out.append(("rms_norm C65536 +residual (wide row) B32", "bf16",
                    lambda: n.rms_norm_triton(E(32, 65536, dtype=bf16), E(65536, dtype=bf16), 1e-5,
                                              E(32, 65536, dtype=bf16))))  # fmt: skip
        out.append(("layer_norm C32768 +bias (wide row) B32", "bf16",
                    lambda: n.layer_norm_triton(E(32, 32768, dtype=bf16), E(32768, dtype=bf16),
                                                E(32768, dtype=bf16), 1e-5)))  # fmt: skip
        out.append(("layer_norm C768 +bias +residual B32 T512", "bf16",
                    lambda: n.layer_norm_triton(E(32, 512, 768, dtype=bf16), E(768, dtype=bf16), E(768, dtype=bf16),
                                                1e-12, E(32, 512, 768, dtype=bf16))))  # fmt: skip
    if "activations" in mods:
        a = mods["activations"]
        for act in ("silu", "gelu"):
            out.append((f"act_and_mul {act} I14336 T2048", "bf16",
                        lambda act=act: a.act_and_mul_triton(E(2048, 2 * 14336, dtype=bf16), act)))  # fmt: skip
    if "rotary" in mods:
        r = mods["rotary"]

        def rotary(B=32, T=1):
            qkv = E(B * T, 48, 128, dtype=bf16)  # llama3-8b fused qkv: 32 q heads, 8 k, 8 v
            cos, sin = E(8192, 64, dtype=torch.float32), E(8192, 64, dtype=torch.float32)
            r.apply_rotary_triton(qkv[:, :32], qkv[:, 32:40], cos, sin, E(B * T, dtype=torch.int64))

        out.append(("rotary llama3-8b D128 decode B32", "bf16", rotary))
    if "kv_cache" in mods:
        kv = mods["kv_cache"]

        def store(B=1, T=2048):
            qkv = E(B, T, 48, 128, dtype=bf16)
            kc, vc = E(CACHE_BMAX, 8, CACHE_S, 128, dtype=bf16), E(CACHE_BMAX, 8, CACHE_S, 128, dtype=bf16)
            kv.store_kv_triton(qkv[:, :, 32:40], qkv[:, :, 40:], kc, vc, E(B, dtype=torch.int32),
                               E(B, dtype=torch.int32))  # fmt: skip

        out.append(("store_kv llama3-8b prefill B1 T2048", "bf16", store))
    # (name, Hq, Hk, D, window, softcap, dtypes)
    attn = [("llama3-8b", 32, 8, 128, None, None, ("bf16", "fp16", "fp32")),
            ("hd64", 32, 8, 64, None, None, ("bf16", "fp32")),
            ("hd80-mha", 32, 32, 80, None, None, ("bf16",)),
            ("gemma2-9b", 16, 8, 256, 4096, 50.0, ("bf16", "fp32"))]  # fmt: skip
    if "prefill_attention" in mods:
        p = mods["prefill_attention"]
        for name, hq, hk, d, window, cap, dtypes in attn:
            for dn in dtypes:
                def prefill(hq=hq, hk=hk, d=d, window=window, cap=cap, dt=dts[dn], B=1, T=2048):
                    qkv = E(B, T, hq + 2 * hk, d, dtype=dt)
                    kc, vc = E(CACHE_BMAX, hk, CACHE_S, d, dtype=dt), E(CACHE_BMAX, hk, CACHE_S, d, dtype=dt)
                    p.prefill_attention_triton(qkv[:, :, :hq], kc, vc, E(B, dtype=torch.int32),
                                               E(B, dtype=torch.int32), d**-0.5, window, cap)  # fmt: skip

                out.append((f"prefill {name} D{d} {dn} B1 T2048", dn, prefill))
    if "decode_attention" in mods:
        dec = mods["decode_attention"]
        for name, hq, hk, d, window, cap, dtypes in attn:
            if name == "hd80-mha":
                continue
            for dn in dtypes if name != "hd64" else ("bf16",):
                for B in (1, 32) if name == "llama3-8b" and dn == "bf16" else (32,):
                    def decode(hq=hq, hk=hk, d=d, window=window, cap=cap, dt=dts[dn], B=B):
                        q = E(B, 1, hq + 2 * hk, d, dtype=dt)[:, 0, :hq]
                        kc, vc = E(CACHE_BMAX, hk, CACHE_S, d, dtype=dt), E(CACHE_BMAX, hk, CACHE_S, d, dtype=dt)
                        dec.decode_attention_triton(q, kc, vc, E(B, dtype=torch.int32), d**-0.5, window, cap)

                    out.append((f"decode {name} D{d} {dn} B{B} S{CACHE_S}", dn, decode))
    if "encoder_attention" in mods:
        enc = mods["encoder_attention"]
        # (name, Hq, Hk, D, B, T, dtypes)
        for name, hq, hk, d, B, T, dtypes in (("bert-base", 12, 12, 64, 32, 512, ("bf16", "fp32")),
                                              ("llama-shape", 32, 8, 128, 1, 2048, ("bf16", "fp32"))):  # fmt: skip
            for dn in dtypes:
                def encoder(hq=hq, hk=hk, d=d, B=B, T=T, dt=dts[dn]):
                    qkv = E(B, T, hq + 2 * hk, d, dtype=dt)
                    enc.encoder_attention_triton(qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:],
                                                 E(B, dtype=torch.int64), d**-0.5)  # fmt: skip

                out.append((f"encoder {name} D{d} {dn} B{B} T{T}", dn, encoder))
    if "moe_gemm" in mods:
        moe = mods["moe_gemm"]
        for label, rows in (("decode B32 top2", 64), ("prefill T2048 top2", 4096)):
            def gemm(rows=rows):  # mixtral-8x7b gate_up: 8 experts, [2 * 14336, 4096]
                moe.moe_gemm_triton(E(rows // 2, 4096, dtype=bf16), E(8, 2 * 14336, 4096, dtype=bf16),
                                    E(8, dtype=torch.int32), E(rows, dtype=torch.int64))  # fmt: skip

            out.append((f"moe_gemm mixtral gate_up {label}", "bf16", gemm))
    if "quant_gemm" in mods:
        qg = mods["quant_gemm"]
        qf = importlib.import_module(f"{PACKAGE}.quant_format")
        # llama3-8b projections: (name, N, K); int8 per-channel, int4 group 128 (symmetric and asymmetric), and a
        # group size no power-of-two K tile divides (per-element scales).
        specs = (("int8", qf.QuantSpec(8, 4096, True)), ("int4 g128", qf.QuantSpec(4, 128, True)),
                 ("int4 g128 asym", qf.QuantSpec(4, 128, False)), ("int8 g40", qf.QuantSpec(8, 40, True)))  # fmt: skip
        for pname, n_out, k in (("gate_up", 2 * 14336, 4096), ("down", 4096, 14336), ("o", 4096, 4096)):
            for sname, spec in specs:
                for tname, m in (("decode B1", 1), ("decode B16", 16), ("prefill T2048", 2048)):
                    dnames = ("bf16", "fp16") if pname == "gate_up" and sname == "int4 g128" else ("bf16",)
                    if pname != "gate_up" and (sname != "int4 g128" or m == 2048):
                        continue  # the other projections: int4 decode only (split-K counts differ with N and K)
                    for dn in dnames:
                        def quant(n=n_out, k=k, spec=spec, m=m, dt=dts[dn]):
                            sp = spec.for_features(k)
                            wdt = torch.int8 if sp.num_bits == 8 else torch.uint8
                            g = sp.n_groups(k)
                            qg.quant_matmul_triton(E(m, k, dtype=dt), E(n, sp.packed_cols(k), dtype=wdt),
                                                   E(n, g, dtype=dt), None if sp.symmetric else E(n, g, dtype=dt),
                                                   sp, k, E(n, dtype=dt))  # fmt: skip

                        out.append((f"quant_gemm {sname} {pname} [{n_out},{k}] {dn} {tname}", dn, quant))
        out.append(("quant_gemm int8 gate_up fp32 decode B1", "fp32",
                    lambda: qg.quant_matmul_triton(E(1, 4096, dtype=torch.float32), E(8192, 4096, dtype=torch.int8),
                                                   E(8192, 1, dtype=torch.float32), None, qf.QuantSpec(8, 4096),
                                                   4096)))  # fmt: skip
        out.append(("quant_gemm int4 g128 fp32 prefill T512", "fp32",
                    lambda: qg.quant_matmul_triton(E(512, 4096, dtype=torch.float32),
                                                   E(8192, 2048, dtype=torch.uint8), E(8192, 32, dtype=torch.float32),
                                                   None, qf.QuantSpec(4, 128), 4096)))  # fmt: skip
    if "paged_attention_triton" in mods:
        from aot_paged import paged_scenarios  # this folder is on sys.path (script dir, or added by the test)

        out += paged_scenarios(mods["paged_attention_triton"])
    if "lora" in mods:
        from aot_lora import lora_scenarios

        out += lora_scenarios(mods["lora"], ("bf16", "fp32"))  # fp16 compiles as bf16 (the shared tool checks both)
    return out


def capture(mods: dict[str, Any], cc: int, only: str | None = None) -> tuple[list[Launch], list[str]]:
    """Run the scenarios' launchers as if on GPU ``cc``; returns (launches, errors)."""
    arch_mod = importlib.import_module(f"{PACKAGE}._arch")
    sink: list[Launch] = []
    errors: list[str] = []
    state: dict = {}
    pattern = re.compile(only) if only else None
    with arch_mod.assume_target(cc, ARCHS[cc]["sms"]), _recording(mods, sink, state):
        for label, dtype, thunk in scenarios(mods):
            if pattern and not pattern.search(label):
                continue
            state["label"], state["dtype"] = label, dtype
            before = len(sink)
            try:
                thunk()
            except Exception as e:  # noqa: BLE001 - reported per scenario
                errors.append(f"{label}: the launcher raised {type(e).__name__}: {e}")
                continue
            if len(sink) == before:
                errors.append(f"{label}: the launcher made no launch")
    return sink, errors


# ----------------------------------------------------------------------------------------------------------------------
# Compiling with a stub driver
# ----------------------------------------------------------------------------------------------------------------------


class _StubUtils:
    def __init__(self, cc: int):
        self.cc = cc

    def unload_module(self, *args, **kwargs):
        pass

    def get_device_properties(self, device):
        info = ARCHS[self.cc]
        return {"max_shared_mem": info["smem_block"], "multiprocessor_count": info["sms"], "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}  # fmt: skip


class StubDriver:
    """Enough of a Triton driver for ``JITFunction.run(warmup=True)``: reports a CUDA target, never launches.

    The device index is the capability, so each arch gets its own per-device compile cache in every JITFunction.
    """

    def __init__(self, cc: int):
        from triton.backends.compiler import GPUTarget

        self.cc = cc
        self.target = GPUTarget("cuda", cc, 32)
        self.utils = _StubUtils(cc)

    def is_active(self):
        return True

    def get_current_device(self):
        return self.cc

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda


def nvidia_tool(name: str) -> str | None:
    """Path of a CUDA binary shipped in the triton wheel (``ptxas``, ``cuobjdump``), else from PATH."""
    import triton

    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if p.exists():
        return str(p)
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    return env if env and Path(env).exists() else shutil.which(name)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``regs``, ``stack`` and ``local`` bytes per thread of the cubin's kernel (cuobjdump)."""
    tool = nvidia_tool("cuobjdump")
    if tool is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "k.cubin"
        f.write_bytes(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", str(f)], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return {}
    regs, stack, _, local = map(int, m.groups())
    return {"regs": regs, "stack": stack, "local": local}


_PTXAS = {k: re.compile(rx) for k, rx in
          {"spill_st": r"(\d+) bytes spill stores", "spill_ld": r"(\d+) bytes spill loads"}.items()}  # fmt: skip


def compile_launch(launch: Launch, cc: int) -> dict:
    """Compile one captured launch for ``cc``; the report row (``ok``, ``error`` or the resource figures)."""
    from triton.runtime.driver import driver

    row = {"arch": cc, "label": launch.label, "dtype": launch.dtype, "kernel": launch.kernel,
           "grid": list(launch.grid), "constexprs": {k: repr(v) for k, v in launch.kwargs.items()}}  # fmt: skip
    driver.set_active(StubDriver(cc))
    log = io.StringIO()
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(log):
            kernel = launch.fn.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
        if hasattr(kernel, "result"):  # async compile modes hand back a future
            kernel = kernel.result()
    except Exception as e:  # noqa: BLE001 - reported as a failed row
        row.update(ok=False, error="".join(traceback.format_exception_only(type(e), e)).strip()[-2000:])
        return row
    md = kernel.metadata
    row.update(ok=True, seconds=round(time.time() - t0, 2), hash=kernel.hash[:16], num_warps=md.num_warps,
               num_stages=md.num_stages, shared=md.shared)  # fmt: skip
    row.update(resource_usage(kernel.asm["cubin"]))
    for key, rx in _PTXAS.items():  # present when TRITON_DUMP_PTXAS_LOG=1 made Triton print ptxas -v
        found = rx.findall(log.getvalue())
        if found:
            row[key] = max(map(int, found))
    ptx = kernel.asm.get("ptx", "")
    row["wgmma"] = len(re.findall(r"\bwgmma\.mma_async", ptx))
    row["mma_sync"] = len(re.findall(r"\bmma\.sync\.aligned", ptx))
    return row


def jit_coverage(mods: dict[str, Any], launched: set[str]) -> dict[str, list[str]]:
    """Every ``@triton.jit`` function of the kernel modules: launched ones, helpers (called from another jit
    function's source, so compiled inside it) and uncovered ones (neither: a kernel no scenario launches)."""
    from triton.runtime.jit import JITFunction

    jits = {}
    for mname, mod in mods.items():
        for gname, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__:
                jits[f"{mname}.{gname}"] = obj
    sources = {name: fn.src for name, fn in jits.items()}
    helpers = sorted(name for name in jits if name not in launched and any(
        re.search(rf"\b{re.escape(name.split('.')[-1])}\(", src) for other, src in sources.items() if other != name))
    uncovered = sorted(name for name in jits if name not in launched and name not in helpers)
    return {"launched": sorted(n for n in jits if n in launched), "helpers": helpers, "uncovered": uncovered}


def run(archs: list[int], only: str | None = None) -> dict:
    """Capture and compile for every arch of ``archs``; the JSON-ready report."""
    import triton

    mods = kernel_modules()
    rows, errors = [], []
    seen: dict[tuple, dict] = {}
    for cc in archs:
        launches, errs = capture(mods, cc, only)
        errors += [f"sm_{cc}: {e}" for e in errs]
        for launch in launches:
            row = compile_launch(launch, cc)
            key = (cc, row.get("hash"))
            if row.get("ok") and key in seen:  # same binary as an earlier launch: Triton's in-memory cache hit
                row.update({k: v for k, v in seen[key].items() if k in ("regs", "stack", "local", "spill_st",
                                                                        "spill_ld")})  # fmt: skip
            elif row.get("ok"):
                seen[key] = row
            rows.append(row)
    coverage = jit_coverage(mods, {r["kernel"] for r in rows})
    return {"triton": triton.__version__, "archs": archs, "capture_errors": errors, "jit": coverage, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(ARCHS), help="compute capability")
    parser.add_argument("--only", default=None, help="regex on scenario labels")
    parser.add_argument("--json", default=None, help="write the report here (default: stdout)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    report = run(args.arch or [90, 80], args.only)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    # A fresh cache, so every binary is really compiled (and nothing leaks into the user's ~/.triton).
    with tempfile.TemporaryDirectory(prefix="hf-dsinfer-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ.setdefault("TRITON_DUMP_PTXAS_LOG", "1")
        sys.exit(main())
