"""oneDNN-prepacked CPU linears (hf_dsinfer/modules/cpu_packed.py).

The packed copy is a cache beside the plain weight: its products must equal ``F.linear``, it must be rebuilt when the
weight changes (in place, rebound, or written through ``.data`` and invalidated, as the Hybrid Engine does), it must
not show in ``state_dict``/save, and it must step aside (switch off, no oneDNN, autograd, other row counts) quietly.
The tiny models' weights are below ``MIN_ELEMENTS``, so tests that want packing lower it.
"""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import PAD, build_tiny, left_pad, prompts, randomize_lora, save_tiny

from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.modules import Linear, cpu_packed

pytestmark = pytest.mark.usefixtures("one_thread")
needs_onednn = pytest.mark.skipif(not cpu_packed.available(), reason="oneDNN packed linear unavailable here")
INJECT = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 40, "max_batch_size": 4}
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32: oneDNN and MKL sum in different orders


@pytest.fixture
def pack_all(monkeypatch):
    """Pack every weight of a tiny model (their sizes are below the production threshold)."""
    monkeypatch.setenv(cpu_packed.ENV_VAR, "1")
    monkeypatch.setattr(cpu_packed, "MIN_ELEMENTS", 0)


def _packs() -> int:
    return cpu_packed._stats["packs"]


def _k_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()  # what gemm_layout gives on CPU


def _linear(out_f: int, in_f: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(_k_major(torch.randn(out_f, in_f, generator=g) * 0.1), requires_grad=False)
    b = torch.nn.Parameter(torch.randn(out_f, generator=g), requires_grad=False) if bias else None
    return Linear(w, b)


@needs_onednn
@pytest.mark.parametrize("out_f,in_f", [(40, 24), (136, 96), (97, 131)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear_on_awkward_shapes(out_f, in_f, bias, pack_all):
    lin = _linear(out_f, in_f, bias)
    g = torch.Generator().manual_seed(1)
    for rows in (4, 5, 13, cpu_packed.MAX_ROWS):
        for x in (
            torch.randn(rows, in_f, generator=g),  # [B, C]: the LM head's input
            torch.randn(rows, 1, in_f, generator=g),  # [B, 1, C]: a decode step's
            torch.randn(rows, 1, in_f + 7, generator=g)[..., 3 : 3 + in_f],  # a non-contiguous slice
        ):
            before = _packs()
            with torch.no_grad():
                got = lin(x)
            assert cpu_packed.applies(x, lin.weight, lin), f"{rows} rows did not take the packed path"
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), **TOL)
            assert got.shape == (*x.shape[:-1], out_f)
            assert _packs() - before <= 1  # packed once per weight, not per call
    held = sum(int(torch.ops.mkldnn._nbytes(c)) for c in cpu_packed._packs[cpu_packed.ensure_slot(lin)].chunks)
    assert cpu_packed.packed_bytes(lin) == held >= out_f * in_f * 4  # oneDNN's own count: it pads awkward shapes


@needs_onednn
def test_other_row_counts_prefill_and_autograd_keep_f_linear(pack_all):
    lin = _linear(40, 24, bias=True)
    for x in (
        torch.randn(1, 24),
        torch.randn(3, 1, 24),
        torch.randn(cpu_packed.MAX_ROWS + 1, 24),
        torch.randn(2, 5, 24),
    ):
        assert not cpu_packed.applies(x, lin.weight, lin), tuple(x.shape)  # batch < 4, > MAX_ROWS, a prefill
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert cpu_packed.packed_bytes(lin) == 0
    w = torch.nn.Parameter(torch.randn(40, 24))  # trainable: the oneDNN op has no backward here
    trainable = Linear(w)
    x = torch.randn(8, 24)
    assert not cpu_packed.applies(x, w, trainable)
    trainable(x).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(40, 24))

