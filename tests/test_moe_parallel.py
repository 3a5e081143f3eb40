"""MoE models over 2 gloo processes: experts split by features (tensor parallelism) or whole experts per rank
(expert parallelism, ``moe={"ep_size": 2}``), against the tp=1 model.

The two ranks start once (``python tests/test_moe_parallel.py worker JOB`` with torchrun's environment); each runs
every case and writes its results; the test compares them with HF's own model on one process: logits within the fp32
tolerance, 20 greedy tokens identical, and each rank holding half of the expert weights.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_moe import _to_fused_layout  # noqa: E402
from test_parallel import launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, prompts, save_tiny  # noqa: E402
from tolerances import MODEL_LOGITS_TOL  # noqa: E402

WORLD = 2
NEW_TOKENS = 20
TIMEOUT_S = 400
# case -> (checkpoint, ep_size, replace_with_kernel_inject, how it loads): "built" = init_inference on a loaded
# model (split in memory); "sliced" = from_pretrained with the config, each rank reading only its slices/experts
CASES = {
    "mixtral_tp": ("mixtral", 1, True, "built"),
    "mixtral_ep": ("mixtral", 2, True, "built"),
    "mixtral_tp_hf_modules": ("mixtral", 1, False, "built"),  # HF's MoE block on split experts (all-reduce hook)
    "qwen2_moe_tp": ("qwen2_moe", 1, True, "built"),
    "qwen2_moe_ep": ("qwen2_moe", 2, True, "built"),
    "qwen3_moe_ep": ("qwen3_moe", 2, True, "built"),
    "mixtral_tp_sliced": ("mixtral", 1, True, "sliced"),  # per-expert checkpoint (w1/w3/w2)
    "qwen2_moe_ep_sliced": ("qwen2_moe", 2, True, "sliced"),  # per-expert checkpoint (gate/up/down_proj)
    "qwen3_moe_tp_sliced_fused": ("qwen3_moe_fused", 1, True, "sliced"),  # fused-experts checkpoint
}


def _greedy(model, ids):
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=PAD,
    )  # fmt: skip
    return out[:, ids.shape[1] :]


def _expert_numel(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def worker(job_path: str) -> None:
    import transformers

    import hf_dsinfer
    from hf_dsinfer.policies import is_injected

    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    ids = torch.tensor([prompts()[1]])
    results: dict = {}
    for case, (row, ep_size, inject, how) in CASES.items():
        try:
            settings = dict(
                tensor_parallel={"tp_size": WORLD}, moe={"ep_size": ep_size}, replace_with_kernel_inject=inject
            )
            path = job["paths"][row]
            full = _expert_numel(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
            if how == "sliced":
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, inference_config={"dtype": "fp32", **settings}
                )
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                hf_dsinfer.init_inference(model, dtype=torch.float32, **settings)
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            results[case] = {
                "logits": logits,
                "greedy": _greedy(model, ids),
                "expert_fraction": _expert_numel(model) / full,
                "injected": is_injected(model),
            }
        except Exception:
            results[case] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp")
    paths = {row: save_tiny(row, root / row) for row in ("mixtral", "qwen2_moe", "qwen3_moe")}
    paths["qwen3_moe_fused"] = save_tiny("qwen3_moe", root / "qwen3_moe_fused")
    _to_fused_layout(paths["qwen3_moe_fused"], "qwen3_moe")
    return paths, launch({"paths": paths}, str(root), timeout=TIMEOUT_S, script=__file__)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_moe_tensor_and_expert_parallel_match_tp1(case, ranks):
    import transformers

    paths, results = ranks
    row, ep_size, inject, _ = CASES[case]
    reference = transformers.AutoModelForCausalLM.from_pretrained(paths[row], dtype=torch.float32).eval()
    ids = torch.tensor([prompts()[1]])
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits
    ref_greedy = _greedy(reference, ids)
    for rank, res in enumerate(results):
        got = res[case]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["injected"] == inject
        torch.testing.assert_close(got["logits"], ref_logits, **MODEL_LOGITS_TOL[torch.float32])
        assert torch.equal(got["greedy"], ref_greedy), f"rank {rank}: greedy tokens differ from tp=1"
        # per-rank expert memory: half of every expert (tensor parallel) or half of the experts (expert parallel)
        assert got["expert_fraction"] == pytest.approx(0.5, abs=0.02), got["expert_fraction"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    worker(sys.argv[2])
