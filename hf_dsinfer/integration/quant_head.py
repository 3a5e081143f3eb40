"""The LM head under ``quant.weight.lm_head=True``: which module is the head, whether it is tied to the input
embedding, and quantizing a tied head's shared table once (:func:`quantize_tied_head`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..log import warn_once

if TYPE_CHECKING:
    from torch import nn

    from .quant_config import QuantSettings


def head_is_tied(model: nn.Module) -> bool:
    """Whether ``model``'s LM head shares its weight with the input embedding (tied, or the config says so)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return False
    try:
        emb, head = get_in(), get_out()
    except (AttributeError, NotImplementedError):
        return False
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    return head is not None and emb is not None and (tied or head.weight is emb.weight)


def is_head(model: nn.Module, module: nn.Module) -> bool:
    """Whether ``module`` is ``model``'s LM head (``get_output_embeddings()``)."""
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        return get_out is not None and get_out() is module
    except (AttributeError, NotImplementedError):
        return False


def quantize_tied_head(model: nn.Module, settings: QuantSettings) -> bool:
    """With ``lm_head=True`` and a head tied to the input embedding: quantize the shared table once into the head's
    :class:`QuantLinear` and give the model a :class:`QuantEmbedding` gathering rows of the same integers (no float
    copy left). Round to nearest (GPTQ calibrates the body only). Under tensor parallelism the head stays float (one
    warning). Returns whether it quantized."""
    from torch import nn

    from ..modules.quant_linear import QuantEmbedding, QuantLinear
    from .apply import is_tensor_parallel

    if not settings.lm_head or not head_is_tied(model):
        return False
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if isinstance(head, QuantLinear) or type(head) is not nn.Linear or type(emb) is not nn.Embedding:
        return False  # quantized already (a second apply), or modules this swap does not know
    if is_tensor_parallel(model):
        warn_once("quant.weight.lm_head=True: the tied LM head stays float under tensor parallelism.")
        return False
    w = emb.weight.detach()  # [V, H]
    qhead = QuantLinear.from_float(w, settings.spec_for(w.shape[1], head=True), head.bias, w.dtype)
    model.set_output_embeddings(qhead)
    model.set_input_embeddings(QuantEmbedding(qhead, w.dtype, emb.padding_idx))
    return True
