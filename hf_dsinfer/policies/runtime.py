"""The fused forward of an injected model: HF's call signature in, HF's outputs out, the static cache inside.

The forward replaces the model's own (instance-level), so HF's ``generate`` works unchanged: its first call brings
an empty ``DynamicCache`` (a fresh sequence), and every output carries an :class:`InjectedCache`, a transformers
``Cache`` adapter over the static cache, which ``generate`` hands back on the next step. Inputs the fused path
cannot serve exactly raise a ``ValueError`` naming the argument; nothing falls back silently.
"""

from __future__ import annotations

from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .. import hf_compat
from ..modules import FusedNorm, RotaryTable, StaticKVCache, StepContext
from ..modules.linear import head_forward

if TYPE_CHECKING:
    from .base import Policy

# Keyword arguments accepted whatever their value; any other keyword must be None or False.
_IGNORED = ("cache_position",)


class Runtime:
    """Per-model state of an injected model: policy, fused layers, final norm, rotary table, static cache."""

    def __init__(
        self,
        policy: Policy,
        layers: nn.ModuleList,
        final_norm: FusedNorm | None,
        rotary: RotaryTable | None,
        cache: StaticKVCache,
    ):
        self.policy = policy
        self.layers = layers
        self.final_norm = final_norm
        self.rotary = rotary
        self.cache = cache

    # -- input checks (no state changes) ----------------------------------------------------------------------------

    def _is_fresh(self, past_key_values: Any) -> bool:
        """True when this call starts a new sequence; raises for caches the fused path cannot continue."""
        if past_key_values is None:
            return True
        if isinstance(past_key_values, InjectedCache):
            if past_key_values.runtime is not self:
                raise ValueError("past_key_values belongs to another injected model; pass this model's own cache.")
            if past_key_values.epoch != self.cache.epoch:
                raise ValueError(
                    "past_key_values is stale: this model has started another sequence since (one static cache per "
                    "model). Run the prompt again, or finish one generation before starting the next."
                )
            return False
        if isinstance(past_key_values, Cache) and past_key_values.get_seq_length() == 0:
            return True  # generate's empty DynamicCache (or any empty cache): a fresh sequence
        raise ValueError(
            f"past_key_values of type {type(past_key_values).__name__} with content cannot be continued by the fused "
            "layers (they keep their own static KV cache); pass None or the past_key_values this model returned."
        )

    @staticmethod
    def _start_offsets(
        mask: torch.Tensor | None, batch: int, width: int, past: int, device: torch.device
    ) -> torch.Tensor:
        """Left padding of each row among the new ``width`` tokens, ``[B]`` int32, from the 2D ``attention_mask``."""
        if mask is None:
            return torch.zeros(batch, dtype=torch.int32, device=device)
        if mask.ndim != 2:
            raise ValueError(
                f"attention_mask with {mask.ndim} dims is not supported by the fused layers: pass the 2D "
                "[batch, past + new tokens] padding mask (custom 4D masks need HF's own modules)."
            )
        if tuple(mask.shape) != (batch, past + width):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but the fused layers expect (batch, past + new tokens) "
                f"= ({batch}, {past + width}): pass the mask of the whole sequence so far."
            )
        new = (mask[:, -width:] != 0).to(torch.int32)  # [B, T]
        if width > 1:  # prefill: one host sync to prove the padding is on the left (decode steps stay sync-free)
            holes = (new[:, 1:] < new[:, :-1]).any()
            if past:
                holes = holes | ((mask[:, :past] != 0).any(-1) & (new[:, 0] == 0)).any()
            if bool(holes):
                raise ValueError(
                    "attention_mask has padding after real tokens; the fused layers support left padding only "
                    "(tokenizer padding_side='left')."
                )
        return (width - new.sum(-1)).to(torch.int32)

    def _positions(
        self,
        position_ids: torch.Tensor | None,
        mask: torch.Tensor | None,
        start: torch.Tensor,
        batch: int,
        width: int,
        past: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Rotary positions ``[B, T]``: the given ``position_ids`` or the policy's default (HF's rule)."""
        if position_ids is None:
            return self.policy.default_position_ids(mask, past, batch, width, device)
        pos = position_ids if position_ids.ndim == 2 else position_ids.reshape(1, -1)
        if pos.shape[-1] != width or pos.shape[0] not in (1, batch):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected ({batch}, {width}).")
        pos = pos.to(device).expand(batch, width)
        # Padding tokens never reach attention; give them position 0 so any value HF put there is in range.
        real = torch.arange(width, device=device)[None] >= start[:, None].long()  # [B, T]
        pos = torch.where(real, pos, torch.zeros_like(pos))
        if width > 1 and self.rotary is not None:  # prefill only: one sync; decode positions come from generate
            lo, hi = int(pos.min()), int(pos.max())
            if lo < 0 or hi >= self.rotary.max_positions:
                raise ValueError(
                    f"position_ids span [{lo}, {hi}] but the rotary table covers [0, {self.rotary.max_positions}) "
                    f"(max_out_tokens={self.cache.max_tokens}); raise max_out_tokens."
                )
        return pos

    # -- the forward -------------------------------------------------------------------------------------------------

    def run(
        self,
        model: nn.Module,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        past_key_values: Any,
        extra: dict[str, Any],
    ) -> tuple[torch.Tensor, InjectedCache]:
        """Embed, run the fused layers over the static cache, apply the final norm; ``(hidden [B, T, C], cache)``."""
        for key, value in extra.items():
            # cache_position: 5.x decoders ignore it as well (the cache knows its own length).
            if value is None or value is False or key in _IGNORED:
                continue
            raise ValueError(f"{key}={value!r} is not supported by the fused layers (replace_with_kernel_inject=True).")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref.ndim != (2 if input_ids is not None else 3) or ref.shape[1] == 0:
            raise ValueError(
                f"expected input_ids [batch, tokens] or inputs_embeds [batch, tokens, hidden] with tokens "
                f"> 0, got shape {tuple(ref.shape)}"
            )
        batch, width = ref.shape[:2]
        device = ref.device
        cache = self.cache
        fresh = self._is_fresh(past_key_values)
        cache.check_room(width, fresh)
        if not fresh and batch != cache.batch:
            raise ValueError(
                f"batch {batch} differs from the batch {cache.batch} of the cached sequence; "
                "start a new sequence (pass no cache)."
            )
        past = 0 if fresh else cache.padded_len
        start = self._start_offsets(attention_mask, batch, width, past, device)  # [B] int32
        positions = self._positions(position_ids, attention_mask, start, batch, width, past, device)  # [B, T]

        # -- from here on, state changes --
        if input_ids is not None:
            hidden = self.policy.embed(model, input_ids, positions)  # [B, T, C]
        else:
            hidden = self.policy.embed_inputs(model, inputs_embeds, positions)
        if fresh:
            cache.start(batch, device, hidden.dtype)
        if self.rotary is not None and self.rotary.cos.device != device:
            self.rotary.to(device)
        cache_lens = cache.lengths[:batch]  # [B] int32, lengths before this step
        seq_lens = cache_lens + (1 - start) if width == 1 else None  # [B] decode: lengths including the new token
        ctx = StepContext(cache, start, cache_lens, positions.reshape(-1), self.rotary, seq_lens)
        hidden = self.run_layers(model, hidden, ctx)
        cache.advance(width - start, width)
        return hidden, InjectedCache(self)

    def run_layers(self, model: nn.Module, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The fused layers, the final norm and the policy's last touch (``hidden [B, T, C]`` in and out).

        Shared by the full forward above and the graph-captured decode step in ``generation/decode.py``.
        """
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden) if residual is None else self.final_norm(hidden, residual)[0]
        elif residual is not None:
            hidden = hidden + residual
        return self.policy.finalize_hidden(model, hidden)


