"""MoE models over gloo processes: experts split by features (tensor parallelism), whole experts per rank (expert
parallelism, ``moe={"ep_size": 2}``), and both combined (4 ranks, ``ep_size`` 2: two expert groups of two ranks),
against the tp=1 model.

The ranks start once per world size (``python tests/test_moe_parallel.py worker JOB`` with torchrun's environment:
one 2-rank launch, one 4-rank launch); each runs every case of its world and writes its results; the tests compare
them with HF's own model on one process: logits within the fp32 tolerance, 20 greedy tokens identical, and each rank
holding ``1/world`` of the expert weights. Single-process tests check the splits themselves: every rank's partial
block output sums to HF's block, the two-dim shard reads the same bytes it cuts, the Hybrid Engine's refresh slices
the same pieces, and ``ep_size`` values that cannot split the ranks or the experts are refused by name.
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

from hf_dsinfer.parallel.shard import even_shard, halves_shard  # noqa: E402

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
# 4 ranks, ep_size 2: experts [0, E/2) on ranks 0-1 and [E/2, E) on ranks 2-3, each rank half of their features
WORLD4 = 4
CASES4 = {
    "mixtral_ep2_tp4": ("mixtral", 2, True, "built"),
    "qwen2_moe_ep2_tp4_sliced": ("qwen2_moe", 2, True, "sliced"),  # per-expert checkpoint, shared expert over 4
    "qwen3_moe_ep2_tp4_sliced_fused": ("qwen3_moe_fused", 2, True, "sliced"),  # fused-experts checkpoint
}
HYBRID = "mixtral_hybrid_ep2_tp4"  # the Hybrid Engine's inference copy on the same 4 ranks


def _greedy(model, ids):
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, pad_token_id=PAD,
    )  # fmt: skip
    return out[:, ids.shape[1] :]


def _expert_numel(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)


def _hybrid_case(ids: torch.Tensor) -> dict:
    """The Hybrid Engine's inference copy split over 4 ranks with ep_size 2: greedy equal to the training model's own
    HF forward, before and after the training weights change (each refresh copies the group's experts and this rank's
    features of them)."""
    from tiny_models import build_tiny

    import hf_dsinfer

    model = build_tiny("mixtral", seed=0)  # the same weights on every rank (DDP-replicated training, say)
    cfg = {"tensor_parallel": {"tp_size": WORLD4}, "moe": {"ep_size": 2}, "max_out_tokens": 64, "dtype": "fp32"}
    he = hf_dsinfer.HybridEngine(model, inference_config=cfg)
    out: dict = {}
    for step in ("before", "after"):
        if step == "after":  # a training step: every expert weight moves (the same update on every rank)
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".experts." in name:
                        p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        model.eval()
        ref = _greedy(model, ids)  # HF's own modules on the full training weights
        with he.inference():
            got = he.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD,
            )[:, ids.shape[1] :]  # fmt: skip
        out[step] = (got, ref)
    out["expert_fraction"] = _expert_numel(he.module) / _expert_numel(model)
    return out


def worker(job_path: str) -> None:
    import transformers

    import hf_dsinfer
    from hf_dsinfer.modules.moe import FusedMoE
    from hf_dsinfer.policies import is_injected

    with open(job_path) as f:
        job = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ids = torch.tensor([prompts()[1]])
    results: dict = {}
    for case, (row, ep_size, inject, how) in (CASES if world == WORLD else CASES4).items():
        try:
            settings = dict(
                tensor_parallel={"tp_size": world}, moe={"ep_size": ep_size}, replace_with_kernel_inject=inject
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
                # (first expert, local experts, local features) of every fused MoE block
                "blocks": [
                    (m.expert_begin, m.num_local_experts, m.experts.down.shape[2])
                    for m in model.modules()
                    if isinstance(m, FusedMoE)
                ],
            }
        except Exception:
            results[case] = {"error": traceback.format_exc()}
    if world == WORLD4:
        try:
            results[HYBRID] = _hybrid_case(ids)
        except Exception:
            results[HYBRID] = {"error": traceback.format_exc()}
    torch.save(results, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    paths = {row: save_tiny(row, root / row) for row in ("mixtral", "qwen2_moe", "qwen3_moe")}
    paths["qwen3_moe_fused"] = save_tiny("qwen3_moe", root / "qwen3_moe_fused")
    _to_fused_layout(paths["qwen3_moe_fused"], "qwen3_moe")
    return paths


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe_tp"))
    return checkpoints, launch({"paths": checkpoints}, out, timeout=TIMEOUT_S, script=__file__)


@pytest.fixture(scope="module")
def ranks4(checkpoints, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe_tp4"))
    return checkpoints, launch({"paths": checkpoints}, out, world=WORLD4, timeout=TIMEOUT_S, script=__file__)


def _reference(path: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(input_ids=ids).logits, _greedy(reference, ids)


def _check_rank(rank: int, got: dict, inject: bool, ref_logits: torch.Tensor, ref_greedy: torch.Tensor) -> None:
    assert "error" not in got, f"rank {rank}: {got.get('error')}"
    assert got["injected"] == inject
    torch.testing.assert_close(got["logits"], ref_logits, **MODEL_LOGITS_TOL[torch.float32])
    assert torch.equal(got["greedy"], ref_greedy), f"rank {rank}: greedy tokens differ from tp=1"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_moe_tensor_and_expert_parallel_match_tp1(case, ranks):
    paths, results = ranks
    row, ep_size, inject, _ = CASES[case]
    ref_logits, ref_greedy = _reference(paths[row], torch.tensor([prompts()[1]]))
    for rank, res in enumerate(results):
        _check_rank(rank, res[case], inject, ref_logits, ref_greedy)
        # per-rank expert memory: half of every expert (tensor parallel) or half of the experts (expert parallel)
        assert res[case]["expert_fraction"] == pytest.approx(0.5, abs=0.02), res[case]["expert_fraction"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES4))
def test_expert_groups_combined_with_tensor_parallel_match_tp1(case, ranks4):
    """tp_size 4, ep_size 2: each rank holds half of the experts and half of their features, 1/4 of the weights."""
    import transformers

    paths, results = ranks4
    row, ep_size, inject, _ = CASES4[case]
    ref_logits, ref_greedy = _reference(paths[row], torch.tensor([prompts()[1]]))
    cfg = transformers.AutoConfig.from_pretrained(paths[row])
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    local = experts // ep_size
    for rank, res in enumerate(results):
        got = res[case]
        _check_rank(rank, got, inject, ref_logits, ref_greedy)
        assert got["expert_fraction"] == pytest.approx(1 / WORLD4, abs=0.01), got["expert_fraction"]
        group = rank // (WORLD4 // ep_size)  # ranks 0-1 hold the first half of the experts, ranks 2-3 the second
        assert got["blocks"] and set(got["blocks"]) == {(group * local, local, inter // 2)}, got["blocks"]


@pytest.mark.slow
def test_hybrid_engine_refreshes_expert_groups_combined_with_tensor_parallel(ranks4):
    _, results = ranks4
    for rank, res in enumerate(results):
        got = res[HYBRID]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for step in ("before", "after"):
            assert torch.equal(*got[step]), f"rank {rank} {step} the weight update: {got[step]}"
        assert not torch.equal(got["before"][1], got["after"][1]), "the update must change the tokens"
        assert got["expert_fraction"] == pytest.approx(1 / WORLD4, abs=0.01), got["expert_fraction"]


# -- single process: the splits themselves -----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 7])  # decode (each pair on its own) and prefill (sorted, grouped)
@pytest.mark.parametrize("ep_size", [1, 2, 4])
@torch.no_grad()
def test_every_ranks_partial_block_sums_to_hf_block(ep_size, tokens):
    """4 ranks' fused blocks built from :func:`expert_shards` (and Qwen2-MoE's shared expert split over all 4 ranks
    like a dense MLP) add up to HF's block: the single all-reduce of the fused block completes everything."""
    from test_moe import _fused, _hf_block

    from hf_dsinfer.modules.moe import FusedMoE
    from hf_dsinfer.parallel.moe import expert_shards

    block = _hf_block("qwen2_moe", torch.float32, num_experts=8)  # 8 experts: ep_size 4 divides them
    want = block(x := torch.randn(2, tokens, 96, generator=torch.Generator().manual_seed(4)))
    full = _fused(block, "qwen2_moe")
    gu, down = full.experts.gate_up.detach(), full.experts.down.detach()
    su, sd = full.shared.up.weight.detach(), full.shared.down.weight.detach()
    total = torch.zeros_like(want)
    for rank in range(4):
        gu_shard, down_shard = expert_shards(gu.shape[0], gu.shape[1], 4, rank, ep_size)
        shared_up = halves_shard(su.shape[0], 4, rank, dim=0)
        shared_down = even_shard(sd.shape[1], 4, rank, dim=1)
        params = {
            "mlp.router.weight": full.router.weight,
            "mlp.experts.gate_up": torch.nn.Parameter(gu_shard.take(gu)),
            "mlp.experts.down": torch.nn.Parameter(down_shard.take(down)),
            "mlp.shared.up.weight": torch.nn.Parameter(shared_up.take(su)),
            "mlp.shared.down.weight": torch.nn.Parameter(shared_down.take(sd)),
            "mlp.shared_gate.weight": full.shared_gate.weight,
        }
        begin = gu_shard.ranges[0][0] if ep_size > 1 else 0
        part = FusedMoE.from_params(full.spec, params, expert_begin=begin)
        assert part.num_local_experts == gu.shape[0] // ep_size
        assert part.experts.down.shape[2] == down.shape[2] * ep_size // 4
        total += part(x)
    torch.testing.assert_close(total, want, **MODEL_LOGITS_TOL[torch.float32])


