"""paged_attention / store_paged_kv: Triton launchers (interpreter on CPU) and the torch path against the slot-by-slot
oracle, and the torch path against the compact-cache prefill attention (itself checked against HF eager)."""

import pytest
import torch
from hf_dsinfer.kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_torch,
    store_paged_kv,
    store_paged_kv_torch,
)
from hf_dsinfer.kernels.paged_attention_triton import paged_attention_triton, store_paged_kv_triton
from hf_dsinfer.kernels.prefill_attention import prefill_attention_torch
from tolerances import ATTENTION_TOL, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (H, KVH, D, block size, [(new tokens, keys) per sequence], window, softcap)
CASES = [
    (4, 4, 80, 16, [(1, 1), (20, 20), (1, 33)], None, None),  # GQA 1, D=80, a one-key sequence, partial blocks
    (6, 2, 96, 32, [(5, 40), (1, 70), (17, 17)], None, 30.0),  # GQA 3, D=96, a chunk after a cached prefix
    (8, 2, 64, 16, [(1, 50), (12, 29), (1, 16)], 8, None),  # GQA 4, sliding window, an exactly full block
    (4, 1, 32, 16, [(3, 35), (1, 9), (18, 18)], 5, 20.0),  # MQA, window + softcap, a chunk spanning two tiles
]


def _case_id(c):
    return f"H{c[0]}-KVH{c[1]}-D{c[2]}-BS{c[3]}-S{len(c[4])}-W{c[5]}-cap{c[6]}"


def make_batch(H, KVH, D, BS, seqs, dtype, device, seed=0, store=store_paged_kv_torch):
    """A ragged batch over a shuffled block pool: returns (q, k_cache, v_cache, block_tables, cu, lens, dense_kv).

    Each sequence's keys are written through ``store`` at the slots its block table gives; the table is one block
    wider than needed and padded with -1; spare blocks hold garbage that must never be read.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-L // BS) for _, L in seqs]
    NB = sum(blocks_per_seq) + 3
    k_cache = torch.randn(NB, BS, KVH, D, generator=g).to(dtype).to(device) * 100  # garbage: huge if ever read
    v_cache = torch.randn(NB, BS, KVH, D, generator=g).to(dtype).to(device) * 100
    order = torch.randperm(NB, generator=g).tolist()
    MB = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seqs), MB), -1, dtype=torch.int32)
    dense = []
    for s, ((_, L), nb) in enumerate(zip(seqs, blocks_per_seq)):
        blocks = [order.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(L, KVH, D, generator=g).to(dtype).to(device)
        v = torch.randn(L, KVH, D, generator=g).to(dtype).to(device)
        slots = torch.tensor([blocks[j // BS] * BS + j % BS for j in range(L)], dtype=torch.int64, device=device)
        store(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    n_q = [n for n, _ in seqs]
    cu = torch.tensor([0] + n_q, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    lens = torch.tensor([L for _, L in seqs], dtype=torch.int32, device=device)
    q = torch.randn(sum(n_q), H, D, generator=g).to(dtype).to(device)
    return q, k_cache, v_cache, block_tables.to(device), cu, lens, dense


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_mixed_batch_matches_reference(case, dtype, device):
    """Prefill chunks and decode tokens in one call: the varlen kernel and the torch path equal the oracle."""
    H, KVH, D, BS, seqs, window, cap = case
    q, kc, vc, bt, cu, lens, _ = make_batch(H, KVH, D, BS, seqs, dtype, device)
    scale = D**-0.5
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, scale, cap, window)
    out = paged_attention_triton(q, kc, vc, bt, cu, lens, scale, cap, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, ATTENTION_TOL)
    assert_close(paged_attention_torch(q, kc, vc, bt, cu, lens, scale, cap, window), ref, ATTENTION_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_decode_matches_reference(case, dtype, device):
    """One new token per sequence (T == S) takes the split-KV decode kernel; split counts only regroup sums."""
    H, KVH, D, BS, seqs, window, cap = case
    seqs = [(1, L) for _, L in seqs]
    q, kc, vc, bt, cu, lens, _ = make_batch(H, KVH, D, BS, seqs, dtype, device, seed=1)
    scale = D**-0.5
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, scale, cap, window)
    for splits in (1, 3):
        assert_close(paged_attention_triton(q, kc, vc, bt, cu, lens, scale, cap, window, splits), ref, ATTENTION_TOL)
    assert_close(paged_attention_torch(q, kc, vc, bt, cu, lens, scale, cap, window), ref, ATTENTION_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_torch_matches_compact_prefill(case, dtype, device):
    """Each sequence's rows equal prefill_attention over a compact cache of its keys (tested against HF eager)."""
    H, KVH, D, BS, seqs, window, cap = case
    q, kc, vc, bt, cu, lens, dense = make_batch(H, KVH, D, BS, seqs, dtype, device, seed=2)
    out = paged_attention_torch(q, kc, vc, bt, cu, lens, 0.2, cap, window)
    for s, ((n, L), (k, v)) in enumerate(zip(seqs, dense)):
        k_compact, v_compact = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, KVH, L, D]
        a = int(cu[s])
        past = torch.tensor([L - n], dtype=torch.int32, device=device)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        expect = prefill_attention_torch(q[None, a : a + n], k_compact, v_compact, past, zero, 0.2, window, cap)[0]
        assert_close(out[a : a + n], expect, ATTENTION_TOL, msg=f"sequence {s}")


