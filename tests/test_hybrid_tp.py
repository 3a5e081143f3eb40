"""Hybrid Engine with a tensor-parallel inference copy (``inference_tp_size=2``): 2 gloo processes on CPU.

The two ranks start once (test_parallel's launcher, ``script=`` this file); each builds the same tiny fp32 llama,
wraps it for training (DDP; FSDP2 in its own case) and compares a ``inference_tp_size=2`` engine with a ``tp=1``
engine on the same weights, computed in the same process. The ranks pass *different* prompts (different counts and
widths): each must get back exactly the rows a ``tp=1`` engine returns for its own prompts. Checked: greedy tokens
(max_new_tokens, max_length, an eos list that ends rank 0's rows early), sampling with different seeds per rank
(rank 0's RNG drives the group; rank 1's own RNG state is given back; ``sampling="hf"`` too), scoring logits (fused
layers and HF's modules), ``generate_batch`` with a different number of chunks per rank, the refresh after an SGD
step, training weights bit-unchanged, each rank holding about half of the inference weights, peft LoRA, FSDP2-sharded
training weights, and settings that differ between the ranks (an error on both, no hang). Refusals that need no
second process run here directly.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

import pytest
import torch
import torch.distributed.nn  # noqa: F401  (before any group exists: a clean exit, see docs/tensor_parallel.md)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, build_tiny, left_pad, prompts, randomize_lora  # noqa: E402

WORLD = 2
TIMEOUT_S = 240
NEW = 6
TP_SECTION = {"hybrid_engine": {"enabled": True, "inference_tp_size": WORLD, "max_out_tokens": 64}}
# each rank's prompts: different batch sizes and widths
RANK_PROMPTS = {0: ((5, 9), 0), 1: ((4, 7, 3), 1)}


def _greedy(engine, ids, mask, **kw):
    kw = {"max_new_tokens": NEW, **kw}
    return engine.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **kw)


def _snapshot(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[n] = local.detach().clone()
    return out


def _unchanged(before: dict[str, torch.Tensor], model) -> bool:
    now = _snapshot(model)
    return before.keys() == now.keys() and all(torch.equal(before[n], now[n]) for n in before)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    randomize_lora(peft_model, seed=1)
    return peft_model


def _ddp_case(rank: int, res: dict) -> None:
    """DDP-replicated llama: tp=2 engine against a tp=1 engine on the same weights, before and after an SGD step."""
    import hf_dsinfer
    from hf_dsinfer.policies import is_injected

    torch.manual_seed(0)
    model = build_tiny("llama", seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    lengths, seed = RANK_PROMPTS[rank]
    ids, mask = left_pad(prompts(lengths, seed=seed))
    one = hf_dsinfer.HybridEngine(ddp, inference_config={"max_out_tokens": 64})
    before = _snapshot(ddp)
    tp = hf_dsinfer.HybridEngine(ddp, config=TP_SECTION)
    # the tp=1 engine shares the training weights (full fine-tuning, hybrid/shared_base.py): its copy's size is its own
    # bytes plus the shared ones
    res["memory_ratio"] = tp.memory()["weights"] / (one.memory()["weights"] + one.memory()["shared_with_training"])
    res["injected"] = is_injected(tp.module)
    res["repr"] = repr(tp)

    with one.inference(), tp.inference():
        res["greedy"] = (_greedy(tp, ids, mask), _greedy(one, ids, mask))
        # max_length counts the prompt, whose width differs between the ranks
        res["max_length"] = (_greedy(tp, ids, mask, max_new_tokens=None, max_length=13),
                             _greedy(one, ids, mask, max_new_tokens=None, max_length=13))  # fmt: skip
        # an eos list (agreed by both ranks) holding rank 0's third generated tokens: rank 0's rows end early
        ids0, mask0 = left_pad(prompts(*RANK_PROMPTS[0]))
        eos = sorted(set(_greedy(one, ids0, mask0)[:, ids0.shape[1] + 2].tolist()))
        res["eos"] = (_greedy(tp, ids, mask, eos_token_id=eos, max_new_tokens=12),
                      _greedy(one, ids, mask, eos_token_id=eos, max_new_tokens=12))  # fmt: skip
        # sampling: rank 1 seeds differently; the group draws with rank 0's state. Reference: the tp=1 engine on
        # the group's concatenated batch (both ranks' prompts, left-padded together) with rank 0's seed.
        group = [p for r in range(WORLD) for p in prompts(*RANK_PROMPTS[r])]
        all_ids, all_mask = left_pad(group)
        # (min_new_tokens: no eos, so every row runs to max_new_tokens and the group's length is each rank's)
        sample = dict(
            do_sample=True, top_k=0, temperature=1.0, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=PAD
        )
        offset, cut = sum(len(RANK_PROMPTS[r][0]) for r in range(rank)), all_ids.shape[1] - ids.shape[1]
        torch.manual_seed(1234)
        ref = one.generate(input_ids=all_ids, attention_mask=all_mask, **sample)[offset : offset + ids.shape[0], cut:]
        torch.manual_seed(1234 if rank == 0 else 999)
        state = torch.get_rng_state()
        got = tp.generate(input_ids=ids, attention_mask=mask, **sample)
        res["sampled"] = (got, ref)
        res["rng_own"] = torch.equal(torch.get_rng_state(), state) if rank else True
        # two sequences per prompt, with per-step scores: rows and scores of this rank's prompts
        extra = dict(sample, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
        torch.manual_seed(4321)
        ref = one.generate(input_ids=all_ids, attention_mask=all_mask, **extra)
        rows = slice(2 * offset, 2 * (offset + ids.shape[0]))
        torch.manual_seed(4321 if rank == 0 else 7)
        got = tp.generate(input_ids=ids, attention_mask=mask, **extra)
        res["dict_out"] = (got.sequences, ref.sequences[rows, cut:])
        res["scores"] = (torch.stack(got.scores), torch.stack(ref.scores)[:, rows])
        # scoring: the group's rows are right-padded and run together
        res["logits"] = (tp(input_ids=ids, attention_mask=mask).logits, one(input_ids=ids, attention_mask=mask).logits)
        # generate_batch, 2 prompts per call: rank 0 has 3 prompts (2 calls), rank 1 one (1 call, then an empty one)
        raw = prompts((5, 3, 6), seed=7) if rank == 0 else prompts((4,), seed=8)
        cfg = copy.deepcopy(tp.module.generation_config)
        cfg.pad_token_id, cfg.do_sample, cfg.max_new_tokens = PAD, False, 4
        tp.config.max_batch_size = one.config.max_batch_size = 2
        got_b = tp.generate_batch(raw, generation_config=cfg)
        ref_b = one.generate_batch(raw, generation_config=cfg)
        res["batch"] = (
            {k: v.generated_tokens for k, v in got_b.items()},
            {k: v.generated_tokens for k, v in ref_b.items()},
        )
    res["unchanged_by_generate"] = _unchanged(before, ddp)

    # one SGD step on a fixed batch (identical on both ranks): the refreshed tp=2 copy must still match tp=1
    opt = torch.optim.SGD(ddp.parameters(), lr=2.0)
    batch = torch.tensor(prompts((12, 12), seed=3))
    ddp.train()
    ddp(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    res["stepped"] = not _unchanged(before, ddp)
    with one.inference(), tp.inference():
        res["after_step"] = (_greedy(tp, ids, mask), _greedy(one, ids, mask))
    res["hf_after"] = _greedy(model, ids, mask)  # HF generate on the trained weights: the oracle of both engines
    # DDP keeps the replicas equal; were they not, the tp=2 copy would mix two different models
    res["digest"] = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum().item()


def _lora_case(rank: int, res: dict) -> None:
    import hf_dsinfer

    peft_model = _lora(build_tiny("llama", seed=0))
    ddp = torch.nn.parallel.DistributedDataParallel(peft_model)
    ids, mask = left_pad(prompts(*RANK_PROMPTS[rank]))
    one = hf_dsinfer.HybridEngine(ddp, inference_config={"max_out_tokens": 64})
    before = _snapshot(ddp)
    tp = hf_dsinfer.HybridEngine(ddp, config=TP_SECTION, refresh="auto")  # the group agrees on each refresh
    res["lora"] = (_greedy(tp, ids, mask), _greedy(one, ids, mask))
    res["lora_unchanged"] = _unchanged(before, ddp)
    # a step on the LoRA factors only: the fused slices follow it
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=1.0)
    batch = torch.tensor(prompts((12, 12), seed=3))
    ddp.train()
    ddp(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    ddp.eval()
    res["lora_after"] = (_greedy(tp, ids, mask), _greedy(one, ids, mask))
    res["lora_hf_after"] = _greedy(peft_model.merge_and_unload(), ids, mask)


def _fsdp_case(rank: int, res: dict) -> None:
    """FSDP2-sharded training weights (DTensors): the refresh gathers each tensor, then keeps this rank's slice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import hf_dsinfer

    model = build_tiny("llama", seed=0)
    ids, mask = left_pad(prompts(*RANK_PROMPTS[rank]))
    one = hf_dsinfer.HybridEngine(build_tiny("llama", seed=0), inference_config={"max_out_tokens": 64})
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    res["fsdp_sharded"] = sum(isinstance(p, DTensor) for p in model.parameters())
    before = _snapshot(model)
    tp = hf_dsinfer.HybridEngine(model, config=TP_SECTION)
    res["fsdp"] = (_greedy(tp, ids, mask), _greedy(one, ids, mask))
    res["fsdp_unchanged"] = _unchanged(before, model)
    # an SGD step on the shards; reference: a tp=1 engine over the same FSDP2 model (it gathers whole tensors)
    sharded_one = hf_dsinfer.HybridEngine(model, inference_config={"max_out_tokens": 64})
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    batch = torch.tensor(prompts((12, 12), seed=3))
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    model.eval()
    res["fsdp_after"] = (_greedy(tp, ids, mask), _greedy(sharded_one, ids, mask))