def test_two_dim_shard_reads_the_piece_it_cuts(tmp_path):
    """An expert range with a feature cut inside: take (in memory), narrow (a view), and read (from safetensors,
    only the piece) agree with plain indexing, for both fused expert tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_dsinfer.parallel.moe import expert_shards

    gate_up = torch.randn(6, 2 * 10, 8)  # [E, 2I, C]
    down = torch.randn(6, 8, 10)  # [E, C, I]
    save_file({"gate_up": gate_up, "down": down}, str(tmp_path / "w.safetensors"))
    # tp 4, ep 2: rank 3 is the second member of group 1 -> experts [3, 6), features [5, 10) of each half
    gu_shard, down_shard = expert_shards(6, 20, 4, 3, 2)
    want_gu = torch.cat([gate_up[3:6, 5:10], gate_up[3:6, 15:20]], dim=1)
    want_down = down[3:6, :, 5:10]
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for shard, full, want, key in ((gu_shard, gate_up, want_gu, "gate_up"), (down_shard, down, want_down, "down")):
            assert shard.local_shape(full.shape) == tuple(want.shape)
            assert torch.equal(shard.take(full), want) and torch.equal(shard.narrow(full), want)
            piece = f.get_slice(key)
            assert torch.equal(shard.read(piece, piece.get_shape()), want)
    assert down_shard.narrow(down)._base is down  # one range per cut: a view, no copy (the hybrid refresh)


@pytest.mark.parametrize("ep_size", [1, 2, 4])
def test_hybrid_refresh_slices_the_planned_pieces(ep_size):
    """The Hybrid Engine's TP copy (hybrid/tp.py) copies each training weight's slice with the plan's shard: under
    ep_size 2 of tp_size 4 that is the group's experts and the rank's features within them."""
    import copy

    from tiny_models import build_tiny

    from hf_dsinfer.hybrid.tp import InferenceTP
    from hf_dsinfer.parallel import TPGroup

    model = build_tiny("mixtral")
    experts = model.model.layers[0].mlp.experts
    e, two_i, _ = experts.gate_up_proj.shape
    inter, per_group = two_i // 2, 4 // ep_size
    for rank in range(4):
        infer = copy.deepcopy(model).to("meta")
        tp = InferenceTP(TPGroup(None, 4, rank), grain=64, ep_size=ep_size)
        tp.shard(infer)
        g, m = divmod(rank, per_group)
        ex = slice(g * e // ep_size, (g + 1) * e // ep_size)
        f = inter // per_group
        rows = torch.cat([torch.arange(m * f, (m + 1) * f), inter + torch.arange(m * f, (m + 1) * f)])
        name = "model.layers.0.mlp.experts"
        got_gu = tp.local(f"{name}.gate_up_proj", experts.gate_up_proj.detach())
        got_down = tp.local(f"{name}.down_proj", experts.down_proj.detach())
        assert torch.equal(got_gu, experts.gate_up_proj.detach()[ex][:, rows])
        assert torch.equal(got_down, experts.down_proj.detach()[ex][:, :, m * f : (m + 1) * f])
        meta = infer.model.layers[0].mlp.experts
        assert meta.gate_up_proj.shape == got_gu.shape and meta.down_proj.shape == got_down.shape


@pytest.mark.parametrize(
    "tp_size, ep_size, name, match",
    [
        (4, 3, "mixtral", r"ep_size=3 does not divide tensor_parallel.tp_size=4.*set ep_size to one of \[1, 2, 4\]"),
        (2, 4, "mixtral", r"moe.ep_size=4 does not divide tensor_parallel.tp_size=2"),
        (4, 4, "qwen2_moe", r"moe.ep_size=4 does not divide the 6 experts of .*set ep_size to a common divisor"),
    ],
)
def test_ep_size_that_cannot_split_ranks_or_experts_is_refused(tp_size, ep_size, name, match):
    from tiny_models import build_tiny

    from hf_dsinfer.parallel import build_plan

    model = build_tiny(name)
    with pytest.raises(ValueError, match=match):
        build_plan(model, tp_size, 0, ep_size=ep_size)


def test_hf_block_refuses_expert_groups():
    """Without kernel injection the experts of an ep_size 2 / tp_size 4 split are an expert subset, which HF's block
    cannot compute: its forward refuses by name instead of returning a wrong partial sum."""
    from tiny_models import build_tiny

    from hf_dsinfer.parallel import TPGroup, apply_plan, build_plan

    model = build_tiny("mixtral")
    apply_plan(model, build_plan(model, 4, 3, ep_size=2), TPGroup(None, 4, 3))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[:2] == (2, 64) and experts.num_experts == 2  # experts [2, 4), half the features
    with pytest.raises(RuntimeError, match=r"moe.ep_size > 1.*keep replace_with_kernel_inject on"):
        model.model.layers[0].mlp(torch.randn(1, 3, 96))  # the MoE block alone (attention would all-reduce)


def test_ep_size_check_accepts_every_divisor():
    from hf_dsinfer.parallel.moe import check_ep_size

    for tp_size, ep_size, experts in ((4, 1, 6), (4, 2, 6), (4, 4, 8), (6, 3, 6), (8, 2, 4)):
        check_ep_size(ep_size, tp_size, experts)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    worker(sys.argv[2])
