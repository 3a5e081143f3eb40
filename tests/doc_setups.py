"""Names a documentation block uses but does not define (``path``, ``model``, ...), for ``tests/test_docs.py``.

A block marked ``<!-- runnable: setup=NAME -->`` runs as written after ``NAME(tmp_path)`` here has returned its
globals: the doc shows the calls a user writes, the setup stands in for the user's own model and data (tiny, random,
CPU), so the block is still run exactly as printed.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch
from tiny_models import save_tiny


def tiny_llama(tmp_path: pathlib.Path) -> dict[str, Any]:
    """``path``: a tiny random Llama (GQA) with a tokenizer, saved to a directory."""
    return {"path": save_tiny("llama", tmp_path / "llama")}


def tiny_llama_model(tmp_path: pathlib.Path) -> dict[str, Any]:
    """``model``: a tiny Llama loaded with the default inference config; ``enc``: a tokenized prompt batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_dsinfer  # noqa: F401  (the user's program imports it: inference_config= below)

    path = save_tiny("llama", tmp_path / "llama")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, inference_config={})
    enc = tok(["The quick brown fox", "Hello"], return_tensors="pt", padding=True)
    return {"path": path, "model": model, "enc": enc}


def hybrid_loop(tmp_path: pathlib.Path) -> dict[str, Any]:
    """What docs/hybrid.md's training loop assumes: a LoRA model, a loader, prompts, a loss and an optimizer."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny("llama", tmp_path / "llama")
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)

    def policy_loss(model: torch.nn.Module, rollouts: torch.Tensor) -> torch.Tensor:
        return model(rollouts).logits.float().logsumexp(-1).mean()  # any differentiable score of the rollouts

    return {
        "peft_model": peft_model,
        "loader": range(2),
        "prompts": dict(tok(["The quick brown fox", "Hello"], return_tensors="pt", padding=True)),
        "policy_loss": policy_loss,
        "optimizer": optimizer,
    }
