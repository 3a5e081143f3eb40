"""Tensor parallelism beyond AutoTP's HF modules: fused olmo2 (full-width q/k norm, statistics summed over the ranks),
fused bloom (ALiBi slopes of each rank's own heads, even and uneven head splits) and the generic path (HF's split
modules, attention through hf_dsinfer's static cache) on 2 gloo processes, against HF's eager model at tp=1.

The ranks start once for every case (test_parallel's launcher running this file's worker). Each case checks the
padded batch's prefill logits on real positions and the logits of 20 greedy decode steps within the fp32 tolerance,
the 20 greedy tokens identical, sampled tokens identical on both ranks, the path taken (fused / generic), and this
rank's head split. One encoder case (roberta on the fused bert path) checks masked-LM logits of a right-padded batch.
The unit tests at the end check two pieces the fused layers gained, without processes: the split q/k norm against the
unsplit one, and the compiled CPU decode step's ALiBi bias against the decode kernel.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, left_pad, prompts  # noqa: E402
from tolerances import MODEL_LOGITS_TOL  # noqa: E402

WORLD = 2
NEW_TOKENS = 20
TIMEOUT_S = 400
_GQA = dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=2)
# name -> (model_type, config, path expected on every rank, (local q heads, local kv heads) per rank)
CASES = {
    "olmo2": ("olmo2", _GQA, "fused", [(3, 1), (3, 1)]),
    # one kv head, replicated on both ranks: its k-norm elements must count once in the summed statistics
    "olmo2_mqa": ("olmo2", dict(_GQA, num_key_value_heads=1), "fused", [(3, 1), (3, 1)]),
    "bloom6": ("bloom", dict(hidden_size=96, n_head=6), "fused", [(3, 3), (3, 3)]),  # slopes of heads 3..5 on rank 1
    "bloom5": ("bloom", dict(hidden_size=80, n_head=5), "fused", [(3, 3), (2, 2)]),  # uneven: 3 / 2 heads
    # no policy: the generic path on HF's split modules (sliding + full layers, full-width q/k norm split by AutoTP)
    "olmo3": ("olmo3", dict(_GQA, sliding_window=4, layer_types=["sliding_attention", "full_attention"]), "generic",
              [(3, 1), (3, 1)]),
    # one kv head replicated on both ranks: HF's num_key_value_groups and the rank's cache hold it once each
    "helium_mqa": ("helium", dict(_GQA, head_dim=16, num_key_value_heads=1), "generic", [(3, 1), (3, 1)]),
    # an encoder on fused non-causal layers (the bert path): masked-LM logits of a right-padded batch
    "roberta": ("roberta", dict(hidden_size=96, intermediate_size=136, num_attention_heads=6, pad_token_id=1),
                "fused", [(3, 3), (3, 3)]),
}  # fmt: skip
ENCODERS = {"roberta"}
SAMPLED = ("olmo2", "bloom5", "helium_mqa")  # sampling agrees across ranks: one fused row of each kind, one generic


def save_case(name: str, directory) -> str:
    """Build and save one case (two layers, vocab 500, seeded weights, norm weights perturbed); return the path."""
    import transformers

    model_type, config, _, _ = CASES[name]
    common = dict(vocab_size=500, num_hidden_layers=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1,
                  eos_token_id=2)  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**common, **config})
    torch.manual_seed(0)
    model = _auto(name).from_config(config)
    with torch.no_grad():  # norms start at ones: perturb them so a norm weight sliced the wrong way shows
        for n, p in model.named_parameters():
            if "norm" in n.lower() and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


def _auto(name: str):
    import transformers

    encoder = name in ENCODERS
    return transformers.AutoModelForMaskedLM if encoder else transformers.AutoModelForCausalLM


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded batch: left padding for decoders, right padding for encoders (what the fused encoder takes)."""
    ids, mask = left_pad(prompts())
    if name in ENCODERS:
        ids, mask = ids.flip(1), mask.flip(1)  # rows reversed: real tokens first, padding last
    return ids, mask


def _generate(model, sample: bool) -> dict:
    ids, mask = left_pad(prompts())
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sample else dict(do_sample=False)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD,
        return_dict_in_generate=True, output_logits=True, **kw,
    )  # fmt: skip
    return {"tokens": out.sequences[:, ids.shape[1] :], "steps": torch.stack(out.logits, 1)}  # steps [B, N, V]


def _run(model, name: str) -> dict:
    ids, mask = _batch(name)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    return {"logits": logits} if name in ENCODERS else {"logits": logits, **_generate(model, sample=False)}


def _path(model) -> str:
    from hf_dsinfer.policies import is_injected
    from hf_dsinfer.policies.generic import get_generic

    return "fused" if is_injected(model) else "generic" if get_generic(model) is not None else "hf"


