"""moe_gemm: Triton grouped GEMM (interpreter on CPU) vs the torch reference vs a per-row loop; sort and block map."""

import pytest
import torch
from hf_dsinfer.kernels.moe_gemm import (
    moe_block_map,
    moe_gemm,
    moe_gemm_torch,
    moe_gemm_triton,
    moe_num_blocks,
    moe_sort,
)
from tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens N, top-k, experts E, out features, in features K): odd sizes, one token, more experts than pairs,
# an expert holding more rows than one M block, K and N not multiples of the tiles.
SHAPES = [(1, 2, 8, 40, 24), (5, 2, 4, 72, 33), (19, 3, 5, 17, 48), (3, 1, 6, 64, 16)]


def _routing(n, k, e, seed, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # [N, k] distinct experts per token
    if n > 4:
        ids[: n // 2, 0] = 1  # crowd one expert past a block (a token may then pick it twice: still a valid GEMM)
    if k == 1:
        ids[ids == e - 1] = 0  # leave the last expert empty
    return ids.to(device)


def _per_row(a, weight, ids):
    """Slowest obvious answer: each pair on its own, in the sorted order of moe_sort."""
    k = ids.shape[1]
    order, _ = moe_sort(ids, weight.shape[0])
    flat = ids.reshape(-1)
    return torch.stack([a[int(p) // k].float() @ weight[int(flat[p])].float().t() for p in order])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_moe_gemm_triton_matches_reference(device, dtype, shape):
    n, k, e, out_f, in_f = shape
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, in_f, generator=g).to(dtype).to(device)
    weight = (torch.randn(e, out_f, in_f, generator=g) / in_f**0.5).to(dtype).to(device)
    ids = _routing(n, k, e, seed=2, device=device)
    order, counts = moe_sort(ids, e)
    rows = order // k
    got = moe_gemm_triton(a, weight, counts, rows)
    want = moe_gemm_torch(a, weight, counts, rows)
    assert got.shape == (n * k, out_f) and got.dtype == dtype
    assert_close(got, want)
    assert_close(want.float(), _per_row(a, weight, ids), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_gemm_without_gather_and_k_major_weights(device, dtype):
    # The second GEMM of an MoE layer reads rows already in sorted order; CPU keeps weights K-major.
    g = torch.Generator().manual_seed(3)
    e, out_f, in_f = 3, 24, 40
    counts = torch.tensor([4, 0, 19], dtype=torch.int32, device=device)
    a = torch.randn(23, in_f, generator=g).to(dtype).to(device)
    weight = torch.randn(e, in_f, out_f, generator=g).to(dtype).to(device).transpose(1, 2)  # [E, N, K], K-major
    got = moe_gemm_triton(a, weight, counts)
    want = moe_gemm_torch(a, weight.contiguous(), counts)
    assert_close(got, want)


def test_sort_and_block_map():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, counts = moe_sort(ids, 4)
    assert counts.tolist() == [2, 1, 3, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert (order // 2).tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order kept within an expert
    nb = moe_num_blocks(6, 4, 2)
    expert, row = moe_block_map(counts, nb, 2)
    # expert 0: rows 0-1 (one block), expert 1: row 2 (one), expert 2: rows 3-5 (two blocks), then padding blocks
    assert expert.tolist()[:4] == [0, 1, 2, 2] and set(expert.tolist()[4:]) <= {4}
    assert row.tolist()[:4] == [0, 2, 3, 5]


def test_dispatch_and_bad_arguments(monkeypatch):
    a = torch.randn(4, 8)
    weight = torch.randn(2, 6, 8)
    counts = torch.tensor([1, 3], dtype=torch.int32)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    assert_close(moe_gemm(a, weight, counts), moe_gemm_torch(a, weight, counts))
    with pytest.raises(ValueError, match="weight must be"):
        moe_gemm_torch(a, torch.randn(2, 6, 7), counts)
    with pytest.raises(ValueError, match="counts must have one entry per expert"):
        moe_gemm_torch(a, weight, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="weight must have dtype"):
        moe_gemm_triton(a, weight.half(), counts)
