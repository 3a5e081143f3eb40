"""Tiny random models of real architectures, built from configs (no hub access), for every test that needs one.

One row per architecture in ``ARCHITECTURES``: odd sizes (hidden 96 = 6 heads of 16, intermediate 136), GQA where
the architecture has it, vocab 500, two layers. ``save_tiny(name, dir)`` writes the model and a small byte-level
BPE tokenizer so ``from_pretrained`` and ``pipeline`` can load the directory back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import AutoConfig

VOCAB = 500
PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class Arch:
    """One row of the fidelity table."""

    model_type: str
    config: dict[str, Any]
    auto_class: str = "AutoModelForCausalLM"
    encoder: bool = False  # compare hidden states instead of generating
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
_DECODER = dict(_COMMON, hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6)

ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("llama", dict(_DECODER, num_key_value_heads=2), notes="GQA 3:1"),
    "mistral": Arch("mistral", dict(_DECODER, num_key_value_heads=2, sliding_window=16), notes="GQA, sliding window"),
    "qwen2": Arch("qwen2", dict(_DECODER, num_key_value_heads=2), notes="GQA, qkv bias"),
    "qwen3": Arch("qwen3", dict(_DECODER, num_key_value_heads=2, head_dim=16), notes="GQA, qk-norm"),
    "phi3": Arch("phi3", dict(_DECODER, num_key_value_heads=2), notes="fused qkv and gate_up"),
    # MoE rows: expert sizes picked so HF's own bf16 greedy run meets no exact logit tie in 20 tokens (tiny random
    # models have near-flat logits; at a 1-ulp tie any rounding difference, HF prefill vs HF decode included, flips it)
    "mixtral": Arch(
        "mixtral",
        dict(_DECODER, num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        notes="MoE: 4 experts, top-2 renormalised, fp32 routing weights",
    ),
    "qwen2_moe": Arch(
        "qwen2_moe",
        dict(_DECODER, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False),
        notes="MoE: shared expert with sigmoid gate, qkv bias, layer 1 dense (mlp_only_layers)",
    ),
    "qwen3_moe": Arch(
        "qwen3_moe",
        dict(_DECODER, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=True),
        notes="MoE: top-3 of 8 with norm_topk_prob, qk-norm, layer 0 dense (decoder_sparse_step=2)",
    ),
    "gemma2": Arch(
        "gemma2",
        dict(
            _DECODER,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        notes="sliding window every other layer, soft-capping, extra norms",
    ),
    "gemma": Arch(
        "gemma", dict(_DECODER, num_key_value_heads=2, head_dim=16), notes="(1 + w) norms, embedding scale, gelu_tanh"
    ),
    "olmo2": Arch("olmo2", dict(_DECODER, num_key_value_heads=2), notes="norms after blocks, full-width q/k norm"),
    "granite": Arch(
        "granite",
        dict(_DECODER, num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
             attention_multiplier=0.0078125, logits_scaling=8.0),
        notes="embedding, residual and attention multipliers, logits scaling",
    ),
    "starcoder2": Arch(
        "starcoder2", dict(_DECODER, num_key_value_heads=2, sliding_window=8, use_bias=True),
        notes="LayerNorm, biases, plain gelu MLP, sliding window",
    ),
    "gemma3_text": Arch(
        "gemma3_text",
        dict(
            _DECODER,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
            final_logit_softcapping=30.0,
        ),
        notes="local/global layers with their own rope bases, qk-norm, sandwich norms",
    ),
    "cohere": Arch(
        "cohere", dict(_DECODER, num_key_value_heads=2, logit_scale=0.25),
        notes="parallel attention + MLP, LayerNorm without bias, interleaved rotary, logit scale",
    ),
    "glm4": Arch(
        "glm4", dict(_DECODER, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
        notes="sandwich norms, partial interleaved rotary, qkv bias, packed gate_up",
    ),
    "gpt_neo": Arch(
        "gpt_neo",
        dict(_COMMON, hidden_size=96, num_layers=2, num_heads=6, intermediate_size=136, window_size=8,
             attention_types=[[["global", "local"], 1]]),
        notes="learned positions, global then local (window 8) layers, unscaled scores",
    ),
    "bloom": Arch(
        "bloom", dict(_COMMON, hidden_size=96, n_layer=2, n_head=6), notes="ALiBi (6 heads: not a power of two)"
    ),
    "gpt2": Arch(
        "gpt2", dict(_COMMON, n_embd=96, n_layer=2, n_head=6, n_positions=256, n_inner=136), notes="Conv1D"
    ),
    "gpt_neox": Arch(
        "gpt_neox",
        dict(_DECODER, rotary_pct=0.25, use_parallel_residual=True),
        notes="partial rotary, parallel residual",
    ),
    "opt": Arch(
        "opt", dict(_COMMON, hidden_size=96, ffn_dim=136, num_hidden_layers=2, num_attention_heads=6,
                    word_embed_proj_dim=96), notes="learned positions",
    ),
    "falcon": Arch(
        "falcon",
        dict(_COMMON, hidden_size=96, num_hidden_layers=2, num_attention_heads=6, multi_query=True,
             parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False),
        notes="multi-query, parallel attention",
    ),
    "falcon_new": Arch(
        "falcon",
        dict(_COMMON, hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_kv_heads=2,
             new_decoder_architecture=True, alibi=False, bias=True),
        notes="new decoder architecture: GQA 3:1 groups, ln_attn/ln_mlp, biases",
    ),
    "gptj": Arch(
        "gptj", dict(_COMMON, n_embd=96, n_layer=2, n_head=6, n_positions=256, n_inner=136, rotary_dim=8),
        notes="parallel attention + MLP, interleaved partial rotary",
    ),
    "bert": Arch(
        "bert",
        dict(_COMMON, hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6),
        auto_class="AutoModel",
        encoder=True,
        notes="encoder: hidden states compared",
    ),
    "roberta": Arch(
        "roberta",
        dict(_COMMON, hidden_size=96, intermediate_size=136, num_hidden_layers=2, num_attention_heads=6),
        auto_class="AutoModel",
        encoder=True,
        notes="encoder: positions from the padding index",
    ),
    "distilbert": Arch(
        "distilbert",
        dict(_COMMON, dim=96, hidden_dim=136, n_layers=2, n_heads=6),
        auto_class="AutoModel",
        encoder=True,
        notes="encoder: no token types, no pooler",
    ),
}


def tiny_config(name: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """The config of row ``name`` (``ARCHITECTURES``), with ``overrides`` applied."""
    arch = ARCHITECTURES[name]
    return AutoConfig.for_model(arch.model_type, **{**arch.config, **overrides})


def build_tiny(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random model of row ``name`` in fp32, eval mode."""
    arch = ARCHITECTURES[name]
    config = tiny_config(name, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, arch.auto_class).from_config(config)
    return model.eval()


def make_tokenizer(vocab_size: int = VOCAB) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences: any text encodes, ids stay below ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2 = PAD, BOS, EOS
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, this is a tiny tokenizer for tests.",
        "DeepSpeed inference kernels fused attention rotary embeddings.",
    ] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    return fast


def save_tiny(name: str, directory: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Build row ``name``, save it and a tokenizer to ``directory``; return the path."""
    path = os.fspath(directory)
    build_tiny(name, seed=seed, **overrides).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def load_pair(name: str, directory: str | os.PathLike, inference_config: dict[str, Any]) -> tuple[Any, Any, str]:
    """Save causal-LM row ``name`` to ``directory`` and load it twice: HF's eager model in fp32 (the oracle) and with
    ``inference_config``. Returns ``(hf_model, injected_model, path)``."""
    path = save_tiny(name, directory)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    opt = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=inference_config).eval()
    return ref, opt, path


def prompts(lengths=(5, 9, 3), seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths, token ids in [3, VOCAB) (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` for ``batch``, left-padded with ``PAD``."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def randomize_lora(model: torch.nn.Module, seed: int = 1, scale: float = 0.2) -> None:
    """peft initializes B to zero (delta 0): give every adapter factor a real value so fusion is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
