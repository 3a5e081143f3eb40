"""Tensor parallelism of encoder-decoder models whose embeddings share one vocab-split weight: 2 gloo ranks vs tp=1.

T5 (tied and untied LM head), Marian and BART tie ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``
(three ``nn.Embedding`` modules, one weight) to the input embedding, and a tied LM head to it too. AutoTP makes every
one of them vocab-parallel with the same slice (``TPPlan.tied_embeddings``). Vocab 500 with the default
``tp_grain_size`` 64 is an uneven split: 7 units of 64 dealt 4 / 3, the 52 rows left over to the last rank
(256 / 244 rows).

The ranks start once (test_parallel's launcher running this file's worker). Each row checks the teacher-forced
logits of a padded batch within the fp32 tolerance of tp=1, 8 greedy tokens identical to tp=1, sampled tokens
identical on both ranks (rank 0's RNG state is broadcast), the vocab split and that the weights really are split.
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

from test_parallel import launch  # noqa: E402 - the gloo launcher, run on this file's worker
from tiny_models import PAD, left_pad, prompts  # noqa: E402
from tolerances import MODEL_LOGITS_TOL  # noqa: E402

# One xdist worker runs the whole module: its module-scoped launch would otherwise run once per worker.
pytestmark = pytest.mark.xdist_group("test_parallel_encdec")

WORLD = 2
NEW_TOKENS = 8
TIMEOUT_S = 300
VOCAB = 500
VOCAB_ROWS = [256, 244]  # 500 = 7 units of 64 + 52: units dealt 4 / 3, the 52 left over to the last rank
_SEQ2SEQ = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64)  # fmt: skip
_T5 = dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4)
_T5_EMB = ["decoder.embed_tokens", "encoder.embed_tokens", "shared"]
_BART_EMB = ["model.decoder.embed_tokens", "model.encoder.embed_tokens", "model.shared"]
# name -> (model_type, config overrides, the embedding modules sharing the vocab-split weight: all vocab-parallel)
ROWS = {
    "t5": ("t5", _T5, _T5_EMB),
    "t5_untied": ("t5", dict(_T5, d_kv=24, tie_word_embeddings=False), _T5_EMB),  # head width d_kv != d_model / heads
    "marian": ("marian", _SEQ2SEQ, _BART_EMB),
    "bart": ("bart", _SEQ2SEQ, _BART_EMB),  # scaled word embeddings
    "t5_ds_policy": ("t5", _T5, _T5_EMB),  # DeepSpeed's T5 injection_policy instead of the traced plan
}
# Rows split in place by init_inference on a built model (the others load each rank's slices with from_pretrained).
# Marian only so: its sinusoidal position table is not in the checkpoint (transformers recomputes it at init), which
# the per-rank sliced loader does not do yet (parallel/loading.py).
IN_PLACE = {"marian", "t5_ds_policy"}
# DeepSpeed's AutoTP tests name T5's output projections this way (the block class and its row-parallel linears).
POLICIES = {"t5_ds_policy": {"T5Block": ["SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo"]}}


def save_row(name: str, directory) -> str:
    """Build and save one row (vocab 500, seeded weights); return the path."""
    import transformers

    model_type, config, _ = ROWS[name]
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=PAD)
    config = transformers.AutoConfig.for_model(model_type, **{**common, **config})
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    with torch.no_grad():  # a zero final_logits_bias (Marian, BART) would not show a bias gathered the wrong way
        for name_, buf in model.named_buffers():
            if name_.endswith("final_logits_bias"):
                buf.copy_(torch.randn_like(buf) * 0.5)
    model.save_pretrained(os.fspath(directory))
    return os.fspath(directory)


def _decoder_inputs() -> torch.Tensor:
    """Teacher-forced decoder ids ``[3, 6]``, starting with the decoder start token."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    ids[:, 0] = PAD
    return ids


def _generate(model, sample: bool) -> torch.Tensor:
    ids, mask = left_pad(prompts())
    kw = dict(do_sample=True, top_k=0, temperature=1.0) if sample else dict(do_sample=False)
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD,
        **kw,
    )  # fmt: skip