def _mismatch_case(rank: int, res: dict) -> None:
    """Ranks passing different settings: both raise (no rank waits forever in a collective)."""
    import hf_dsinfer

    tp = hf_dsinfer.HybridEngine(build_tiny("llama", seed=0), config=TP_SECTION)
    ids, mask = left_pad(prompts(*RANK_PROMPTS[rank]))
    try:
        _greedy(tp, ids, mask, max_new_tokens=3 + rank)
        res["mismatch"] = "no error"
    except ValueError as e:
        res["mismatch"] = str(e)
    try:  # one rank's bad request (an empty prompt) stops both
        bad = ids[:, :0] if rank == 1 else ids
        _greedy(tp, bad, mask[:, : bad.shape[1]])
        res["bad_request"] = "no error"
    except Exception as e:  # noqa: BLE001
        res["bad_request"] = f"{type(e).__name__}: {e}"
    try:
        hf_dsinfer.HybridEngine(build_tiny("llama", seed=0), config={"enabled": True, "inference_tp_size": 3})
        res["too_large"] = "no error"
    except ValueError as e:
        res["too_large"] = str(e)


def _hf_sampling_case(rank: int, res: dict) -> None:
    """sampling="hf" (transformers' loop on the copy, torch's global RNG per step): the group draws with rank 0's
    state; reference: the tp=1 engine with sampling="hf" on the group's concatenated batch, rank 0's seed."""
    import hf_dsinfer

    model = build_tiny("llama", seed=0)
    ids, mask = left_pad(prompts(*RANK_PROMPTS[rank]))
    one = hf_dsinfer.HybridEngine(model, inference_config={"max_out_tokens": 64}, sampling="hf")
    tp = hf_dsinfer.HybridEngine(model, config=TP_SECTION, sampling="hf")
    all_ids, all_mask = left_pad([p for r in range(WORLD) for p in prompts(*RANK_PROMPTS[r])])
    sample = dict(do_sample=True, top_k=0, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=PAD)
    offset, cut = sum(len(RANK_PROMPTS[r][0]) for r in range(rank)), all_ids.shape[1] - ids.shape[1]
    torch.manual_seed(55)
    ref = one.generate(input_ids=all_ids, attention_mask=all_mask, **sample)[offset : offset + ids.shape[0], cut:]
    torch.manual_seed(55 if rank == 0 else 66)
    res["hf_sampled"] = (tp.generate(input_ids=ids, attention_mask=mask, **sample), ref)
    # no kernel injection: HF's modules split by AutoTP (scoring pads on the right for them)
    plain = hf_dsinfer.HybridEngine(model, config=TP_SECTION, replace_with_kernel_inject=False)
    res["hf_modules"] = (_greedy(plain, ids, mask), _greedy(one, ids, mask))
    # unpadded rows whose width differs between the ranks: the group right-pads rank 1's rows
    flat = torch.tensor(prompts((9, 9) if rank == 0 else (7, 7, 7), seed=rank))
    res["hf_modules_logits"] = (plain(input_ids=flat).logits, one(input_ids=flat).logits)


