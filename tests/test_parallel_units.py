"""Tensor-parallel unit tests in one process: slicing rules, row/column detection per architecture, and the errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from tiny_models import ARCHITECTURES, build_tiny
from transformers import AutoConfig

import hf_dsinfer
from hf_dsinfer import parallel
from hf_dsinfer.log import LOGGER_NAME
from hf_dsinfer.parallel import autotp
from hf_dsinfer.parallel.shard import (
    HeadPartition,
    Shard,
    concat_layout,
    grouped_layout,
    select,
    split_sizes,
    split_units,
)

# -- slicing rules ---------------------------------------------------------------------------------------------------


def test_grain_rule_splits_unevenly_with_the_remainder_on_the_last_rank():
    assert [split_units(136, 3, r, grain=8) for r in range(3)] == [(0, 48), (48, 96), (96, 136)]
    assert [split_units(500, 3, r) for r in range(3)] == [(0, 167), (167, 334), (334, 500)]
    # DeepSpeed's default grain 64: 785 whole units dealt 262 / 262 / 261, the 17 rows left over go to the last rank
    assert [split_units(50257, 3, r, grain=64) for r in range(3)] == [(0, 16768), (16768, 33536), (33536, 50257)]
    assert split_sizes(136, 2, grain=64) == [64, 72]
    assert split_sizes(100, 3, grain=64) == [34, 33, 33]  # fewer units than ranks: element by element
    with pytest.raises(ValueError, match=r"vocab_size \(2\) is smaller than tensor_parallel.tp_size=4"):
        split_units(2, 4, 0, grain=64, what="vocab_size")


def test_head_partition_splits_or_replicates_kv_heads():
    # 8 q heads, 4 kv heads over 2 ranks: two kv heads each, with the four q heads that use them
    assert HeadPartition.for_rank(8, 4, 2, 1) == HeadPartition(4, 8, 2, 4)
    # 8 q heads, 2 kv heads over 4 ranks: each kv head replicated on the two ranks whose q heads use it
    parts = [HeadPartition.for_rank(8, 2, 4, r) for r in range(4)]
    assert [(p.q_start, p.kv_start) for p in parts] == [(0, 0), (2, 0), (4, 1), (6, 1)]
    # multi-query: the single kv head everywhere
    assert {HeadPartition.for_rank(6, 1, 2, r).kv_start for r in range(2)} == {0}


@pytest.mark.parametrize(
    "heads, kv, tp, expected",
    [
        (40, 40, 3, [(0, 14, 0, 14), (14, 27, 14, 27), (27, 40, 27, 40)]),  # MHA: 14 / 13 / 13, remainder first
        (12, 3, 2, [(0, 8, 0, 2), (8, 12, 2, 3)]),  # GQA: kv groups stay whole (2 + 1 groups of 4 q heads)
        (6, 2, 4, [(0, 2, 0, 1), (2, 3, 0, 1), (3, 5, 1, 2), (5, 6, 1, 2)]),  # replicated kv, its 3 q heads 2 / 1
        (3, 1, 2, [(0, 2, 0, 1), (2, 3, 0, 1)]),
    ],
)
def test_head_partition_splits_unevenly(heads, kv, tp, expected):
    parts = [HeadPartition.for_rank(heads, kv, tp, r) for r in range(tp)]
    assert [(p.q_start, p.q_stop, p.kv_start, p.kv_stop) for p in parts] == expected


@pytest.mark.parametrize(
    "heads, kv, tp, message",
    [
        (6, 2, 3, r"tp_size=3 and num_key_value_heads \(2\).*multiple of 2"),
        (2, 1, 4, r"tp_size=4 is more than num_attention_heads \(2\)"),
        (6, 4, 2, r"num_key_value_heads \(4\) does not divide num_attention_heads \(6\)"),
    ],
)
def test_head_partition_errors_name_the_numbers(heads, kv, tp, message):
    with pytest.raises(ValueError, match=message):
        HeadPartition.for_rank(heads, kv, tp, 0)


def test_fused_layouts_keep_each_part_consistent():
    part = HeadPartition.for_rank(4, 2, 2, 1)  # q heads 2..4, kv head 1
    split = select(concat_layout([("q", 4, 3), ("k", 2, 3), ("v", 2, 3)]), part.keeps())
    assert split.ranges == ((6, 12), (15, 18), (21, 24)) and split.size == 12
    per_head = select(grouped_layout(4, [("q", 1, 2), ("k", 1, 2), ("v", 1, 2)]), HeadPartition(2, 4, 2, 4).keeps())
    assert per_head.ranges == ((12, 24),)
    # take() and read() agree (read() gets a safetensors-like slice object: indexing a tensor works the same way)
    t = torch.arange(24 * 5).reshape(24, 5)
    assert torch.equal(split.take(t), split.read(t, t.shape))
    col = Shard(1, ((1, 3),), 5)
    assert torch.equal(col.take(t), t[:, 1:3])


# -- row / column detection ------------------------------------------------------------------------------------------

# model row -> (row-parallel suffixes, column-parallel suffixes) of layer 0
EXPECTED = {
    "llama": ({"self_attn.o_proj", "mlp.down_proj"}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "mlp.gate_proj", "mlp.up_proj"}),
    "qwen3": ({"self_attn.o_proj", "mlp.down_proj"}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "mlp.gate_proj", "mlp.up_proj"}),
    "phi3": ({"self_attn.o_proj", "mlp.down_proj"}, {"self_attn.qkv_proj", "mlp.gate_up_proj"}),
    "gemma2": ({"self_attn.o_proj", "mlp.down_proj"}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "mlp.gate_proj", "mlp.up_proj"}),
    "gpt2": ({"attn.c_proj", "mlp.c_proj"}, {"attn.c_attn", "mlp.c_fc"}),
    "gpt_neox": ({"attention.dense", "mlp.dense_4h_to_h"}, {"attention.query_key_value", "mlp.dense_h_to_4h"}),
    "opt": ({"self_attn.out_proj", "fc2"}, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "fc1"}),
    "falcon": ({"self_attention.dense", "mlp.dense_4h_to_h"}, {"self_attention.query_key_value", "mlp.dense_h_to_4h"}),
    "bert": ({"attention.output.dense", "output.dense"}, {"attention.self.query", "attention.self.key",
                                                          "attention.self.value", "intermediate.dense"}),
}


def _layer0(names, model):
    prefix = next(iter(autotp.find_blocks(model))) + "."
    return {n[len(prefix):] for n in names if n.startswith(prefix)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_row_and_column_linears_are_found_structurally(name):
    model = build_tiny(name)
    plan = parallel.build_plan(model, 2, 0)
    rows, cols = EXPECTED[name]
    assert _layer0(plan.row_parallel, model) == rows
    assert _layer0(plan.column_parallel, model) == cols
    if not ARCHITECTURES[name].encoder:
        assert plan.head is not None and plan.embedding is not None


def test_injection_policy_overrides_and_matches_the_trace(monkeypatch):
    model = build_tiny("llama")
    traced = parallel.build_plan(model, 2, 1)
    policy = {"LlamaDecoderLayer": ["self_attn.o_proj", "mlp.down_proj"]}
    assert parallel.build_plan(model, 2, 1, injection_policy=policy).shards == traced.shards

    def no_trace(model):
        raise ValueError("no trace")

    # without a trace the policy's layers are grouped by parent module: still the same plan
    monkeypatch.setattr(autotp, "trace_model", no_trace)
    assert parallel.build_plan(model, 2, 1, injection_policy=policy).shards == traced.shards


def test_injection_policy_errors_name_the_module():
    model = build_tiny("llama")
    with pytest.raises(ValueError, match="'mlp.nope'"):
        parallel.build_plan(model, 2, 0, injection_policy={"LlamaDecoderLayer": ["mlp.nope"]})
    with pytest.raises(ValueError, match="match no layer class"):
        parallel.build_plan(model, 2, 0, injection_policy={"GPT2Block": ["attn.c_proj"]})


def _tiny(model_type: str, **config):
    config = AutoConfig.for_model(model_type, vocab_size=500, num_hidden_layers=1, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, **config)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_unsupported_pattern_names_the_reason():
    mla = _tiny("deepseek_v2", hidden_size=96, intermediate_size=136, num_attention_heads=6, kv_lora_rank=16,
                q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"multi-head latent attention \(kv_lora_rank=16\).*tp_size=1"):
        parallel.build_plan(mla, 2, 0)


def test_full_width_qk_norm_is_split_with_its_projection():
    """OLMo-2 normalizes all of q (and k): the norm weights follow the head split and are marked for all-reduce."""
    model = _tiny("olmo2", hidden_size=96, intermediate_size=136, num_attention_heads=6, num_key_value_heads=1)
    plan = parallel.build_plan(model, 2, 1)
    attn = "model.layers.0.self_attn"
    assert plan.norms == {f"{attn}.q_norm": (96, 1.0), f"{attn}.k_norm": (16, 0.5)}  # k: one kv head on both ranks
    assert plan.shards[f"{attn}.q_norm.weight"].ranges == ((48, 96),)
    assert plan.shards[f"{attn}.k_norm.weight"].ranges == ((0, 16),)


def test_codegen_ranks_keep_a_share_of_every_qkv_chunk():
    model = _tiny("codegen", n_embd=64, n_head=8, n_inner=136, rotary_dim=4, n_positions=64)  # head_dim 8
    plan = parallel.build_plan(model, 2, 1)
    qkv = plan.shards["transformer.h.0.attn.qkv_proj.weight"]
    # 4 chunks of [q | v | k], 2 heads each: rank 1 keeps the second head of every part of every chunk
    assert qkv.ranges == tuple((c * 48 + p * 16 + 8, c * 48 + p * 16 + 16) for c in range(4) for p in range(3))
    assert plan.shards["transformer.h.0.attn.out_proj.weight"].ranges == tuple((c * 16 + 8, c * 16 + 16)
                                                                                for c in range(4))
    assert plan.local_heads["transformer.h.0.attn.out_proj"] == (4, 4)


def test_bloom_splits_per_head_qkv_and_slices_alibi():
    model = _tiny("bloom", hidden_size=96, n_head=6)
    plan = parallel.build_plan(model, 2, 1)
    assert plan.shards["transformer.h.0.self_attention.query_key_value.weight"].ranges == ((144, 288),)
    assert plan.alibi["transformer.h.0.self_attention"] == (3, 6, 6)


def test_uneven_heads_and_too_many_ranks():
    opt = build_tiny("opt")  # 6 heads of 16, MHA
    heads = [parallel.build_plan(opt, 4, r).local_heads["model.decoder.layers.0.self_attn.out_proj"] for r in range(4)]
    assert heads == [(2, 2), (2, 2), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match=r"tp_size=8 and num_key_value_heads \(6\).*multiple of 6"):
        parallel.build_plan(opt, 8, 0)


def test_tp_without_a_launcher_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2"):
        hf_dsinfer.init_inference(build_tiny("llama"), dtype="fp32", tensor_parallel={"tp_size": 2})


def test_mpu_and_group_size_must_agree():
    class Mpu:
        def get_tensor_model_parallel_group(self):
            return "g"

        def get_tensor_model_parallel_world_size(self):
            return 4

        def get_tensor_model_parallel_rank(self):
            return 1

    assert parallel.resolve_tp_group(1, mpu=Mpu()).size == 4
    with pytest.raises(ValueError, match="tp_size=2 but the given mpu has 4 ranks"):
        parallel.resolve_tp_group(2, mpu=Mpu())


def test_checkpoint_description_is_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        parallel.read_description({"type": "ds_model", "checkpoints": [], "shards": 2})
    with pytest.raises(ValueError, match="is not a file"):
        hf_dsinfer.init_inference(build_tiny("llama"), dtype="fp32", checkpoint=str(tmp_path / "missing.json"))


# -- fused layers on a split model (the 2-rank runs are in test_parallel.py) -----------------------------------------


def _layout_for(model, drop_row: str | None = None, heads: tuple[int, int] | None = None):
    """A TPLayout naming the modules AutoTP splits in ``model`` but keeping every head (as on a single rank), or
    claiming ``heads`` per rank (config included, as the integration layer builds it) while the weights stay whole."""
    from hf_dsinfer.policies import TPLayout

    plan = autotp.build_plan(model, 2, 0)  # which modules are row / column parallel; the model itself stays whole
    rows = frozenset(r for r in plan.row_parallel if r != drop_row)
    h = model.config.num_attention_heads
    heads = heads or (h, getattr(model.config, "num_key_value_heads", None) or h)
    return TPLayout(
        heads={row: heads for row in plan.local_heads},
        row_parallel=rows,
        column_parallel=frozenset(plan.column_parallel),
        reduce=lambda t: t,
        config=autotp.local_head_config(model.config, *heads),
    )


@pytest.mark.parametrize("name, reduces_per_layer", [("llama", 2), ("gpt_neox", 1)])
@torch.no_grad()
def test_fused_layers_take_a_tp_layout_and_reduce_in_o_and_down(name, reduces_per_layer):
    """With a layout whose reduce is the identity (one rank), injection builds row-parallel o/down and equals HF.

    Pre-norm blocks reduce after attention and after the MLP; parallel-residual blocks (neox) reduce once.
    """
    from hf_dsinfer.policies import get_injection, inject

    ref = build_tiny(name).eval()
    model = build_tiny(name).eval()
    model.load_state_dict(ref.state_dict())
    calls = []
    layout = dataclasses.replace(_layout_for(model), reduce=lambda t: calls.append(1) or t)
    inject(model, hf_dsinfer.InferenceConfig(dtype="fp32", replace_with_kernel_inject=True), tp=layout)
    layer = get_injection(model).runtime.layers[0]
    assert layer.attn.o.reduce is not None and layer.mlp.down.reduce is not None
    assert layer.attn.qkv.reduce is None and layer.mlp.up.reduce is None
    ids = torch.tensor([[5, 9, 14, 3, 7]])
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    assert len(calls) == reduces_per_layer * model.config.num_hidden_layers


def test_tp_layout_mismatch_falls_back_with_one_warning(caplog):
    """A split the fused layer cannot mirror (here: a row-parallel module it would not reduce) keeps HF's modules."""
    import logging

    from hf_dsinfer.policies import inject, is_injected

    model = build_tiny("llama").eval()
    layout = _layout_for(model, drop_row="model.layers.0.mlp.down_proj")
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        inject(model, hf_dsinfer.InferenceConfig(dtype="fp32", replace_with_kernel_inject=True), tp=layout)
    assert not is_injected(model)
    assert "keeps HF's modules split by AutoTP" in caplog.text and "mlp.down.weight of layer 0" in caplog.text
    wrong = _layout_for(model, heads=(1, 1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        inject(model, hf_dsinfer.InferenceConfig(dtype="fp32", replace_with_kernel_inject=True), tp=wrong)
    assert not is_injected(model) and "split qkv has" in caplog.text
