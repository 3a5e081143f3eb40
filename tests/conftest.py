"""Test setup shared by the whole suite.

Without CUDA, Triton kernels can only run under Triton's interpreter, and ``TRITON_INTERPRET`` is read when a
kernel is decorated, so it must be set before anything imports ``hf_dsinfer``. With CUDA the kernels run natively.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiling the CPU decode step costs seconds per model and bucket; tests that exercise it opt in with
# monkeypatch.setenv("HF_DSINFER_CPU_COMPILE", "1") (tests/test_compiled_decode.py).
os.environ.setdefault("HF_DSINFER_CPU_COMPILE", "0")
# Under pytest-xdist every worker is a process with torch's default of one intra-op thread per core: N workers on N
# cores would run N^2 threads and spin against each other. Each worker (and what it launches) gets its share.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _share = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# hf_dsinfer logs through transformers' library logger, which does not propagate to the root logger by default:
# let records reach pytest's caplog handler.
hf_logging.enable_propagation()


# Modules whose fixtures launch gloo processes or load large checkpoints: collected first, so pytest-xdist hands them
# out at the start instead of leaving one worker finishing them alone at the end.
HEAVY_FIRST = (
    "test_parallel.py", "test_moe_parallel.py", "test_parallel_coverage.py", "test_hybrid_tp.py", "test_quant_tp.py",
    "test_quant_memory.py", "test_injection_memory.py", "test_parallel_memory.py", "test_aot_compile.py",
    "test_parallel_bin.py", "test_parallel_encdec.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in HEAVY_FIRST)  # stable: the order within each part stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else CPU (Triton then runs under the interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny matmuls run faster and are immune to a busy machine's thread-pool
    contention. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
