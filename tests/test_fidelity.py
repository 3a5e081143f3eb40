"""The fidelity table: every architecture, loaded with ``inference_config``, against HF's eager model.

For each row of ``tiny_models.ARCHITECTURES`` and each dtype: logits within ``MODEL_LOGITS_TOL``, 20 greedy tokens
identical to HF's, and a left-padded batch identical to the same prompts run one by one. Encoders compare hidden
states (and a right-padded batch against singles on the real tokens). Later features add columns to ``MODES``.

``inject`` mode: rows whose model_type has a policy must run on fused layers (``is_injected``); the other rows
exercise the no-policy fallback (HF's modules, one warning) and must still match HF. ``hf`` mode turns injection
off (``replace_with_kernel_inject=False``): HF's modules under hf_dsinfer's config and generate loop.

Machine independence: bf16 GEMMs round differently across CPUs (ISA, thread count), and HF's own bf16 eager model
does not give a left-padded batch the tokens of its single runs on every CPU. So bf16 rows also compare logits with
HF's fp32 model under the bf16 tolerance, and in ``hf`` mode the padded batch must equal what HF's own bf16 model
gives for that batch (what HF guarantees), not the single runs.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, PAD, left_pad, prompts, save_tiny
from tolerances import MODEL_LOGITS_TOL

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.policies import POLICIES, is_injected

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Extra inference-config settings per mode; the dtype comes from DTYPES.
MODES = {"hf": {"replace_with_kernel_inject": False}, "inject": {"replace_with_kernel_inject": True}}
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = save_tiny(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _load(arch, path, dtype, inference_config=None):
    cls = getattr(transformers, arch.auto_class)
    if inference_config is None:
        return cls.from_pretrained(path, dtype=dtype).eval()
    return cls.from_pretrained(path, inference_config=inference_config).eval()


def _greedy(model, ids, mask):
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=PAD,
    )
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.no_grad()
def test_fidelity(name, dtype_name, mode, saved):
    arch = ARCHITECTURES[name]
    dtype = DTYPES[dtype_name]
    path = saved(name)
    reference = _load(arch, path, dtype)
    optimized = _load(arch, path, dtype, {"dtype": dtype_name, **MODES[mode]})
    assert optimized.dtype == dtype
    assert hf_dsinfer.integration.apply.get_inference_config(optimized) is not None
    if MODES[mode].get("replace_with_kernel_inject"):
        assert is_injected(optimized) == (arch.model_type in POLICIES), "policy rows must run on fused layers"
    tol = MODEL_LOGITS_TOL[dtype]
    batch = prompts()

    if arch.encoder:
        ids = torch.tensor([batch[1]])
        ref = reference(input_ids=ids).last_hidden_state
        got = optimized(input_ids=ids).last_hidden_state
        torch.testing.assert_close(got.float(), ref.float(), **tol)
        # right-padded batch against singles, on the real tokens only
        width = max(len(p) for p in batch)
        pids = torch.tensor([p + [PAD] * (width - len(p)) for p in batch])
        pmask = (torch.arange(width)[None] < torch.tensor([len(p) for p in batch])[:, None]).long()
        padded = optimized(input_ids=pids, attention_mask=pmask).last_hidden_state
        for i, p in enumerate(batch):
            single = optimized(input_ids=torch.tensor([p])).last_hidden_state[0]
            torch.testing.assert_close(padded[i, : len(p)].float(), single.float(), **tol)
        return

    ids = torch.tensor([batch[1]])
    mask = torch.ones_like(ids)
    ref_logits = reference(input_ids=ids, attention_mask=mask).logits
    got_logits = optimized(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got_logits.float(), ref_logits.float(), **tol)
    if dtype != torch.float32:
        fp32_logits = _load(arch, path, torch.float32)(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got_logits.float(), fp32_logits, **tol)

    assert torch.equal(_greedy(optimized, ids, mask), _greedy(reference, ids, mask)), "greedy tokens differ from HF"

    pids, pmask = left_pad(batch)
    padded = _greedy(optimized, pids, pmask)
    if mode == "hf" and dtype != torch.float32:
        # HF's modules in bf16: equal to HF's own padded batch (padded == singles is not something HF's bf16 path
        # delivers on every CPU).
        assert torch.equal(padded, _greedy(reference, pids, pmask)), "left-padded batch differs from HF's"
        return
    for i, p in enumerate(batch):
        single = _greedy(optimized, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
        assert torch.equal(padded[i], single[0]), f"row {i} of the left-padded batch differs from its single run"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
@torch.no_grad()
def test_fidelity_cuda(name, dtype_name, saved):
    """The table on a GPU with the Triton kernels: fused logits against HF's within the dtype's tolerance."""
    arch = ARCHITECTURES[name]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    path = saved(name)
    cls = getattr(transformers, arch.auto_class)
    reference = cls.from_pretrained(path, dtype=dtype).to("cuda").eval()
    optimized = cls.from_pretrained(path, inference_config={"dtype": dtype_name, "replace_with_kernel_inject": True})
    assert next(optimized.parameters()).is_cuda
    ids = torch.tensor([prompts()[1]], device="cuda")
    out = "last_hidden_state" if arch.encoder else "logits"
    torch.testing.assert_close(
        getattr(optimized(input_ids=ids), out).float(), getattr(reference(input_ids=ids), out).float(),
        **MODEL_LOGITS_TOL[dtype],
    )
    if not arch.encoder:
        mask = torch.ones_like(ids)
        assert torch.equal(_greedy(optimized, ids, mask), _greedy(reference, ids, mask))
