"""Shaping the Hybrid Engine's inference copy at build time: layer lists cut to the training model's, tied names
re-tied after ``to_empty`` (helpers of :meth:`~hf_dsinfer.hybrid.engine.HybridEngine._build`)."""

from __future__ import annotations

from typing import Any

from torch import nn


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