def test_varlen_group_wider_than_the_tile(device):
    """32 query heads on one KV head: the tile grows to hold one token's whole group (one token per tile)."""
    q, kc, vc, bt, cu, lens, _ = make_batch(32, 1, 16, 16, [(3, 20), (1, 7), (2, 2)], torch.float32, device, seed=4)
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, 0.25, 10.0, 6)
    assert_close(paged_attention_triton(q, kc, vc, bt, cu, lens, 0.25, 10.0, 6), ref, ATTENTION_TOL)


def test_chunked_prefill_equals_whole_prompt(device):
    """A prompt attended in three chunks (each after storing its keys) equals the prompt in one call."""
    H, KVH, D, BS, L = 6, 2, 32, 16, 37
    q, kc, vc, bt, _, lens, _ = make_batch(H, KVH, D, BS, [(L, L)], torch.float32, device, seed=3)
    whole = paged_attention_triton(q, kc, vc, bt, torch.tensor([0, L], dtype=torch.int32, device=device), lens, 0.3)
    parts = []
    for a, b in ((0, 16), (16, 17), (17, L)):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device=device)
        seen = torch.tensor([b], dtype=torch.int32, device=device)
        parts.append(paged_attention_triton(q[a:b].contiguous(), kc, vc, bt, cu, seen, 0.3))
    assert_close(torch.cat(parts), whole, ATTENTION_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_paged_kv_triton_matches_torch(dtype, device):
    """Strided k/v views of a fused qkv, negative slots skipped, slots in any order across blocks."""
    T, H, KVH, D, NB, BS = 7, 4, 2, 80, 5, 16
    qkv = torch.randn(T, H + 2 * KVH, D, device=device).to(dtype)
    k, v = qkv[:, H : H + KVH], qkv[:, H + KVH :]
    assert not k.is_contiguous()
    slots = torch.tensor([3, 79, -1, 16, 40, -5, 0], dtype=torch.int64, device=device)
    caches = [torch.zeros(NB, BS, KVH, D, dtype=dtype, device=device) for _ in range(4)]
    store_paged_kv_triton(k, v, caches[0], caches[1], slots)
    store_paged_kv_torch(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][4, 15], k[1]) and torch.equal(caches[1][2, 8], v[4])
    assert int((caches[0].abs().sum(dim=(-1, -2)) != 0).sum()) == 5  # the two negative slots wrote nothing


