"""``install_generate``: the per-instance ``generate`` of models loaded with an inference config.

The override keeps transformers' ``generate`` as the front door (argument handling, validation, processors,
streamers, pipelines all behave as documented by transformers) and swaps only the decoding loop:

* greedy search and sampling on a model with fused layers run :func:`~hf_dsinfer.generation.loop.decoding_loop`
  (passed as ``custom_generate``), with CUDA-graph decode steps when ``enable_cuda_graph`` is on and the model is
  on CUDA;
* everything else (beam search, assisted decoding, user logits processors or stopping criteria, a user cache,
  ``inputs_embeds``, ...) runs transformers' own loop on the model's fused forward and static cache, with one
  warning per kind of request.

Either way (and on models that keep HF's modules) the request is checked against ``max_out_tokens`` before any work,
and the call's timing is recorded (:func:`~hf_dsinfer.generation.stats.last_generate_stats`).

Threads: a model with fused layers holds one static KV cache, so its ``generate`` calls (and forward calls) from
several threads take turns on a per-model lock: each call gets exactly the tokens it would get alone, and calls run
one at a time. A model on HF's modules keeps HF's behaviour (a fresh cache per call, no lock).
"""

from __future__ import annotations

import functools
import threading
from types import MethodType
from typing import Any

import torch
from torch import nn

from .. import hf_compat
from ..log import logger
from .decode import DecodeGraphs, DecodeStep
from .forward_graphs import install_forward_graphs
from .loop import CURRENT_CALL, CallContext, FastLoopDeclined, check_capacity, decoding_loop, warn_fallback
from .processors import fast_loop_blocker, resolve_generation_config, stop_string_criteria
from .stats import StepTimer, forward_marks, prompt_counts, record_stats

GEN_ATTR = "_dsinfer_generation"

# generate() arguments that select something other than the plain greedy / sampling loop (a user cache under either
# name: continuing from it runs transformers' loop on the fused forward, which trims what the cache holds)
_HF_ONLY_ARGS = ("assistant_model", "custom_generate", "prefix_allowed_tokens_fn", "negative_prompt_ids",
                 "negative_prompt_attention_mask", "past_key_values", "cache", "inputs_embeds", "cache_implementation",
                 "assistant_tokenizer", "synced_gpus", "trust_remote_code")  # fmt: skip


class GenerationState:
    """What ``generate`` needs of one model: its config, fused runtime (or None), decode step and graphs."""

    def __init__(self, model: nn.Module, cfg: Any, runtime: Any, hf_generate: Any):
        self.cfg = cfg
        self.runtime = runtime
        self.hf_generate = hf_generate  # transformers' generate, bound to the model
        self.step = None
        if runtime is not None:
            self.step = DecodeStep(
                model,
                runtime,
                compile_cpu=getattr(cfg, "cpu_compile", True),  # True, False or "auto"
                batch_sizes=getattr(cfg, "cuda_graph_batch_sizes", None),
                max_batch_size=getattr(cfg, "max_batch_size", 8),
            )
        self.graphs = None
        if self.step is not None and getattr(cfg, "enable_cuda_graph", False):
            self.graphs = DecodeGraphs(self.step, cfg.cuda_graph_batch_sizes, cfg.max_batch_size)
        # One static cache per model: concurrent calls take turns (re-entrant: generate calls the forward).
        self.lock = threading.RLock() if runtime is not None else None


def install_generate(model: nn.Module, cfg: Any, injection: Any = None) -> nn.Module:
    """Give ``model`` (this instance only) hf_dsinfer's ``generate``; returns the model.

    ``injection``: the kernel-injection record of the model (anything with a ``runtime`` attribute: the fused
    layers, static cache, policy), or None for a model running HF's modules (then only timing is added).
    Models that cannot generate (encoders) get bucketed CUDA-graph forwards instead when ``enable_cuda_graph`` is
    set (:mod:`~hf_dsinfer.generation.forward_graphs`). Installing twice is harmless.
    """
    if getattr(model, GEN_ATTR, None) is not None:
        return model
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        if getattr(cfg, "enable_cuda_graph", False) and getattr(model, "_dsinfer_forward_graphs", None) is None:
            install_forward_graphs(model, cfg)  # encoders: DeepSpeed's forward graphs (CUDA only)
        return model
    runtime = getattr(injection, "runtime", None)
    if runtime is not None and model.get_output_embeddings() is None:
        runtime = None  # a bare base model: no logits to decode from
    hf_generate = model.__dict__.get("generate") or MethodType(type(model).generate, model)
    state = GenerationState(model, cfg, runtime, hf_generate)
    object.__setattr__(model, GEN_ATTR, state)  # plain attribute: not a submodule, not in the state dict
    model.generate = MethodType(generate, model)
    fused_forward = model.__dict__.get("forward")
    if state.lock is not None and fused_forward is not None:
        model.forward = _locked(fused_forward, state.lock)
    # generate_batch / init_continuous_batching: continuous batching on the fused layers (a paged KV cache) instead
    # of transformers' manager, whose paged cache the fused forward cannot read (hf_dsinfer/serving).
    from ..serving.hf_api import install_generate_batch  # here: serving imports generation

    install_generate_batch(model, runtime)
    return model


