"""Weight-only quantization with tensor parallelism (2 gloo processes): each rank quantizes its slices as it reads them.

Column-parallel linears slice rows, which carry their scales along; row-parallel linears slice the input features, so
their groups are computed on the slice. With a group size that divides every local row length the groups are the
same as at tp=1, so tp=2 gives tp=1's quantized logits (up to the order of the all-reduce sums); with per-channel
int8 the row-parallel scales differ per rank and only the error bound against fp32 holds.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
import torch
import transformers
from test_parallel import launch
from tiny_models import left_pad, prompts, save_tiny

import hf_dsinfer  # noqa: F401  (registers inference_config)

INT8 = {"enabled": True, "weight": {"num_bits": 8}}
# Group 4 divides 96 (hidden), 48 (o_proj's slice), 136 and every slice of it AutoTP makes (64/72 with grain 64).
INT4_G4 = {"enabled": True, "weight": {"num_bits": 4, "group_size": 4, "q_type": "asymmetric"}}


def worker(job_path: str) -> None:
    """One rank: load the model quantized with tp_size=2, record logits and how the layers were split."""
    from hf_dsinfer.modules.quant_linear import QuantLinear

    with open(job_path) as f:
        job = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    ids, mask = left_pad(prompts())
    runs = {"int8": (INT8, False), "int4": (INT4_G4, False), "int4+fused": (INT4_G4, True)}
    for label, (quant, inject) in runs.items():
        try:
            tp = {"tp_size": world}
            cfg = {"dtype": "fp32", "quant": quant, "replace_with_kernel_inject": inject, "tensor_parallel": tp}
            model = transformers.AutoModelForCausalLM.from_pretrained(job["path"], inference_config=cfg)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits
            quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
            out[label] = {
                "logits": logits,
                "fused": hf_dsinfer.policies.is_injected(model),
                "n_quant": len(quantized),
                "row_parallel": sum(m.reduce is not None for m in quantized),
                "float_linears": sum(isinstance(m, torch.nn.Linear) for m in model.modules()),
            }
        except Exception:  # noqa: BLE001 - reported by the test
            out[label] = {"error": traceback.format_exc()}
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = save_tiny("llama", tmp_path_factory.mktemp("llama"))
    out_dir = str(tmp_path_factory.mktemp("quant_tp"))
    return path, launch({"path": path}, out_dir, script=__file__)


@pytest.mark.slow
@torch.no_grad()
def test_tp2_quantized_matches_tp1_and_bounds(run):
    path, results = run
    for rank_out in results:
        for label, got in rank_out.items():
            assert "error" not in got, f"{label}: {got.get('error')}"
    ids, mask = left_pad(prompts())
    real = mask.bool()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fp32 = ref(input_ids=ids, attention_mask=mask).logits
    tp1 = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={"dtype": "fp32", "quant": INT4_G4, "replace_with_kernel_inject": False}
    )
    int4_tp1 = tp1(input_ids=ids, attention_mask=mask).logits
    for rank_out in results:
        # HF path: every projection quantized (2 layers x 7), o_proj and down_proj reduce over the ranks
        assert rank_out["int8"]["n_quant"] == 14 and rank_out["int8"]["row_parallel"] == 4
        assert rank_out["int4+fused"]["fused"] and rank_out["int4+fused"]["n_quant"] == 8
        assert rank_out["int4+fused"]["row_parallel"] == 4
        err = ((rank_out["int8"]["logits"] - fp32)[real].norm() / fp32[real].norm()).item()
        assert err <= 0.03, err
        for label in ("int4", "int4+fused"):
            torch.testing.assert_close(rank_out[label]["logits"][real], int4_tp1[real], rtol=1e-4, atol=1e-5)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    worker(sys.argv[2])
    sys.exit(0)