def worker(job_path: str) -> None:
    """One rank: every case with ``replace_with_kernel_inject=True`` and ``tp_size=2``; results to ``rank{RANK}.pt``."""

    import hf_dsinfer  # noqa: F401 - registers the inference_config flag

    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": True, "tensor_parallel": {"tp_size": WORLD}}
    out: dict = {}
    for name, path in job["paths"].items():
        try:
            t0 = time.perf_counter()
            model = _auto(name).from_pretrained(path, inference_config=cfg)
            got = _run(model, name)
            if name in SAMPLED:
                torch.manual_seed(1234 + rank)  # different on purpose: rank 0's RNG state must reach every rank
                got["sampled"] = _generate(model, sample=True)["tokens"]
            got["path"] = _path(model)
            got["heads"] = next(iter(model._dsinfer_tp_plan.local_heads.values()))
            got["modules"] = sorted({type(m).__name__ for m in model.modules()})
            got["seconds"] = time.perf_counter() - t0
            out[name] = got
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Save every case, start the two ranks once, return (paths, rank results)."""
    base = tmp_path_factory.mktemp("tp_coverage")
    paths = {name: save_case(name, base / name) for name in CASES}
    return paths, launch({"paths": paths}, str(base), world=WORLD, timeout=TIMEOUT_S, script=__file__)


@torch.no_grad()
def _reference(name: str, path: str) -> dict:
    return _run(_auto(name).from_pretrained(path, dtype=torch.float32).eval(), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_fused_and_generic_match_tp1(run, name):
    paths, results = run
    ref = _reference(name, paths[name])
    real = _batch(name)[1].bool()
    tol = MODEL_LOGITS_TOL[torch.float32]
    _, _, path, heads = CASES[name]
    for rank, res in enumerate(results):
        got = res[name]
        assert "error" not in got, got.get("error")
        assert got["path"] == path, f"{name} rank {rank} took the {got['path']} path"
        assert got["heads"] == heads[rank], f"{name} rank {rank} keeps {got['heads']} heads"
        what = f"{name} rank {rank}"
        # prefill logits at left-padding positions mean nothing (fused layers skip them; HF's are arbitrary)
        torch.testing.assert_close(got["logits"][real], ref["logits"][real], **tol, msg=f"{what}: prefill logits")
        if name in ENCODERS:
            continue
        torch.testing.assert_close(got["steps"], ref["steps"], **tol, msg=f"{what}: decode-step logits")
        assert torch.equal(got["tokens"], ref["tokens"]), f"{what}: greedy tokens differ from tp=1"
    if name in SAMPLED:
        assert torch.equal(results[0][name]["sampled"], results[1][name]["sampled"]), f"{name}: ranks sampled apart"
    if name.startswith("olmo2"):  # the fused layers normalize q/k over all ranks' heads themselves
        assert "SplitRMSNorm" in results[0][name]["modules"]


# -- the pieces, without processes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_copies", [1, 2])
def test_split_rms_norm_pair_equals_the_full_width_norm(kv_copies):
    """Two simulated ranks (the reduce sums their partial statistics) give the unsplit norm of q and k."""
    from hf_dsinfer.modules.norms import NormSpec, split_rms_norm_pair
    from hf_dsinfer.modules.norms import SplitRMSNorm as Norm

    torch.manual_seed(0)
    spec = NormSpec("rms", 1e-6)
    q, k = torch.randn(2, 3, 6 * 5), torch.randn(2, 3, 2 * 5 // kv_copies)  # [B, T, Hq*D], [B, T, Hk*D]
    wq, wk = torch.randn(q.shape[-1]), torch.randn(k.shape[-1])

    def full(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    # rank r holds q heads [3r, 3r+3) and either half of k (2 kv heads) or all of it (1 kv head, replicated)
    q_parts, k_parts = q.chunk(2, -1), (k.chunk(2, -1) if kv_copies == 1 else (k, k))
    wq_parts, wk_parts = wq.chunk(2), (wk.chunk(2) if kv_copies == 1 else (wk, wk))
    partial = []

    def collect(t):  # first pass: record each rank's partial sums; the sum over ranks is filled in below
        partial.append(t.clone())
        return t

    norms = [
        (Norm(spec, wq_parts[r], q.shape[-1], collect), Norm(spec, wk_parts[r], k.shape[-1], collect, 1 / kv_copies))
        for r in range(2)
    ]
    for r in range(2):
        split_rms_norm_pair(*norms[r], q_parts[r], k_parts[r])
    total = partial[0] + partial[1]  # what the all-reduce would give every rank: [B, T, 2]
    outs = []
    for r in range(2):
        for n in norms[r]:
            n.reduce = lambda t: t.copy_(total)
        outs.append(split_rms_norm_pair(*norms[r], q_parts[r], k_parts[r]))
    torch.testing.assert_close(torch.cat([outs[0][0], outs[1][0]], -1), full(q, wq))
    got_k = torch.cat([outs[0][1], outs[1][1]], -1) if kv_copies == 1 else outs[1][1]
    torch.testing.assert_close(got_k, full(k, wk))


def test_compiled_decode_step_adds_alibi_like_the_decode_kernel():
    """The sync-free decode step (compiled CPU decode) adds ``slope[h] * slot``, as ``decode_attention`` does."""
    from hf_dsinfer.kernels import decode_attention

    from hf_dsinfer.modules.attention import AttentionSpec, StepContext, _sync_free_attend
    from hf_dsinfer.policies.bloom import alibi_slopes

    torch.manual_seed(0)
    B, Hq, Hk, D, S = 3, 6, 2, 8, 16
    slopes = torch.tensor(alibi_slopes(Hq))
    k_cache, v_cache = torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
    q, k, v = torch.randn(B, Hq, D), torch.randn(B, Hk, D), torch.randn(B, Hk, D)
    lens = torch.tensor([4, 9, 1], dtype=torch.int32)  # cached tokens before this step
    ctx = StepContext(None, torch.zeros(B, dtype=torch.int32), lens, torch.zeros(B), None, seq_lens=lens + 1)
    ctx.attend_len = 12
    spec = AttentionSpec(Hq, Hk, D, D**-0.5, rotary=False, alibi_slopes=tuple(slopes.tolist()))
    one = (q[:, None], k[:, None], v[:, None], k_cache, v_cache, ctx, spec)  # one token per row
    got = _sync_free_attend(*one, slopes)[:, 0]  # stores k/v at slot lens[b]
    want = decode_attention(q, k_cache, v_cache, lens + 1, D**-0.5, alibi_slopes=slopes)
    torch.testing.assert_close(got, want)
    without = _sync_free_attend(*one)[:, 0]
    assert not torch.allclose(without, want)  # the bias matters at these lengths


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    worker(sys.argv[2])
    sys.exit(0)


def _split_on_one_process(name: str, rank: int):
    """Case ``name`` split for ``rank`` of 2 in this process (shapes and records only: nothing communicates), with
    the TPLayout injection would get, the policy's specs / weight maps read under it, and the layer list."""
    import dataclasses

    import transformers

    from hf_dsinfer.integration.apply import tp_layout
    from hf_dsinfer.parallel import TPGroup, apply_plan, build_plan
    from hf_dsinfer.policies import find_policy
    from hf_dsinfer.policies.base import as_source

    model_type, config, _, _ = CASES[name]
    common = dict(vocab_size=500, num_hidden_layers=2, pad_token_id=PAD)
    model = _auto(name).from_config(transformers.AutoConfig.for_model(model_type, **{**common, **config}))
    apply_plan(model, build_plan(model, 2, rank), TPGroup(None, 2, rank))
    layout = dataclasses.replace(tp_layout(model), reduce=lambda t: t)
    policy = find_policy(model)
    layers = model.base_model.get_submodule(policy.layers_attr)
    with layout.local_config(model):
        specs = [policy.layer_spec(model, i, layer) for i, layer in enumerate(layers)]
        maps = [{k: as_source(v) for k, v in policy.weight_map(model, i, layer).items() if v is not None}
                for i, layer in enumerate(layers)]  # fmt: skip
    prefix = next(n for n, m in model.named_modules() if m is layers)
    return layout, specs, maps, layers, prefix