def test_store_paged_kv_torch_all_slots_kept():
    """No negative slot (the engine's steps take the index_copy_ path): strided k/v land in their slots only."""
    T, H, KVH, D, NB, BS = 9, 4, 2, 8, 4, 4
    qkv = torch.randn(T, H + 2 * KVH, D)
    k, v = qkv[:, H : H + KVH], qkv[:, H + KVH :]
    slots = torch.tensor([15, 0, 7, 4, 12, 1, 9, 3, 10])
    kc, vc = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
    store_paged_kv_torch(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros(NB * BS, KVH, D), torch.zeros(NB * BS, KVH, D)
    for t, slot in enumerate(slots.tolist()):
        want_k[slot], want_v[slot] = k[t], v[t]
    assert torch.equal(kc.view(NB * BS, KVH, D), want_k) and torch.equal(vc.view(NB * BS, KVH, D), want_v)


def test_store_paged_kv_torch_rejects_out_of_range_slot(device):
    k = torch.zeros(2, 1, 16, device=device)
    kc = torch.zeros(2, 4, 1, 16, device=device)
    with pytest.raises(ValueError, match="slot_mapping holds slot 8 but the cache has 2 blocks of 4 slots"):
        store_paged_kv_torch(k, k, kc, kc.clone(), torch.tensor([1, 8], device=device))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_dispatch(backend, device, monkeypatch):
    monkeypatch.setenv("HF_DSINFER_BACKEND", backend)
    H, KVH, D, BS, seqs, window, cap = CASES[2]
    q, kc, vc, bt, cu, lens, dense = make_batch(H, KVH, D, BS, seqs, torch.float32, device, store=store_paged_kv)
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, 0.1, cap, window)
    assert_close(paged_attention(q, kc, vc, bt, cu, lens, 0.1, cap, window), ref, ATTENTION_TOL)


