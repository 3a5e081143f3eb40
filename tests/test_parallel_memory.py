"""Per-rank peak host memory while loading a ~200 MB model with tp_size=2 (each rank reads only its slices).

The bound (docs/tensor_parallel.md): peak RSS growth per rank <= (weights / tp + largest single tensor) * 1.1.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_parallel import WORLD, launch  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

# ~47M parameters = ~187 MB in fp32; the largest tensor is an embedding of 8000 x 512 (16 MB).
BIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
           vocab_size=8000, tie_word_embeddings=False)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_sharded_loading_peak_memory(tmp_path, capsys):
    path = save_tiny("llama", tmp_path / "big", **BIG)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    sizes = [torch.Size(s).numel() * 4 for s in sizes]
    total, largest = sum(sizes), max(sizes)
    assert 150e6 < total < 260e6
    bound = (total / WORLD + largest) * 1.1
    warmup = save_tiny("llama", tmp_path / "warmup")
    results = launch({"memory": path, "warmup": warmup}, str(tmp_path))
    for rank, res in enumerate(results):
        m = res["memory"]
        grown = (m["peak_kib"] - m["before_kib"]) * 1024
        with capsys.disabled():
            after_load = (m["loaded_kib"] - m["before_kib"]) / 1024
            print(f"\nrank {rank}: weights {total / 2**20:.0f} MiB, local {m['local_bytes'] / 2**20:.0f} MiB, peak RSS "
                  f"growth {grown / 2**20:.0f} MiB (after loading {after_load:.0f}), bound {bound / 2**20:.0f} MiB")
        assert m["local_bytes"] < 0.6 * total
        assert grown <= bound, f"rank {rank}: peak RSS grew {grown / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"