@pytest.mark.parametrize("rank", [0, 1])
def test_bloom_ranks_take_the_slopes_of_their_global_heads(rank):
    """5 heads on 2 ranks: heads 0-2 and 3-4, each rank with the slopes of those heads of the 5-head sequence."""
    from hf_dsinfer.policies.bloom import alibi_slopes

    layout, specs, maps, layers, prefix = _split_on_one_process("bloom5", rank)
    assert layout.check(prefix, layers, specs, maps) is None
    want = alibi_slopes(5)[:3] if rank == 0 else alibi_slopes(5)[3:]
    assert all(s.attention.alibi_slopes == want for s in specs)


def test_olmo2_fused_layers_take_the_split_norm_only_when_the_spec_says_so():
    """The olmo2 spec carries the full widths of the split q/k norms (k replicated: share 1/2); a spec without them
    would normalize this rank's heads only, so the check refuses it."""
    import dataclasses

    layout, specs, maps, layers, prefix = _split_on_one_process("olmo2_mqa", 1)
    assert specs[0].attention.qk_norm_split == ((96, 1.0), (16, 0.5))  # q: 6 heads of 16; k: one head, on both ranks
    assert layout.check(prefix, layers, specs, maps) is None
    plain = [dataclasses.replace(s, attention=dataclasses.replace(s.attention, qk_norm_split=None)) for s in specs]
    reason = layout.check(prefix, layers, plain, maps)
    assert reason is not None and "normalizes over all heads" in reason
