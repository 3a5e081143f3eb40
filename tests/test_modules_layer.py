"""The fused decoder layer's residual styles against plain-torch formulas (the styles other policies rely on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import MODEL_LOGITS_TOL
from torch import nn

from hf_dsinfer.modules import (
    AttentionSpec,
    FusedDecoderLayer,
    LayerSpec,
    MLPSpec,
    NormSpec,
    RotaryTable,
    StaticKVCache,
    StepContext,
)

C, H, D, INTER = 32, 4, 8, 24


def _params(style: str, gated: bool) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(0)

    def p(*shape, scale=0.2):
        return nn.Parameter(torch.randn(*shape, generator=g) * scale, requires_grad=False)

    params = {
        "attn.qkv.weight": p(3 * H * D, C), "attn.qkv.bias": p(3 * H * D), "attn.o.weight": p(C, H * D),
        "mlp.up.weight": p((2 if gated else 1) * INTER, C), "mlp.down.weight": p(C, INTER),
        "attn_norm.weight": p(C, scale=1.0), "attn_norm.bias": p(C),
    }  # fmt: skip
    if style != "parallel":
        params.update({"mlp_norm.weight": p(C, scale=1.0), "mlp_norm.bias": p(C)})
    return params


def _reference(x, params, style, gated, scale):
    """Plain torch: LayerNorm with bias, causal attention without rotary, plain/gated MLP."""

    def ln(t, name):
        return F.layer_norm(t, (C,), params[f"{name}.weight"], params[f"{name}.bias"], 1e-5)

    def attn(t):
        B, T, _ = t.shape
        q, k, v = F.linear(t, params["attn.qkv.weight"], params["attn.qkv.bias"]).view(B, T, 3, H, D).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return F.linear(o.transpose(1, 2).reshape(B, T, H * D), params["attn.o.weight"])

    def mlp(t):
        h = F.linear(t, params["mlp.up.weight"])
        h = F.silu(h[..., :INTER]) * h[..., INTER:] if gated else F.gelu(h)
        return F.linear(h, params["mlp.down.weight"])

    if style == "parallel":
        h = ln(x, "attn_norm")
        return x + attn(h) + mlp(h)
    if style == "post":
        x = ln(x + attn(x), "attn_norm")
        return ln(x + mlp(x), "mlp_norm")
    x = x + attn(ln(x, "attn_norm"))
    return x + mlp(ln(x, "mlp_norm"))


@pytest.mark.parametrize("style,gated", [("pre", True), ("parallel", False), ("post", False)])
def test_residual_styles(style, gated):
    spec = LayerSpec(
        AttentionSpec(num_heads=H, num_kv_heads=H, head_dim=D, scale=D**-0.5, rotary=False),
        MLPSpec(gated=gated, activation="silu" if gated else "gelu"),
        NormSpec("layer", 1e-5),
        residual=style,
    )
    params = _params(style, gated)
    layer = FusedDecoderLayer.from_params(spec, 0, params)
    x = torch.randn(2, 5, C, generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache([H], [D], max_tokens=8, max_batch_size=2)
    cache.start(2, x.device, x.dtype)
    zeros = torch.zeros(2, dtype=torch.int32)
    ctx = StepContext(cache, zeros, cache.lengths[:2], torch.zeros(10, dtype=torch.long), None)
    out, residual = layer(x, None, ctx)
    got = out if residual is None else out + residual
    want = _reference(x, params, style, gated, D**-0.5)
    torch.testing.assert_close(got, want, **MODEL_LOGITS_TOL[torch.float32])


def test_missing_and_unknown_parameters_are_named():
    spec = LayerSpec(AttentionSpec(H, H, D, 1.0), MLPSpec(), NormSpec(), residual="sandwich")
    params = _params("pre", True)
    with pytest.raises(ValueError, match="attn_out_norm.weight"):
        FusedDecoderLayer.from_params(spec, 3, params)
    with pytest.raises(ValueError, match="unknown fused parameter names"):
        FusedDecoderLayer.from_params(spec, 3, {**params, "attn.qkv_proj.weight": params["attn.qkv.weight"]})


def test_rotary_table_partial_and_rounded():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))  # rotary dim 4 of a larger head
    table = RotaryTable.from_inv_freq(inv_freq, 16, attention_scaling=0.5, round_to=torch.bfloat16)
    assert table.rotary_dim == 4 and table.max_positions == 16 and table.cos.dtype == torch.float32
    want = (torch.arange(16.0)[:, None] * inv_freq).cos() * 0.5
    assert torch.equal(table.cos, want.to(torch.bfloat16).float())
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0 = q.clone()
    RotaryTable.from_inv_freq(inv_freq, 16)(q, k, torch.tensor([0, 1, 2]))
    assert torch.equal(q[0], q0[0]) and torch.equal(q[:, :, 4:], q0[:, :, 4:])  # position 0 and dims past R untouched