@needs_onednn
def test_ragged_rows_count_the_tokens_of_one_row(pack_all):
    """The serving engine's ragged step ``[1, T, C]``: inside ``ragged_rows()`` its T tokens pack as T rows (4..MAX),
    the product still equals F.linear; outside it (and on other threads) the same shape is a prefill."""
    lin = _linear(40, 24, bias=True)
    x = torch.randn(1, 6, 24)  # one row of 6 tokens (6 decoding requests)
    assert not cpu_packed.applies(x, lin.weight, lin)
    with cpu_packed.ragged_rows():
        assert cpu_packed.applies(x, lin.weight, lin)
        assert not cpu_packed.applies(torch.randn(1, 3, 24), lin.weight, lin)  # under MIN_ROWS
        assert not cpu_packed.applies(torch.randn(1, cpu_packed.MAX_ROWS + 1, 24), lin.weight, lin)
        seen = []
        other = threading.Thread(target=lambda: seen.append(cpu_packed.applies(x, lin.weight, lin)))
        other.start()
        other.join()
        assert seen == [False]  # the switch is this thread's
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert cpu_packed.packed_bytes(lin) > 0
    assert not cpu_packed.applies(x, lin.weight, lin)  # off again on exit



@needs_onednn
def test_weight_changes_repack(pack_all):
    lin = _linear(136, 96, bias=False)
    x = torch.randn(6, 1, 96)
    first = lin(x)
    g = torch.Generator().manual_seed(5)

    with torch.no_grad():  # in place (load_state_dict, an optimizer): the version counter moves
        lin.weight.copy_(torch.randn(136, 96, generator=g))
    got = lin(x)
    assert not torch.allclose(got, first)
    torch.testing.assert_close(got, F.linear(x, lin.weight), **TOL)

    # through .data (the Hybrid Engine's refresh, CUDA-graph-safe updates): invisible to the version counter, so the
    # writer invalidates
    lin.weight.data.copy_(torch.randn(136, 96, generator=g))
    assert cpu_packed.invalidate(lin) == 1
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)

    lin.weight.data = _k_major(torch.randn(136, 96, generator=g))  # rebound: another storage
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), **TOL)

    clone = copy.deepcopy(lin)  # a copy gets its own slot, so the two never evict each other's pack
    assert cpu_packed.ensure_slot(clone) != cpu_packed.ensure_slot(lin)
    with torch.no_grad():
        clone.weight.mul_(2)
    torch.testing.assert_close(clone(x), 2 * lin(x), **TOL)