def _locked(fn: Any, lock: threading.RLock) -> Any:
    """``fn`` run under ``lock`` (a forward of another thread must not write the static cache mid-generation)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return fn(*args, **kwargs)

    return call


_INVALID_CONFIG = "an invalid generation config"


def _prompt_width(args: tuple, kwargs: dict[str, Any]) -> int | None:
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return ids.shape[-1]
    return None


def _route(self: nn.Module, state: GenerationState, args: tuple, kwargs: dict[str, Any]) -> tuple[str | None, Any]:
    """(why transformers' loop must run, or None for the fast loop; the resolved generation config or None).

    Decided before generation from the arguments and public ``GenerationConfig`` fields only."""
    gen_config = resolve_generation_config(self, kwargs)
    if gen_config is None:
        return _INVALID_CONFIG, None
    if state.runtime is None:
        return "no fused layers", gen_config
    for name in _HF_ONLY_ARGS:
        value = kwargs.get(name)
        if name == "assistant_model" and value is not None and _fused_draft(self, value, kwargs, gen_config):
            continue  # verified on the fast loop (generation/speculative.py)
        if value is not None and value is not False:
            return f"generate({name}=...)", gen_config
    for name in ("logits_processor", "stopping_criteria"):
        if kwargs.get(name):
            return f"a user {name}", gen_config
    width_ok = _prompt_width(args, kwargs) is not None
    if not width_ok:
        return "a call without input_ids", gen_config
    return fast_loop_blocker(gen_config), gen_config


def _fused_draft(self: nn.Module, draft: Any, kwargs: dict[str, Any], gen_config: Any) -> bool:
    """Whether ``assistant_model=draft`` can run on the fast loop: greedy, a separate fused model with its own static
    cache, the same tokenizer (no ``assistant_tokenizer``) and no larger a vocabulary."""
    state = getattr(draft, GEN_ATTR, None)
    if draft is self or state is None or state.runtime is None or kwargs.get("assistant_tokenizer") is not None:
        return False
    if gen_config.do_sample or state.runtime is getattr(getattr(self, GEN_ATTR, None), "runtime", None):
        return False
    vocab = getattr(self.config.get_text_config(), "vocab_size", None)
    draft_vocab = getattr(draft.config.get_text_config(), "vocab_size", None)
    return isinstance(vocab, int) and isinstance(draft_vocab, int) and draft_vocab <= vocab


def _max_new_tokens(gen_config: Any, width: int) -> int:
    if gen_config.max_new_tokens is not None:
        return int(gen_config.max_new_tokens)
    max_length = gen_config.max_length if gen_config.max_length is not None else 20
    return max(int(max_length) - width, 1)


@torch.no_grad()
def generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``generate`` with hf_dsinfer's decoding loop (see the module docstring)."""
    state: GenerationState = getattr(self, GEN_ATTR)
    restore = None
    if state.runtime is not None:
        args, kwargs, restore = _left_align(args, kwargs)
    if state.lock is None:
        out = _generate(self, state, args, kwargs)
    else:
        with state.lock:  # the static KV cache serves one call at a time
            out = _generate(self, state, args, kwargs)
    return restore(out) if restore is not None else out


_WARNED_RIGHT_PADDING: list[bool] = []


def _left_align(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], Any]:
    """Right-padded (or holed) prompts, which the fused static cache cannot hold, run left-padded: each row's real
    tokens are moved to the end, in order; the outputs are put back in the caller's layout (the prompt as given, then
    the new tokens). Returns ``(args, kwargs, restore)``, ``restore`` None when the prompts were left-aligned already.

    The tokens are those of each prompt run alone. HF's own generation from right padding differs: it predicts the
    first new token at the last (padding) position (transformers warns to pad on the left).
    """
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    mask = kwargs.get("attention_mask")
    if not (isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor) and ids.dim() == 2 and mask.dim() == 2):
        return args, kwargs, None
    if mask.shape != ids.shape or not bool(((mask[:, 1:] != 0) < (mask[:, :-1] != 0)).any()):
        return args, kwargs, None  # no real token is followed by padding
    _, order = torch.sort((mask != 0).to(torch.int8), dim=1, stable=True)  # [B, T]: padding first, order kept
    kwargs = dict(kwargs, attention_mask=mask.gather(1, order))
    if isinstance(kwargs.get("position_ids"), torch.Tensor) and kwargs["position_ids"].shape == ids.shape:
        kwargs["position_ids"] = kwargs["position_ids"].gather(1, order)
    moved = ids.gather(1, order)
    if args:
        args = (moved, *args[1:])
    else:
        kwargs["input_ids" if "input_ids" in kwargs else "inputs"] = moved
    if not _WARNED_RIGHT_PADDING:
        _WARNED_RIGHT_PADDING.append(True)
        logger.info("hf_dsinfer generate: right-padded prompts run left-padded; the outputs keep the caller's layout.")

    def restore(out: Any) -> Any:
        seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        if not isinstance(seqs, torch.Tensor) or seqs.dim() != 2 or seqs.shape[0] % ids.shape[0]:
            return out
        prompt = ids.repeat_interleave(seqs.shape[0] // ids.shape[0], 0).to(seqs.device)  # num_return_sequences
        fixed = torch.cat([prompt, seqs[:, ids.shape[1] :]], dim=1)
        if isinstance(out, torch.Tensor):
            return fixed
        out.sequences = fixed
        return out

    return args, kwargs, restore


def _generate(self: nn.Module, state: GenerationState, args: tuple, kwargs: dict[str, Any]) -> Any:
    kwargs = hf_compat.normalize_cache_kwargs(kwargs)  # the cache under the installed release's keyword
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    _check_input_ids(self, ids, kwargs.get("attention_mask"))
    reason, gen_config = _route(self, state, args, kwargs)
    width = _prompt_width(args, kwargs)
    # max_out_tokens holds on every path (fused or HF's modules), so a request's fate does not depend on whether the
    # architecture has a policy; checked before any work.
    limit = state.runtime.cache.max_tokens if state.runtime is not None else getattr(state.cfg, "max_out_tokens", None)
    if limit is not None and gen_config is not None and width is not None:
        check_capacity(width, _max_new_tokens(gen_config, width), int(limit))
    p = next(self.parameters(), None)
    timer = StepTimer(p.device if p is not None else "cpu")
    call = CallContext(state=state, timer=timer, streamer=kwargs.get("streamer"))
    timer.start()
    out = None
    if reason is None:
        token = CURRENT_CALL.set(call)
        call.draft = kwargs.get("assistant_model")
        try:
            out = state.hf_generate(*args, custom_generate=decoding_loop, **_fast_kwargs(kwargs, gen_config))
        except FastLoopDeclined as declined:  # found once transformers built the processors; nothing was emitted
            reason = declined.reason
            call.path, call.new_tokens, call.draft = "hf", 0, None
        finally:
            CURRENT_CALL.reset(token)
    if reason is not None:
        if reason not in ("no fused layers", _INVALID_CONFIG):  # an invalid config: transformers raises, no warning
            warn_fallback(reason)
        call.path = "hf"
        with forward_marks(self, timer):
            out = state.hf_generate(*args, **kwargs)
    seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
    if isinstance(seqs, torch.Tensor) and seqs.dim() == 2:
        batch = seqs.shape[0]
        new = call.new_tokens or max(seqs.shape[1] - (width or 0), 0)
        stats = timer.finish(batch, width or 0, new, call.path)
        counts = prompt_counts(call, ids, kwargs.get("attention_mask"), batch)
        stats.prompt_tokens_total, stats.prefill_tokens_computed = counts
        record_stats(self, stats)
    return out


def _check_input_ids(model: nn.Module, ids: Any, mask: Any = None) -> None:
    """Refuse prompts no path can serve, before any work: an empty prompt, a mask of another shape, ids outside the
    vocabulary (which would otherwise fail inside torch's embedding, or read another rank's rows under TP). One host
    sync."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape != ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {tuple(ids.shape)}; pass the mask "
            "the tokenizer returned with the ids (one entry per token)."
        )
    if ids.shape[-1] == 0:
        raise ValueError(
            f"input_ids is empty (shape {tuple(ids.shape)}): a prompt needs at least one token; encode it with the "
            "tokenizer's special tokens (e.g. BOS) or pass a non-empty prompt."
        )
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    if int(lo) < 0 or int(hi) >= vocab:
        raise ValueError(
            f"input_ids hold ids outside the vocabulary [0, {vocab}) (min {int(lo)}, max {int(hi)}); encode the "
            "prompt with this model's tokenizer."
        )


def _fast_kwargs(kwargs: dict[str, Any], gen_config: Any) -> dict[str, Any]:
    """``generate``'s arguments for a fast-loop call.

    * The streamer is held by the call context (the loop feeds it the prompt and the tokens), so a request the loop
      declines after transformers' preparation can rerun on transformers' loop without streaming the prompt twice.
    * transformers hands no ``tokenizer`` to a ``custom_generate`` callable, which its stop-string criterion needs: the
      loop gets that criterion built here instead (with ``stop_strings`` cleared so transformers does not build one).
    """
    # the draft model is the call context's: transformers would otherwise prepare an assisted run of its own
    out = {k: v for k, v in kwargs.items() if k not in ("streamer", "assistant_model")}
    stops = getattr(gen_config, "stop_strings", None)
    tokenizer = kwargs.get("tokenizer")
    if stops and tokenizer is not None:
        out["stopping_criteria"] = stop_string_criteria(tokenizer, stops)
        out["stop_strings"] = None
    return out