@torch.no_grad()
def _run(model) -> dict:
    ids, mask = left_pad(prompts())
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=_decoder_inputs()).logits  # [B, 6, V]
    return {"logits": logits, "greedy": _generate(model, sample=False)}


def worker(job_path: str) -> None:
    """One rank: every row with ``tp_size=2`` (HF modules, AutoTP); results to ``rank{RANK}.pt``."""
    import transformers

    import hf_dsinfer

    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    cfg = {"dtype": "fp32", "tensor_parallel": {"tp_size": WORLD}}  # replace_with_kernel_inject="auto": no policy
    out: dict = {}
    for name, path in job["paths"].items():
        try:
            if name in IN_PLACE:
                full = transformers.AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32)
                policy = {"injection_policy": POLICIES[name]} if name in POLICIES else {}
                model = hf_dsinfer.init_inference(full, config={**cfg, **policy}).module
            else:
                model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path, inference_config=cfg)
            got = _run(model)
            torch.manual_seed(1234 + rank)  # different on purpose: rank 0's RNG state must reach every rank
            with torch.no_grad():
                got["sampled"] = _generate(model, sample=True)
            plan = model._dsinfer_tp_plan
            got["head_rows"] = plan.head[1] if plan.head else None
            got["embedding"] = plan.embedding
            got["tied"] = plan.tied_embeddings
            got["local_rows"] = {
                n: m.weight.shape[0] for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
            }
            got["n_params"] = sum(p.numel() for p in model.parameters())
            out[name] = got
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"error": traceback.format_exc()}
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Save every row, start the two ranks once, return (paths, rank results)."""
    base = tmp_path_factory.mktemp("tp_encdec")
    paths = {name: save_row(name, base / name) for name in ROWS}
    return paths, launch({"paths": paths}, str(base), world=WORLD, timeout=TIMEOUT_S, script=__file__)


@torch.no_grad()
def _reference(path: str) -> tuple[dict, int]:
    import transformers

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    return _run(model), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(ROWS))
def test_tp2_encoder_decoder_with_shared_embeddings_matches_tp1(run, name):
    paths, results = run
    ref, n_params = _reference(paths[name])
    for rank, got in enumerate(results):
        got = got[name]
        assert "error" not in got, got.get("error")
        what = f"{name} rank {rank}"
        torch.testing.assert_close(got["logits"], ref["logits"], **MODEL_LOGITS_TOL[torch.float32], msg=what)
        assert torch.equal(got["greedy"], ref["greedy"]), f"{what}: greedy tokens differ from tp=1"
        # the uneven vocab split: every embedding sharing the weight holds this rank's rows, the same range
        start = sum(VOCAB_ROWS[:rank])
        stop = start + VOCAB_ROWS[rank]
        assert got["head_rows"] == VOCAB_ROWS
        assert got["embedding"][1:] == (start, stop)
        assert sorted([got["embedding"][0]] + [t[0] for t in got["tied"]]) == ROWS[name][2]
        assert all(t[1:] == (start, stop) for t in got["tied"])
        for module in ROWS[name][2]:
            assert got["local_rows"][module] == VOCAB_ROWS[rank], f"{what}: {module} holds the whole vocab"
        assert got["n_params"] < 0.8 * n_params, f"{what}: the weights are not split"
    assert torch.equal(results[0][name]["sampled"], results[1][name]["sampled"]), f"{name}: ranks sampled apart"


def test_a_non_embedding_module_sharing_the_split_weight_is_refused():
    """Only nn.Embedding modules can be made vocab-parallel; another holder of the weight is refused by name."""
    import transformers

    from hf_dsinfer.parallel.autotp import build_plan

    config = transformers.AutoConfig.for_model("t5", vocab_size=VOCAB, **_T5)
    model = transformers.T5ForConditionalGeneration(config)
    model.encoder.probe = torch.nn.Linear(64, VOCAB, bias=False)
    model.encoder.probe.weight = model.shared.weight  # a second, non-embedding reader of the split vocab
    with pytest.raises(ValueError, match=r"encoder\.probe\.weight share the vocab-split weight .*tp_size=1"):
        build_plan(model, 2, 0)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    worker(sys.argv[2])
    sys.exit(0)