@pytest.mark.parametrize("fn", [paged_attention_triton, paged_attention_torch])
def test_paged_rejects_bad_arguments(fn, device):
    q, kc, vc, bt, cu, lens, _ = make_batch(6, 2, 32, 16, [(2, 5), (1, 3)], torch.float16, device)
    with pytest.raises(ValueError, match="q has 6 heads, not a multiple of the 4 kv heads"):
        fn(q, kc.repeat(1, 1, 2, 1), vc.repeat(1, 1, 2, 1), bt, cu, lens, 0.1)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        fn(q[None], kc, vc, bt, cu, lens, 0.1)
    with pytest.raises(ValueError, match="v_cache has dtype"):
        fn(q, kc, vc.float(), bt, cu, lens, 0.1)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have shape \[3\]"):
        fn(q, kc, vc, bt, cu[:2], lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens_k must have dtype"):
        fn(q, kc, vc, bt, cu, lens.float(), 0.1)
    with pytest.raises(ValueError, match="block_tables must have 2 dims"):
        fn(q, kc, vc, bt[0], cu, lens, 0.1)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        fn(q, kc, vc, bt, cu, lens, 0.1, sliding_window=0)


def test_paged_torch_rejects_inconsistent_lengths(device):
    q, kc, vc, bt, cu, lens, _ = make_batch(2, 1, 16, 16, [(2, 5), (1, 3)], torch.float32, device)
    with pytest.raises(ValueError, match="sequence 0 has 2 new tokens but seq_lens_k\\[0\\]=1"):
        paged_attention_torch(q, kc, vc, bt, cu, torch.tensor([1, 3], dtype=torch.int32, device=device), 0.1)
    with pytest.raises(ValueError, match="needs more than the 2 blocks of 16 slots"):
        paged_attention_torch(q, kc, vc, bt, cu, torch.tensor([40, 3], dtype=torch.int32, device=device), 0.1)
    with pytest.raises(ValueError, match="sequence 1 has 0 new tokens in cu_seqlens_q"):
        paged_attention_torch(q[:2], kc, vc, bt, torch.tensor([0, 2, 2], dtype=torch.int32, device=device), lens, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and end at q.shape\\[0\\]=3"):
        paged_attention_torch(q, kc, vc, bt, cu + 1, lens, 0.1)


@pytest.mark.cuda
def test_paged_decode_cuda_graph_replay():
    """No host sync in the launcher: it captures into a CUDA graph and replays with new lengths in place."""
    dev = torch.device("cuda")
    q, kc, vc, bt, cu, lens, _ = make_batch(32, 8, 128, 16, [(1, 100), (1, 700)], torch.float16, dev)
    paged_attention(q, kc, vc, bt, cu, lens, 0.088)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kc, vc, bt, cu, lens, 0.088)
    lens.copy_(torch.tensor([700, 17], device=dev))
    graph.replay()
    assert_close(out, paged_attention_reference(q, kc, vc, bt, cu, lens, 0.088), ATTENTION_TOL)


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # gemma2: sliding window 8 and softcap 50 in the kernels
def test_serving_engine_on_triton_kernels_equals_hf_alone(name, tmp_path, monkeypatch):
    """Continuous batching with every kernel on Triton (the interpreter on CPU): chunked prefill, a request joining
    mid-prefill, then decode steps; greedy tokens equal HF eager ``generate`` of each request alone (fp32)."""
    import transformers
    from hf_dsinfer.kernels import paged_attention_triton as launchers
    from tiny_models import PAD, prompts, save_tiny

    from hf_dsinfer.serving import ServingEngine

    path = save_tiny(name, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 64}
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=config).eval()
    greedy = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=-1)
    calls = {"decode": 0, "varlen": 0}
    launch = launchers.paged_attention_triton

    def counting(q, k_cache, v_cache, block_tables, *args, **kwargs):
        calls["decode" if q.shape[0] == block_tables.shape[0] else "varlen"] += 1
        return launch(q, k_cache, v_cache, block_tables, *args, **kwargs)

    monkeypatch.setattr(launchers, "paged_attention_triton", counting)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")
    batch = prompts((5, 21, 3))
    engine = ServingEngine(opt, block_size=4, max_batch_tokens=8, num_blocks=64)  # the 21-token prompt: 3 chunks
    handles = [engine.submit(p, greedy) for p in batch[:2]]
    engine.step()
    handles.append(engine.submit(batch[2], greedy))
    engine.run_until_idle()
    monkeypatch.setenv("HF_DSINFER_BACKEND", "torch")
    for prompt, handle in zip(batch, handles):
        ids = torch.tensor([prompt])
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)[0, len(prompt) :]
        assert handle.tokens == want.tolist(), f"{name}: request {handle.request_id}"
    assert calls["decode"] > 0 and calls["varlen"] > 0, calls