class InjectedCache(Cache):
    """The transformers ``Cache`` an injected model returns: a handle on its static KV cache.

    ``get_seq_length()`` is the padded sequence length HF believes in (prompt width plus generated tokens); the
    real per-row lengths live on the device. It is valid until the model starts another sequence.

    It holds no transformers cache layers (``layers=[]``), so every ``Cache`` member that reads ``self.layers`` is
    overridden here: inherited, they would describe an empty cache (``all([]) is True`` made it look "linear" to
    5.24's ``generate``, which then skipped trimming the tokens already cached). ``tests/test_injected_cache.py``
    fails when a transformers release adds a ``Cache`` member this class does not decide on (:data:`CACHE_MEMBERS`).
    """

    def __init__(self, runtime: Runtime):
        super().__init__(layers=[])
        self.runtime = runtime
        self.epoch = runtime.cache.epoch

    def __len__(self) -> int:
        return len(self.runtime.layers)

    def __repr__(self) -> str:
        return f"InjectedCache(seq_len={self.get_seq_length()}, batch={self.batch_size})"

    # -- what kind of cache this is (one entry per layer: full attention, in the static cache) ----------------------

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self)  # attention layers: generate trims tokens already cached

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self)  # every position is kept (the fused layers apply any window themselves)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self)

    @property
    def is_croppable(self) -> bool:
        return True  # crop() rolls back the lengths exactly (assisted decoding, prompt lookup)

    @property
    def is_compileable(self) -> bool:
        return False  # keeps generate on 2D masks (the fused forward derives padding from them)

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return self.runtime.cache.batch

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return False  # nothing is dropped from the static cache, so there is no past to record

    def activate_past_recording(self) -> None:
        return None  # see is_recording_past

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return False  # no linear-attention (recurrent) layers

    # -- lengths ------------------------------------------------------------------------------------------------------

    def _live(self) -> StaticKVCache:
        if self.epoch != self.runtime.cache.epoch:
            raise ValueError("this cache is stale: the model has started another sequence since.")
        return self.runtime.cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._live().padded_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.runtime.cache.max_tokens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.runtime.cache.max_tokens  # transformers 5.17-5.23

    @property
    def max_cache_len(self) -> int:
        return self.runtime.cache.max_tokens  # transformers 5.17-5.23

    @property
    def max_batch_size(self) -> int:
        return self.runtime.cache.max_batch_size  # transformers 5.17-5.23

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the last tokens of every row: ``crop(-n)`` removes ``n`` tokens (transformers 5.24's
        convention); a positive value is the length to keep (the older ``crop(max_length)``)."""
        cache = self._live()
        n = -tokens_to_remove if tokens_to_remove <= 0 else cache.padded_len - tokens_to_remove
        if n <= 0:
            return
        if n > cache.padded_len:
            raise ValueError(f"cannot remove {n} tokens from a cache of {cache.padded_len}")
        cache.lengths[: cache.batch] -= n  # the slots past the new lengths are overwritten by the next step
        cache.padded_len -= n

    # -- writes: the fused layers own them ---------------------------------------------------------------------------

    def update(self, *args: Any, **kwargs: Any):
        raise RuntimeError("InjectedCache is written by the fused layers only; HF attention modules cannot update it.")

    def reset(self) -> None:
        self._live().reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._live().reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("expanding the fused static cache after prefill is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("selecting rows of the fused static cache is not supported")

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        return None  # the static cache is allocated when the model is injected

    def offload(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("offloading the fused static cache is not supported")

    def prefetch(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("offloading the fused static cache is not supported")

    def _no_state(self, *args: Any, **kwargs: Any):
        raise RuntimeError("the fused static cache holds attention keys and values only (no recurrent/indexer state)")

    get_conv_state = get_recurrent_state = update_conv_state = update_recurrent_state = update_indexer = _no_state


# Every public ``Cache`` member the installed transformers has must be decided on here (tests/test_injected_cache.py).
CACHE_MEMBERS_INHERITED = frozenset({"__init__"})  # members whose inherited behaviour is right as it is


def _slice_to_keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
    return hidden[:, logits_to_keep]


def install_causal_lm_forward(model: nn.Module, runtime: Runtime) -> None:
    """Bind fused forwards on ``model`` (a ``*ForCausalLM`` or a bare base model) and on its base model."""
    base = model.base_model

    def base_forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple:
        """Fused replacement of the base model's forward: last hidden state and the cache handle.

        The cache comes as ``cache`` (transformers 5.24+) or ``past_key_values`` (earlier releases, and callers that
        keep the old name)."""
        past = hf_compat.resolve_cache(cache, past_key_values)
        hidden, handle = runtime.run(self, input_ids, inputs_embeds, attention_mask, position_ids, past, kwargs)
        out = hf_compat.make_output(
            BaseModelOutputWithPast, last_hidden_state=hidden, cache=handle if use_cache is not False else None
        )
        return out if return_dict is not False else out.to_tuple()

    def causal_lm_forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """Fused replacement of the causal LM's forward (same arguments and outputs as HF's; the cache under either
        name, see ``base_forward``)."""
        past = hf_compat.resolve_cache(cache, past_key_values)
        hidden, handle = runtime.run(self, input_ids, inputs_embeds, attention_mask, position_ids, past, kwargs)
        # the fused linears' CPU paths (row GEMV / prepacked / oneDNN by row count); anything else is head(x)
        logits = head_forward(self.get_output_embeddings(), _slice_to_keep(hidden, logits_to_keep))  # [B, T', V]
        logits = runtime.policy.finalize_logits(self, logits)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        out = hf_compat.make_output(
            CausalLMOutputWithPast, loss=loss, logits=logits, cache=handle if use_cache is not False else None
        )
        return out if return_dict is not False else out.to_tuple()

    # base.forward receives the base model, the top-level forward the top-level model.
    base.forward = MethodType(base_forward, base)
    if model is not base:
        model.forward = MethodType(causal_lm_forward, model)
