"""lora_add (several adapters per batch): Triton launcher (interpreter on CPU) vs torch reference vs plain math."""

import pytest
import torch
from hf_dsinfer.kernels.lora import lora_add, lora_add_torch, lora_add_triton, slot_groups
from tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(n, k, o, loras, rank, dtype, device, seed=0, slots=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g).to(dtype).to(device)
    y = torch.randn(n, o, generator=g).to(dtype).to(device)
    a = (torch.randn(loras, rank, k, generator=g) / k**0.5).to(dtype).to(device)
    b = (torch.randn(loras, o, rank, generator=g) / rank**0.5).to(dtype).to(device)
    if slots is None:
        slots = torch.randint(-1, loras, (n,), generator=g)  # mixed adapters and base tokens
    return y, x, a, b, torch.as_tensor(slots, dtype=torch.int32).to(device)


def _by_hand(y, x, a, b, slots):
    """Token by token in fp64: the math the kernel promises."""
    out = y.double().clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            out[i] += (x[i].double() @ a[s].double().t()) @ b[s].double().t()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n, k, o, loras, rank",
    [(1, 48, 40, 1, 1), (7, 72, 96, 3, 8), (19, 200, 130, 4, 16), (5, 96, 33, 2, 64), (3, 40, 300, 2, 100)],
)
def test_lora_add_triton_matches_reference(device, dtype, n, k, o, loras, rank):
    """Awkward ranks (1, 8, 16, 64, 100 > one rank block), token counts and widths that are not block multiples,
    mixed adapters with base tokens (-1)."""
    y, x, a, b, slots = _case(n, k, o, loras, rank, dtype, device)
    want = lora_add_torch(y.clone(), x, a, b, slots)
    got = lora_add_triton(y.clone(), x, a, b, slots)
    assert got.dtype == dtype and got.shape == (n, o)
    assert_close(got, want)
    if dtype == torch.float32:
        torch.testing.assert_close(want.double(), _by_hand(y, x, a, b, slots), rtol=1e-5, atol=1e-5)
    base = slots.cpu() < 0
    assert torch.equal(got.cpu()[base], y.cpu()[base])  # base tokens untouched, bit for bit


def test_lora_add_strided_rows_and_int64_slots(device):
    """x and y as row-strided views of wider buffers (the fused layers' slices), int64 slots, all one adapter."""
    _, _, a, b, _ = _case(6, 64, 48, 2, 8, torch.float32, device)
    g = torch.Generator().manual_seed(3)
    xb = torch.randn(6, 100, generator=g).to(device)
    yb = torch.randn(6, 80, generator=g).to(device)
    x, slots = xb[:, 10:74], torch.full((6,), 1, dtype=torch.int64, device=device)
    want = lora_add_torch(yb[:, :48].clone(), x.contiguous(), a, b, slots)
    y = yb.clone()
    lora_add_triton(y[:, :48], x, a, b, slots)
    assert_close(y[:, :48], want)
    assert torch.equal(y[:, 48:], yb[:, 48:])  # columns past O untouched


def test_lora_add_all_base_is_identity(device):
    y, x, a, b, slots = _case(4, 32, 24, 2, 8, torch.float32, device, slots=[-1, -1, -1, -1])
    assert torch.equal(lora_add_triton(y.clone(), x, a, b, slots), y)
    assert torch.equal(lora_add_torch(y.clone(), x, a, b, slots), y)


def test_lora_add_checks_name_the_argument():
    y, x, a, b, slots = _case(4, 32, 24, 2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="lora_b"):
        lora_add(y, x, a, b[:, :, :4].contiguous(), slots)
    with pytest.raises(ValueError, match="slots"):
        lora_add(y, x, a, b, slots.float())
    with pytest.raises(ValueError, match="lora_a"):
        lora_add(y, x, a.half(), b, slots)


def test_lora_add_dispatch(monkeypatch):
    y, x, a, b, slots = _case(5, 40, 24, 3, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    want = lora_add(y.clone(), x, a, b, slots)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    assert_close(lora_add(y.clone(), x, a, b, slots), want)


def test_lora_add_torch_with_precomputed_groups():
    """The groups a step builds once (slot_groups) give the same result as grouping inside the call."""
    y, x, a, b, slots = _case(9, 40, 24, 3, 4, torch.float32, torch.device("cpu"), slots=[2, -1, 0, 2, 2, -1, 1, 0, 2])
    groups = slot_groups(slots.tolist(), x.device)
    assert [s for s, _ in groups] == [0, 1, 2] and groups[2][1].tolist() == [0, 3, 4, 8]
    assert torch.equal(lora_add_torch(y.clone(), x, a, b, slots, groups), lora_add_torch(y.clone(), x, a, b, slots))


def test_lora_add_torch_part_and_rank_hints_skip_only_zeros():
    """A fused linear's layout (parts [5, 7], rank blocks of 4, slots using ranks 3 and 4, B block-diagonal): the
    torch path's parts / ranks hints give the same result as the full product."""
    y, x, a, b, slots = _case(6, 24, 12, 2, 8, torch.float32, torch.device("cpu"), slots=[0, 1, -1, 1, 0, 0])
    ranks = [3, 4]
    for s, r in enumerate(ranks):
        for p in range(2):
            a[s, p * 4 + r : (p + 1) * 4] = 0  # rows past the adapter's rank
        b[s, :5, 4:] = 0  # part 0's output rows see only block 0
        b[s, 5:, :4] = 0
    want = lora_add_torch(y.clone(), x, a, b, slots)
    got = lora_add_torch(y.clone(), x, a, b, slots, parts=[5, 7], ranks=ranks)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
