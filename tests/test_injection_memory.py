"""Injection keeps one copy of the weights: peak RSS of a ~1B-parameter llama, injected vs plain, in subprocesses."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

# TinyLlama-1.1B's shape: 1.1e9 parameters, 2.2 GB in bf16.
CONFIG = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048,
)  # fmt: skip

_MEASURE = """
import resource, sys, torch, transformers
import hf_dsinfer  # imported in both runs so both pay for the same modules
path, mode = sys.argv[1], sys.argv[2]
if mode == "inject":
    cfg = {"dtype": "bf16", "replace_with_kernel_inject": True, "max_out_tokens": 16, "max_batch_size": 1}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=cfg)
    assert hf_dsinfer.policies.is_injected(model)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
with torch.no_grad():
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
"""


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama1b")
    config = transformers.LlamaConfig(**CONFIG)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")  # skip the slow random init: values do not matter for memory
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.zero_()
    assert sum(p.numel() for p in model.parameters()) > 1.0e9
    model.save_pretrained(path)
    del model
    return str(path)


def _peak_kib(path: str, mode: str, tmp_path) -> int:
    script = tmp_path / "measure.py"
    script.write_text(_MEASURE)
    out = subprocess.run(
        [sys.executable, str(script), path, mode], check=True, capture_output=True, text=True, timeout=300
    )
    return int(out.stdout.strip().splitlines()[-1])


def test_injected_peak_memory_within_10_percent_of_plain(big_llama, tmp_path):
    plain = _peak_kib(big_llama, "plain", tmp_path)
    injected = _peak_kib(big_llama, "inject", tmp_path)
    print(f"peak RSS: plain {plain / 2**20:.2f} GiB, injected {injected / 2**20:.2f} GiB ({injected / plain:.3f}x)")
    assert injected <= 1.1 * plain, f"injected peak {injected} KiB > 1.1 x plain {plain} KiB"