@needs_onednn
def test_state_dict_save_and_reload_unchanged(tmp_path, pack_all):
    path = save_tiny("llama", tmp_path / "m", num_hidden_layers=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=INJECT).eval()
    ids, mask = left_pad(prompts((5, 9, 3, 7)))  # batch 4: the decode steps run packed
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    before = {k: v.clone() for k, v in opt.state_dict().items()}
    got = opt.generate(**kw)
    assert cpu_packed.packed_bytes(opt) > 0, "the batch-4 decode steps did not pack"
    assert torch.equal(got, ref.generate(**kw))
    after = opt.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    opt.save_pretrained(tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", inference_config=INJECT).eval()
    assert torch.equal(back.generate(**kw), got)


@pytest.mark.parametrize("how", ["switch", "non_x86", "op_missing"])
def test_fallback_is_quiet_and_exact(how, monkeypatch, caplog):
    monkeypatch.setattr(cpu_packed, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_packed, "_available", None)  # probe again under the patches below
    if how == "switch":
        monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    elif how == "non_x86":
        monkeypatch.setattr(cpu_packed.platform, "machine", lambda: "aarch64")
    else:

        def missing(*args, **kwargs):
            raise RuntimeError("mkldnn::_reorder_linear_weight: no kernel for this build")

        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", missing)
    lin = _linear(136, 96, bias=True)
    x = torch.randn(8, 1, 96)
    before = _packs()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for _ in range(3):
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert not cpu_packed.applies(x, lin.weight, lin) and _packs() == before
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    monkeypatch.undo()
    cpu_packed._available = cpu_packed._bf16_available = None  # the real probes again for later tests
    assert cpu_packed.sync() == cpu_packed.available()


@needs_onednn
@pytest.mark.parametrize("share_base", [False, "auto"])
def test_hybrid_engine_refresh_repacks(pack_all, share_base):
    """A refresh that rewrites the fused weights re-packs them (a copied base: LoRA fused into it); with the frozen
    base shared, the packed base stays as it is and the adapters' update reaches the tokens through the side path."""
    from peft import LoraConfig, get_peft_model

    from hf_dsinfer.hybrid import HybridEngine

    model = get_peft_model(build_tiny("llama", seed=0), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    randomize_lora(model, seed=3)
    ids, mask = left_pad(prompts((5, 9, 3, 7)))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)

    def reference() -> torch.Tensor:
        return copy.deepcopy(model).merge_and_unload().eval().generate(**kw)

    he = HybridEngine(model, inference_config={"max_out_tokens": 40}, share_base=share_base)
    he.eval()
    first = he.generate(**kw)
    assert cpu_packed.packed_bytes(he.module) > 0, "the batch-4 decode steps did not pack"
    assert torch.equal(first, reference())
    he.train()
    with torch.no_grad():  # a training update of the adapters: the refresh writes new fused weights through .data
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    packs = _packs()
    he.eval()
    second = he.generate(**kw)
    he.train()
    if share_base is False:
        assert _packs() > packs, "the refreshed weights were not re-packed"
    else:
        assert _packs() == packs, "the shared base did not change: nothing to re-pack"
    assert not torch.equal(second, first), "the update did not change the tokens (the test would prove nothing)"
    assert torch.equal(second, reference())


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_packs_equal_f_linear_and_repack_in_place(pack_all, monkeypatch, bias):
    """A weight above CHUNK_BYTES is packed as row chunks (in multiples of 64 rows, the last one short) whose products
    are concatenated; re-packing after a change (in place, as the Hybrid Engine's switch does) keeps them exact."""
    monkeypatch.setattr(cpu_packed, "CHUNK_BYTES", 64 * 24 * 4)  # 64 rows of 24 inputs: 211 rows -> 4 chunks
    lin = _linear(211, 24, bias)
    x = torch.randn(5, 1, 24)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), **TOL)
        pack = cpu_packed._packs[cpu_packed.ensure_slot(lin)]
        assert pack.bounds == [(0, 64), (64, 128), (128, 192), (192, 211)] and len(pack.chunks) == 4
        held = sum(int(torch.ops.mkldnn._nbytes(c)) for c in pack.chunks)
        assert cpu_packed.packed_bytes(lin) == held >= 211 * 24 * 4
        lin.weight.data.copy_(torch.randn(211, 24))  # through .data: invisible to the version counter
        before = _packs()
        assert cpu_packed.repack(lin, only_packed=True) and _packs() == before + 1
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), **TOL)
    other = _linear(40, 24, bias)  # never packed: only_packed leaves it alone
    assert not cpu_packed.repack(other, only_packed=True) and cpu_packed.packed_bytes(other) == 0


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_module_forward_on_a_row_major_head(pack_all, rows):
    """A plain nn.Linear head over a row-major weight (the Hybrid Engine's copy, hybrid.build.row_major_head): the row
    GEMV at 1-3 rows, the packed GEMM from 4; F.linear's values either way. A K-major head keeps F.linear at 1-3."""
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(24, 200, bias=False).requires_grad_(False)
    head.weight.data = torch.randn(200, 24, generator=g)  # row-major
    x = torch.randn(rows, 24, generator=g)
    torch.testing.assert_close(cpu_packed.module_forward(head, x), F.linear(x, head.weight), **TOL)
    head.weight.data = _k_major(head.weight.data)
    torch.testing.assert_close(cpu_packed.module_forward(head, x), F.linear(x, head.weight), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_module_forward_folds_a_strided_last_token_slice(dtype, bias, monkeypatch):
    """A prefill's last-token slice ``[B, 1, C]`` of ``[B, T, C]`` (strided) reaches the head as one 2-d GEMM: F.linear
    over the 3-d slice would copy the weight once per row into a batched product (bf16 SmolLM2: 2.7 s for 32 rows).
    Packing off (the bf16 path on CPUs without AMX): values equal F.linear over the folded rows, no batched product."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    monkeypatch.setenv(cpu_packed.ENV_VAR, "0")
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(24, 300, bias=bias).to(dtype).requires_grad_(False)
    hidden = torch.randn(6, 9, 24, generator=g).to(dtype)  # [B, T, C]
    x = hidden[:, -1:, :]  # [B, 1, C], strided
    with Ops() as ops:
        y = cpu_packed.module_forward(head, x)
    assert y.shape == (6, 1, 300)
    assert not [op for op in ops.seen if "bmm" in op or op.startswith("expand")], ops.seen  # no per-row weight copy
    assert torch.equal(y, F.linear(hidden[:, -1, :], head.weight, head.bias).view(6, 1, 300))
