"""Every Triton kernel compiled ahead of time for sm_90 (H100) and sm_80 (A100), on a machine without a GPU.

The launches come from the real launchers on meta tensors (see ``aot_compile.py``), so tile tables, specialization
and options are what those GPUs would get. Checked: everything compiles; no register spills (ptxas stack frame or
local memory); shared memory within each target's per-block limit, and within sm_86/sm_89's 99 KB for the tables
every non-Hopper GPU uses; wgmma on Hopper for half-precision prefill; one decode binary for every split count.
Figures per kernel are in docs/kernels.md. Compiling needs the ptxas and cuobjdump that ship in the triton wheel.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One xdist worker runs the whole module: its module-scoped compile (two processes, about a minute) would otherwise
# run once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_aot_compile")]

HERE = Path(__file__).resolve().parent
ARCHS = (90, 80)


def _tools_missing() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    sys.path.insert(0, str(HERE))
    try:
        from aot_compile import nvidia_tool
    finally:
        sys.path.remove(str(HERE))
    for tool in ("ptxas", "cuobjdump"):
        if nvidia_tool(tool) is None:
            return f"{tool} not found (neither in the triton wheel nor on PATH)"
    return None


@pytest.fixture(scope="module")
def aot(tmp_path_factory) -> dict:
    """Compile every captured launch, one process per arch (run side by side): {arch: report}."""
    missing = _tools_missing()
    if missing:
        pytest.skip(f"cannot compile for NVIDIA targets here: {missing}")
    out = tmp_path_factory.mktemp("aot")
    # Triton reads TRITON_INTERPRET when kernels are decorated: the child must start without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {
        cc: subprocess.Popen([sys.executable, str(HERE / "aot_compile.py"), "--arch", str(cc), "--json",
                              str(out / f"sm{cc}.json")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)  # fmt: skip
        for cc in ARCHS
    }
    reports = {}
    for cc, proc in procs.items():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"aot_compile.py --arch {cc} failed:\n{log[-4000:]}"
        reports[cc] = json.loads((out / f"sm{cc}.json").read_text())
    return reports


def _rows(aot):
    return [r for rep in aot.values() for r in rep["rows"]]


def _where(r) -> str:
    return f"{r['kernel']} [{r['label']}] sm_{r['arch']} {r.get('constexprs')}"


def test_every_launch_compiles(aot):
    for cc, rep in aot.items():
        assert rep["capture_errors"] == [], rep["capture_errors"]
        assert rep["rows"], f"no launch captured for sm_{cc}"
    failed = [f"{_where(r)}: {r['error']}" for r in _rows(aot) if not r["ok"]]
    assert not failed, "\n".join(failed)


def test_every_kernel_is_launched(aot):
    for rep in aot.values():
        jit = rep["jit"]
        assert jit["uncovered"] == [], f"jit functions no scenario launches (add one to aot_compile.py): {jit}"
        assert len(jit["launched"]) >= 10


def test_no_register_spills(aot):
    rows = [r for r in _rows(aot) if r["ok"]]
    assert all("regs" in r for r in rows), "cuobjdump gave no resource usage"
    spills = [f"{_where(r)}: {r['regs']} regs, stack {r['stack']} B, local {r['local']} B, spill stores "
              f"{r.get('spill_st', '?')} B" for r in rows if r["stack"] or r["local"]]  # fmt: skip
    assert not spills, "register spills:\n" + "\n".join(spills)


def test_shared_memory_fits_the_targets(aot):
    sys.path.insert(0, str(HERE))
    try:
        from aot_compile import ARCHS as INFO
        from aot_compile import CONSUMER_SMEM_BLOCK
    finally:
        sys.path.remove(str(HERE))
    for r in (r for r in _rows(aot) if r["ok"]):
        assert r["shared"] <= INFO[r["arch"]]["smem_block"], _where(r)
        if r["arch"] != 90:  # sm_80's tables are every non-Hopper GPU's, consumer parts (99 KB per block) included
            assert r["shared"] <= CONSUMER_SMEM_BLOCK, f"{_where(r)}: {r['shared']} B > sm_86/sm_89's limit"


def test_hopper_half_prefill_uses_wgmma(aot):
    rows = [r for r in aot[90]["rows"] if r["kernel"].endswith("_prefill_kernel") and r["dtype"] != "fp32"
            and "D512" not in r["label"]]  # fmt: skip
    assert rows
    assert all(r["wgmma"] > 0 for r in rows), [_where(r) for r in rows if not r["wgmma"]]
    assert all(r["mma_sync"] > 0 for r in aot[80]["rows"] if r["kernel"].endswith("_prefill_kernel")
               and r["dtype"] != "fp32")  # fmt: skip


def test_decode_split_count_is_not_compiled_in(aot):
    # Batch 1 and batch 32 split the cache differently but run the same binary (the count is a runtime value).
    for rep in aot.values():
        split = {r["label"]: r["hash"] for r in rep["rows"] if r["kernel"].endswith("_decode_split_kernel")}
        b1 = split["decode llama3-8b D128 bf16 B1 S8192"]
        assert split["decode llama3-8b D128 bf16 B32 S8192"] == b1