def test_decode_groups_cover_each_sequence_once_shortest_first():
    from hf_dsinfer.kernels.paged_attention import DECODE_GROUP_BYTES, _decode_groups

    lens = [300, 5, 40, 17, 1, 160, 33]
    decode = [0, 1, 2, 4, 5, 6]  # sequence 3 is a prefill chunk
    key_bytes = DECODE_GROUP_BYTES // 200  # room for 200 padded keys per group
    groups = _decode_groups(decode, lens, 16, key_bytes)
    flat = [s for g in groups for s in g]
    assert flat == sorted(decode, key=lens.__getitem__), "each once, shortest first"
    for g in groups:  # a group fits the budget, padded to its longest (last) sequence, or holds one sequence
        assert len(g) == 1 or len(g) * -(-lens[g[-1]] // 16) * 16 * key_bytes <= DECODE_GROUP_BYTES
    assert [len(g) for g in groups] == [4, 1, 1]
    assert len(_decode_groups(decode, lens, 16, 1)) == 1, "all fit: one group"


@pytest.mark.parametrize("budget", [1, 3000, 1 << 40])
def test_paged_torch_decode_groups_match_reference(budget, monkeypatch):
    """However the one-token sequences are grouped (one each, a few, all in one), the torch path equals the oracle."""
    import hf_dsinfer.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "DECODE_GROUP_BYTES", budget)
    seqs = [(1, 70), (1, 3), (9, 40), (1, 33), (1, 16), (1, 120), (1, 1)]
    q, kc, vc, bt, cu, lens, _ = make_batch(4, 2, 32, 16, seqs, torch.float32, "cpu")
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, 32**-0.5)
    assert_close(paged_attention_torch(q, kc, vc, bt, cu, lens, 32**-0.5), ref, ATTENTION_TOL)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_torch_plans_shared_by_a_steps_layers(case, monkeypatch):
    """One ``plans`` dict across a step's layers: the lengths are read once (one plan), and every layer's result
    equals a call without it (two layers: two caches of the same shape, one more of another head size)."""
    from hf_dsinfer.kernels import paged_attention as pa

    H, KVH, D, BS, seqs, window, cap = case
    layers = [make_batch(H, KVH, D, BS, seqs, torch.float32, "cpu", seed=seed) for seed in (0, 1)]
    _, _, _, bt, cu, lens, _ = layers[0]
    built = []
    real_plan = pa._plan
    monkeypatch.setattr(pa, "_plan", lambda *a: built.append(a) or real_plan(*a))
    plans: dict = {}
    for q, kc, vc, *_ in layers:  # the second layer's own tables are equal to the first's: share the first's
        got = paged_attention_torch(q, kc, vc, bt, cu, lens, D**-0.5, cap, window, plans=plans)
        assert torch.equal(got, paged_attention_torch(q, kc, vc, bt, cu, lens, D**-0.5, cap, window))
    assert len(plans) == 1 and len(built) == 3  # one plan for the step, two for the calls without plans
    q2, kc2, vc2, *_ = make_batch(H, KVH, 2 * D, BS, seqs, torch.float32, "cpu")  # another key size: its own plan
    paged_attention_torch(q2, kc2, vc2, bt, cu, lens, D**-0.5, cap, window, plans=plans)
    assert len(plans) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_torch_alibi_matches_reference(case, dtype):
    """ALiBi (bloom) over the paged cache, torch path: ``slope[h] * j`` for the key at position j of its sequence,
    mixed prefill chunks and decode tokens, with the cases' windows and softcaps."""
    from hf_dsinfer.policies.bloom import alibi_slopes

    H, KVH, D, BS, seqs, window, cap = case
    q, kc, vc, bt, cu, lens, _ = make_batch(H, KVH, D, BS, seqs, dtype, "cpu")
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float32)
    ref = paged_attention_reference(q, kc, vc, bt, cu, lens, D**-0.5, cap, window, alibi_slopes=slopes)
    got = paged_attention_torch(q, kc, vc, bt, cu, lens, D**-0.5, cap, window, alibi_slopes=slopes)
    assert_close(got, ref, ATTENTION_TOL)
    without = paged_attention_reference(q, kc, vc, bt, cu, lens, D**-0.5, cap, window)
    assert not torch.allclose(without.float(), ref.float(), atol=1e-3)  # the bias matters at these lengths


def test_paged_alibi_is_refused_by_the_triton_path(monkeypatch):
    q, kc, vc, bt, cu, lens, _ = make_batch(4, 2, 16, 16, [(3, 3), (1, 9)], torch.float32, "cpu")
    monkeypatch.setattr("hf_dsinfer.kernels.paged_attention._use_triton", lambda t: True)
    with pytest.raises(ValueError, match="alibi_slopes: the Triton paged attention kernels have no ALiBi"):
        paged_attention(q, kc, vc, bt, cu, lens, 0.25, alibi_slopes=torch.ones(4))
