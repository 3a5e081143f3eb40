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

import pytest  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

# hf_dsinfer logs through transformers' library logger, which does not propagate to the root logger by default:
# let records reach pytest's caplog handler.
hf_logging.enable_propagation()


def pytest_collection_modifyitems(config, items):
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
