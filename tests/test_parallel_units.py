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
from hf_dsinfer.parallel.shard import HeadPartition, Shard, concat_layout, grouped_layout, select, split_units

# -- slicing rules ---------------------------------------------------------------------------------------------------


def test_grain_rule_splits_unevenly_and_names_the_numbers():
    assert [split_units(136, 3, r, grain=8) for r in range(3)] == [(0, 48), (48, 96), (96, 136)]
    assert [split_units(500, 3, r) for r in range(3)] == [(0, 167), (167, 334), (334, 500)]
    with pytest.raises(ValueError, match=r"tp_grain_size=5 does not divide .* \(136\)"):
        split_units(136, 2, 0, grain=5, what="intermediate")
    with pytest.raises(ValueError, match="fewer than tp_size=4"):
        split_units(16, 4, 0, grain=8)


def test_head_partition_splits_or_replicates_kv_heads():
    # 8 q heads, 4 kv heads over 2 ranks: two kv heads each, with the four q heads that use them
    assert HeadPartition.for_rank(8, 4, 2, 1) == HeadPartition(4, 8, 2, 4)
    # 8 q heads, 2 kv heads over 4 ranks: each kv head replicated on the two ranks whose q heads use it
    parts = [HeadPartition.for_rank(8, 2, 4, r) for r in range(4)]
    assert [(p.q_start, p.kv_start) for p in parts] == [(0, 0), (2, 0), (4, 1), (6, 1)]
    # multi-query: the single kv head everywhere
    assert {HeadPartition.for_rank(6, 1, 2, r).kv_start for r in range(2)} == {0}


@pytest.mark.parametrize(
    "heads, kv, tp, message",
    [
        (6, 2, 4, r"tp_size=4 does not divide num_attention_heads \(6\)"),
        (12, 3, 2, r"tp_size=2 and num_key_value_heads \(3\).*neither divides the other"),
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


def test_unsupported_pattern_names_the_module():
    # OLMo-2 normalizes the full q/k projections: a column-split output cannot be normalized per rank
    config = AutoConfig.for_model("olmo2", vocab_size=500, hidden_size=96, intermediate_size=136, num_hidden_layers=1,
                                  num_attention_heads=6, num_key_value_heads=2, eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.[qk]_(proj|norm)"):
        parallel.build_plan(model, 2, 0)


def test_indivisible_heads_error_names_the_numbers():
    with pytest.raises(ValueError, match=r"tp_size=4 does not divide num_attention_heads \(6\)"):
        parallel.build_plan(build_tiny("opt"), 4, 0)


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
