"""Shaping the Hybrid Engine's inference copy at build time: layer lists cut to the training model's, tied names
re-tied after ``to_empty``, the LM head's layout (helpers of :meth:`~hf_dsinfer.hybrid.engine.HybridEngine._build`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..modules import linear_layout
from ..policies.injection import relayout_output_embeddings


def match_layer_lists(weights: Any, infer: nn.Module) -> None:
    """Give the (meta) inference copy the layer lists the training model actually has.

    The config can overstate them: DeepSpeed's Hybrid Engine tests shrink a model by popping decoder layers after
    loading, leaving ``num_hidden_layers`` as it was. Layers removed from the end are followed (the copy keeps its
    first ``n`` layers and its config says ``n``); any other difference is refused, naming the list.
    """
    for path, modules in list(infer.named_modules()):
        if not isinstance(modules, nn.ModuleList):
            continue
        try:
            trained = weights.module(path)
        except KeyError:
            continue  # reported by the refresh, which names the missing parameter
        n = len(trained)
        if n == len(modules):
            continue
        indices = [getattr(getattr(m, "self_attn", None), "layer_idx", i) for i, m in enumerate(trained)]
        if n > len(modules) or indices != list(range(n)):
            raise ValueError(
                f"the training model's {path!r} holds {n} modules but its config builds {len(modules)}"
                f"{'' if n > len(modules) else ' and they are not the first ' + str(n)}; the Hybrid Engine follows "
                "layers removed from the end only. Set the config (e.g. num_hidden_layers) to match the model."
            )
        parent, _, leaf = path.rpartition(".")
        setattr(infer.get_submodule(parent), leaf, nn.ModuleList(list(modules)[:n]))
        cfg = getattr(infer.config, "get_text_config", lambda: infer.config)()
        if getattr(cfg, "num_hidden_layers", None) == len(modules):
            cfg.num_hidden_layers = n  # the cache and generation read the layer count from here
            if isinstance(getattr(cfg, "layer_types", None), list):
                cfg.layer_types = cfg.layer_types[:n]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """``to_empty`` gives each module its own tensor: point tied names back at one parameter."""
    for names in groups:
        keep = model.get_parameter(names[0])
        for name in names[1:]:
            path, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(path), leaf, keep)


def row_major_head(model: nn.Module) -> None:
    """Store the (injected) copy's LM head weight, tied embedding included, as :class:`~hf_dsinfer.modules.Linear`
    stores its weights (``linear_layout``: row-major for fp32 on CPU), as injection now does too (unless
    ``HF_DSINFER_CPU_GEMV=0`` asked it for the K-major ``gemm_layout``).

    Why: the engine re-packs a changed head at every switch (``modules/cpu_packed.py``: oneDNN's prepacked GEMM at
    4-32 rows), and packing reads row-major rows; from the K-major layout each re-pack first transposed the weight.
    SmolLM2's ``[49152, 576]`` head, 1 thread, load ~4.9, in 7232-row chunks: 166 ms to transpose plus 34 ms to
    reorder, against 34 ms from row-major. At 1-3 rows the row-major head takes the row GEMV
    (``cpu_packed.module_forward``), which read it faster than ``F.linear`` over K-major: 4.4 / 5.9 / 8.2 ms at 1 / 2 /
    3 rows against 5.1 / 10.8 / 15.3. Call before anything holds the head's parameter (values come with the refresh).
    """
    relayout_output_embeddings(model, linear_layout, requires_grad=None)
