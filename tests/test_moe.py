"""The fused MoE block against transformers' sparse MoE blocks, its parallel splits, and MoE checkpoint layouts.

The fidelity table (tests/test_fidelity.py) runs whole mixtral / qwen2_moe / qwen3_moe models; here each block is
compared on its own (every routing rule and rounding rule, both backends), the expert-parallel and tensor-parallel
splits are checked to sum to the whole block, and models load from both expert layouts transformers handles.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import prompts, save_tiny, tiny_config
from tolerances import MODEL_LOGITS_TOL, assert_close

import hf_dsinfer  # noqa: F401  (registers inference_config)
from hf_dsinfer.modules import FusedDecoderLayer
from hf_dsinfer.modules.moe import FusedMoE, MoESpec
from hf_dsinfer.policies import is_injected

BLOCKS = {
    "mixtral": "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
}


def _hf_block(name: str, dtype: torch.dtype, implementation: str = "eager", **overrides):
    cfg = tiny_config(name, **overrides)
    cfg._experts_implementation = implementation
    module, cls = BLOCKS[name].rsplit(".", 1)
    torch.manual_seed(0)
    block = getattr(__import__(module, fromlist=[cls]), cls)(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)  # large enough that routing has clear winners
    return block.to(dtype).eval()


def _fused(block, name: str, **spec_overrides) -> FusedMoE:
    has_shared = hasattr(block, "shared_expert")
    params = {
        "mlp.router.weight": block.gate.weight,
        "mlp.experts.gate_up": block.experts.gate_up_proj,
        "mlp.experts.down": block.experts.down_proj,
    }
    if has_shared:
        se = block.shared_expert
        params["mlp.shared.up.weight"] = torch.nn.Parameter(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
        params["mlp.shared.down.weight"] = se.down_proj.weight
        params["mlp.shared_gate.weight"] = block.shared_expert_gate.weight
    spec = MoESpec(
        num_experts=block.gate.num_experts,
        top_k=block.gate.top_k,
        renormalize=True if name == "mixtral" else block.gate.norm_topk_prob,
        fp32_routing_weights=name == "mixtral",
        shared_expert=has_shared,
        shared_expert_gate=has_shared,
        **spec_overrides,
    )
    return FusedMoE.from_params(spec, {k: v.detach().clone() for k, v in params.items()})


@pytest.mark.parametrize("tokens", [1, 21])  # a decode step (each pair on its own) and a prefill (sorted, grouped)
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BLOCKS))
@torch.no_grad()
def test_block_matches_hf(name, dtype, implementation, tokens):
    block = _hf_block(name, dtype, implementation)
    fused = _fused(block, name)
    x = torch.randn(1, tokens, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = block(x)
    got = fused(x)
    assert got.shape == want.shape and got.dtype == dtype
    assert_close(got, want, dtype=dtype, msg=f"{name} {implementation}")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@torch.no_grad()
def test_block_triton_path_has_no_host_sync(name, monkeypatch):
    """The Triton path (interpreter here) equals the torch path and never reads a device value on the host, which is
    what lets a CUDA graph capture the decode step whatever the routing."""
    block = _hf_block(name, torch.float32)
    fused = _fused(block, name)
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(2))
    want = fused(x)
    monkeypatch.setenv("HF_DSINFER_BACKEND", "triton")

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in the MoE block's Triton path")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    got = fused(x)
    monkeypatch.undo()
    assert_close(got, want)


@torch.no_grad()
def test_expert_parallel_and_tensor_parallel_splits_sum_to_the_block():
    """Two ranks' partial sums (whole experts per rank; or half of every expert's features) add up to the block."""
    block = _hf_block("qwen2_moe", torch.float32)
    full = _fused(block, "qwen2_moe")
    x = torch.randn(4, 5, 96, generator=torch.Generator().manual_seed(3))
    want = full(x)
    gu, down = full.experts.gate_up.detach(), full.experts.down.detach()
    su, sd = full.shared.up.weight.detach(), full.shared.down.weight.detach()
    e, two_i, _ = gu.shape
    inter, shared_inter = two_i // 2, su.shape[0] // 2

    def rank_block(gate_up, dn, up, sdown, begin):
        params = {
            "mlp.router.weight": full.router.weight,
            "mlp.experts.gate_up": torch.nn.Parameter(gate_up.contiguous()),
            "mlp.experts.down": torch.nn.Parameter(dn.contiguous()),
            "mlp.shared.up.weight": torch.nn.Parameter(up.contiguous()),
            "mlp.shared.down.weight": torch.nn.Parameter(sdown.contiguous()),
            "mlp.shared_gate.weight": full.shared_gate.weight,
        }
        return FusedMoE.from_params(full.spec, params, expert_begin=begin)

    # expert parallelism: experts [0, 3) and [3, 6); the shared expert split by features so it counts once
    half = shared_inter // 2
    shared_parts = [
        (torch.cat([su[:half], su[shared_inter : shared_inter + half]]), sd[:, :half]),
        (torch.cat([su[half:shared_inter], su[shared_inter + half :]]), sd[:, half:]),
    ]
    ep = [rank_block(gu[r * 3 : r * 3 + 3], down[r * 3 : r * 3 + 3], *shared_parts[r], r * 3) for r in range(2)]
    assert_close(ep[0](x) + ep[1](x), want)
    # tensor parallelism: each rank holds half of every expert's intermediate features ([gate_r; up_r] rows)
    h = inter // 2
    tp = [
        rank_block(
            torch.cat([gu[:, r * h : (r + 1) * h], gu[:, inter + r * h : inter + (r + 1) * h]], dim=1),
            down[:, :, r * h : (r + 1) * h],
            *shared_parts[r],
            0,
        )
        for r in range(2)
    ]
    assert_close(tp[0](x) + tp[1](x), want)


def test_spec_and_params_are_checked():
    with pytest.raises(ValueError, match="top_k"):
        MoESpec(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="activation"):
        MoESpec(num_experts=4, top_k=2, activation="relu")
    with pytest.raises(ValueError, match="missing fused parameters"):
        FusedMoE.from_params(MoESpec(4, 2), {"mlp.router.weight": torch.nn.Parameter(torch.zeros(4, 8))})


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _to_fused_layout(path: str, name: str) -> None:
    """Rewrite a saved checkpoint's per-expert tensors as transformers 5.x's fused ``*Experts`` tensors."""
    file = f"{path}/model.safetensors"
    sd = load_file(file)
    out, experts = {}, {}
    for key, t in sd.items():
        if ".experts." not in key:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = t
            continue
        prefix, rest = key.replace(".block_sparse_moe.", ".mlp.").split(".experts.")
        idx, proj = rest.split(".", 1)
        experts.setdefault(prefix, {}).setdefault(proj, {})[int(idx)] = t
    names = {"mixtral": ("w1.weight", "w3.weight", "w2.weight")}.get(
        name, ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    )
    for prefix, projs in experts.items():
        gate, up, down = (torch.stack([projs[n][i] for i in sorted(projs[n])]) for n in names)
        out[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.experts.down_proj"] = down
    save_file(out, file, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_loads_both_checkpoint_layouts_and_saves_hf_tensors(name, layout, tmp_path):
    path = save_tiny(name, tmp_path / "model")  # save_pretrained writes the per-expert layout
    if layout == "fused":
        _to_fused_layout(path, name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, inference_config={"dtype": "fp32", "replace_with_kernel_inject": True}
    ).eval()
    assert is_injected(model)
    layers = model.model.layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in layers)
    kinds = [type(layer.mlp).__name__ for layer in layers]
    assert kinds == (["FusedMoE", "FusedMLP"] if name == "qwen2_moe" else ["FusedMoE", "FusedMoE"])  # mlp_only_layers
    ids = torch.tensor([prompts()[1]])
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), **MODEL_LOGITS_TOL[torch.float32])
    # save_pretrained writes plain HF tensors: a model without hf_dsinfer reads them back
    model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(reloaded, ids), _logits(reference, ids), **MODEL_LOGITS_TOL[torch.float32])


def test_qwen3_moe_sparse_step_layers():
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    hf_dsinfer.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    # decoder_sparse_step=2: layer 0 dense, layer 1 sparse
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["FusedMLP", "FusedMoE"]


@pytest.mark.slow
@torch.no_grad()
def test_hybrid_engine_on_mixtral_with_lora_on_attention():
    """The Hybrid Engine's fused inference copy of a LoRA-wrapped tiny mixtral (adapters on attention) generates what
    the merged model generates, and runs fused MoE layers."""
    import copy

    from peft import LoraConfig, get_peft_model
    from tiny_models import PAD, build_tiny, left_pad

    from hf_dsinfer.hybrid import HybridEngine
    from hf_dsinfer.policies import get_injection

    model = get_peft_model(
        build_tiny("mixtral"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)  # peft starts B at zero: make the delta real
    ids, mask = left_pad(prompts((5, 9, 3)))
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    expected = copy.deepcopy(model).merge_and_unload().eval().generate(**gen)
    he = HybridEngine(model, inference_config={"max_out_tokens": 64})
    assert get_injection(he.module) is not None
    assert any(isinstance(m, FusedMoE) for m in he.module.modules())
    he.eval()
    out = he.generate(**gen)
    he.train()
    assert torch.equal(out, expected), f"{out.tolist()} != {expected.tolist()}"