CASES = {
    "ddp": _ddp_case,
    "lora": _lora_case,
    "fsdp": _fsdp_case,
    "mismatch": _mismatch_case,
    "hf_sampling": _hf_sampling_case,
}


def worker(job_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict = {}
    for name, case in CASES.items():
        res: dict = {}
        try:
            case(rank, res)
        except Exception:  # noqa: BLE001 - reported to the test through the result file
            res["error"] = traceback.format_exc()
        results[name] = res
    torch.save(results, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_tp")
    return launch({}, str(root), world=WORLD, timeout=TIMEOUT_S, script=__file__)


def _case(ranks, name: str) -> list[dict]:
    out = []
    for rank, results in enumerate(ranks):
        res = results[name]
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        out.append(res)
    return out


def _same(pair, what: str, rank: int) -> None:
    got, ref = pair
    assert torch.equal(got, ref), f"rank {rank} {what}: tp=2 {got.tolist()} != tp=1 {ref.tolist()}"


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_with_different_prompts_per_rank(ranks):
    for rank, res in enumerate(_case(ranks, "ddp")):
        assert res["injected"], "the tp=2 copy must run fused layers on its slices"
        assert "inference_tp_size=2" in res["repr"], res["repr"]
        n = len(RANK_PROMPTS[rank][0])
        assert res["greedy"][0].shape[0] == n, "each rank gets back its own rows only"
        for what in ("greedy", "max_length", "eos", "after_step"):
            _same(res[what], what, rank)
        if rank == 0:  # the eos list ends rank 0's rows by their third token: cut where tp=1 stops, not at 12
            assert res["eos"][0].shape[1] <= max(RANK_PROMPTS[0][0]) + 3, res["eos"][0].shape


@pytest.mark.slow
def test_tp2_sampling_follows_rank0_rng_and_logits_match(ranks):
    for rank, res in enumerate(_case(ranks, "ddp")):
        _same(res["sampled"], "sampled (rank 0's seed drives the group)", rank)
        _same(res["dict_out"], "num_return_sequences=2, return_dict_in_generate", rank)
        got, ref = res["scores"]
        finite = ref.isfinite()  # top-k / processors leave -inf where tokens are masked
        assert torch.equal(finite, got.isfinite()) and torch.allclose(got[finite], ref[finite], rtol=1e-4, atol=1e-4)
        assert res["rng_own"], "rank 1's own RNG state must be given back after the group's generation"
        got, ref = res["logits"]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        other = _case(ranks, "hf_sampling")[rank]
        _same(other["hf_sampled"], 'sampling="hf"', rank)
        _same(other["hf_modules"], "HF's modules split by AutoTP (no injection)", rank)
        got, ref = other["hf_modules_logits"]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        got_b, ref_b = res["batch"]
        assert got_b == ref_b, f"rank {rank} generate_batch: {got_b} != {ref_b}"


@pytest.mark.slow
def test_tp2_refresh_after_step_and_training_weights_untouched(ranks):
    digests = [res["digest"] for res in _case(ranks, "ddp")]
    assert len(set(digests)) == 1, f"the DDP replicas differ after the step: {digests}"
    for res in _case(ranks, "ddp"):
        assert res["unchanged_by_generate"], "generate must not write the training weights"
        assert res["stepped"], "the SGD step must change the weights (else the refresh check proves nothing)"
        assert torch.equal(res["after_step"][1], res["hf_after"]), "tp=1 engine after the step != HF generate"
        assert not torch.equal(res["after_step"][1], res["greedy"][1]), "the step must change the greedy tokens"
        # each rank holds its slices: about half of the fused weights (norms and rotary tables replicated)
        assert 0.45 < res["memory_ratio"] < 0.6, res["memory_ratio"]


@pytest.mark.slow
def test_tp2_lora_and_fsdp2(ranks):
    for rank, res in enumerate(_case(ranks, "lora")):
        _same(res["lora"], "peft LoRA", rank)
        assert res["lora_unchanged"]
        _same(res["lora_after"], "peft LoRA after a step (refresh='auto')", rank)
        assert torch.equal(res["lora_after"][1], res["lora_hf_after"]), "tp=1 != HF on the merged LoRA model"
        assert not torch.equal(res["lora_after"][1], res["lora"][1]), "the LoRA step must change the tokens"
    for rank, res in enumerate(_case(ranks, "fsdp")):
        assert res["fsdp_sharded"] > 0, "fully_shard left no DTensor: the case would prove nothing"
        _same(res["fsdp"], "FSDP2", rank)
        assert res["fsdp_unchanged"]
        _same(res["fsdp_after"], "FSDP2 after an SGD step", rank)
        assert not torch.equal(res["fsdp_after"][1], res["fsdp"][1]), "the step must change the tokens"


@pytest.mark.slow
def test_tp2_refusals_between_ranks(ranks):
    for rank, res in enumerate(_case(ranks, "mismatch")):
        assert "different generation settings" in res["mismatch"], res["mismatch"]
        assert res["bad_request"] != "no error"
        if rank == 0:
            assert "refused their request" in res["bad_request"], res["bad_request"]
        assert "hybrid_engine.inference_tp_size=3 is larger than the world size 2" in res["too_large"]


# -- refusals that need no second process ---------------------------------------------------------------------------


def test_inference_tp_without_process_group_is_refused(monkeypatch):
    import hf_dsinfer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"hybrid_engine.inference_tp_size=2 .*torch.distributed is not initialized"):
        hf_dsinfer.HybridEngine(build_tiny("llama", seed=0), config=TP_SECTION)
    with pytest.raises(ValueError, match=r"tensor_parallel.tp_size=2 .*torchrun"):
        hf_dsinfer.HybridEngine(build_tiny("llama", seed=0), tensor_parallel={"tp_size": 2})


def test_world_size_not_a_multiple_is_refused(monkeypatch):
    import torch.distributed as dist

    from hf_dsinfer.hybrid import tp

    monkeypatch.setattr(tp, "init_distributed", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(ValueError, match=r"hybrid_engine.inference_tp_size=2 does not divide the world size 3"):
        tp.inference_group(2, "hybrid_engine.inference_tp_size")
    with pytest.raises(ValueError, match=r"inference_tp_size=4 is larger than the world size 3"):
        tp.inference_group(4, "hybrid_engine.inference_tp_size")


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    worker(sys.argv[2])
