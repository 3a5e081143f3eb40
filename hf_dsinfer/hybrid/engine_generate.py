"""The Hybrid Engine's generation side: ``generate``, ``generate_batch``, scoring and the per-call statistics.

A mixin of :class:`~hf_dsinfer.hybrid.engine.HybridEngine` (kept apart so each file stays small); it reads the
engine's ``module`` (the inference copy), ``weights``, ``tp``, ``stats`` and switching methods.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from .. import hf_compat
from ..generation.api import GEN_ATTR, _max_new_tokens, _prompt_width
from ..generation.loop import check_capacity
from ..generation.processors import resolve_generation_config


class GenerateMixin:
    """``generate`` / ``generate_batch`` / ``__call__`` of the Hybrid Engine (see its docstring)."""

    @torch.no_grad()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """HF ``generate`` arguments in, HF ``generate`` output out, run by the inference copy.

        Outside inference mode this switches in for the call and back afterwards (a refresh each time: call
        ``eval()`` first to generate several times from one refresh).
        """
        if not self._in_inference:
            with self.inference():
                return self.generate(*args, **kwargs)
        hf = self.weights.hf_model
        if self.module is not None:
            self.module.generation_config = hf.generation_config  # the user's generation defaults, shared
        record_before = self.last_generate_stats
        t0 = self._now()
        if self.tp is None:
            out = self._generate(args, kwargs)
        else:  # the inference group generates its ranks' prompts as one batch; this rank gets its rows back
            out = self.tp.generate(lambda **kw: self._generate((), kw), self.module, self.device, args, kwargs)
        elapsed = self._now() - t0
        seqs = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        it = self.stats.last
        if it is not None:
            it.generate_ms += elapsed * 1e3
            it.generate_calls += 1
            if isinstance(seqs, torch.Tensor) and seqs.ndim == 2:
                prompt = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
                width = prompt.shape[-1] if isinstance(prompt, torch.Tensor) else 0
                it.samples += seqs.shape[0]
                it.new_tokens += seqs.shape[0] * max(0, seqs.shape[1] - width)
                record = self.last_generate_stats
                if record is not None and record is not record_before:  # this call's (sampling="hf" keeps none)
                    it.prompt_tokens += record.prompt_tokens_total
                    it.prefill_tokens_computed += record.prefill_tokens_computed
                if self.logp_probe_rows and it.generate_calls == 1 and isinstance(prompt, torch.Tensor):
                    it.logp_diff = self._probe(seqs, prompt, kwargs)
        return out

    def _probe(self, seqs: torch.Tensor, prompt: torch.Tensor, kwargs: dict[str, Any]) -> float | None:
        """The ``logp_diff`` probe on this call's first rows (see :mod:`.probe`); None where it cannot run."""
        if self.module is None or self.tp is not None:
            return None
        from .probe import logp_diff

        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.shape == prompt.shape else torch.ones_like(prompt)
        gen_config = resolve_generation_config(self.module, kwargs)
        sampled = gen_config is not None and gen_config.do_sample
        temperature = float(gen_config.temperature or 1.0) if sampled else 1.0
        training = self.weights.peft_model or self.weights.hf_model
        return logp_diff(self.module, training, seqs, mask, self.logp_probe_rows, temperature)

    def generate_batch(self, inputs: list[list[int]], generation_config: Any = None, **kwargs: Any) -> dict[str, Any]:
        """transformers' ``generate_batch`` (continuous batching) API on the inference copy: hf_dsinfer's paged engine
        (continuous batching, prompt blocks shared by a prompt's completions), or left-padded batches through
        ``generate`` under ``inference_tp_size > 1`` (:mod:`hf_dsinfer.hybrid.batch`). Returns
        ``{request_id: GenerationOutput}`` in transformers' order."""
        from .batch import generate_batch

        return generate_batch(self, inputs, generation_config, **kwargs)

    def _generate(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The inference copy's ``generate`` (hf_dsinfer's fast loop), or transformers' loop on the same copy for
        sampled requests with ``sampling="hf"``; the training model's own ``generate`` when the engine is disabled."""
        if self.module is None:
            # The class's generate: an instance-level one may be HybridEngineCallback's router, which calls us.
            peft_model = self.weights.peft_model
            target = peft_model if peft_model is not None else self.weights.hf_model
            return type(target).generate(target, *args, **kwargs)
        state = getattr(self.module, GEN_ATTR, None)
        if self.sampling == "hf" and state is not None and self._samples(kwargs):
            width = _prompt_width(args, kwargs)
            if state.runtime is not None and width is not None:
                gen_config = resolve_generation_config(self.module, kwargs)
                if gen_config is not None:  # an invalid config: transformers' generate raises its own error below
                    check_capacity(width, _max_new_tokens(gen_config, width), state.runtime.cache.max_tokens)
            with state.lock or nullcontext():  # one static cache: concurrent calls take turns
                # transformers' generate, bound to the inference copy (the cache under the installed keyword)
                return state.hf_generate(*args, **hf_compat.normalize_cache_kwargs(kwargs))
        # TRL's disable_compile=True turns off transformers' torch.compile of the training model's forward; the
        # engine owns how its copy runs, so its own decode step (compiled on CPU, graphs on CUDA) stays on.
        return self.module.generate(*args, **kwargs)

    def _request_flag(self, kwargs: dict[str, Any], name: str) -> bool:
        """A generation flag of this request: from the call, else its generation config, else the model's."""
        if name in kwargs:
            return bool(kwargs[name])
        config = kwargs.get("generation_config") or self.module.generation_config
        return bool(getattr(config, name, False))

    def _samples(self, kwargs: dict[str, Any]) -> bool:
        """Whether this request samples (``do_sample`` from the call, its generation config, or the defaults)."""
        return self._request_flag(kwargs, "do_sample")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The inference copy's forward (no gradients), e.g. to score sequences with the refreshed weights."""
        with torch.no_grad():
            if self.tp is not None:  # the group scores its ranks' rows together (hybrid/tp.py)
                return self.tp.forward(self.module, self.device, args, kwargs)
            return (self.module or self.weights.hf_model)(*args, **kwargs)

    @property
    def last_generate_stats(self) -> Any:
        """The generation layer's stats of the last ``generate`` call (time to first token, ms/token), if recorded."""
        try:
            from ..generation.stats import last_generate_stats
        except ImportError:  # pragma: no cover
            return None
        return last_generate_stats(self.module) if self.module is not None else None

