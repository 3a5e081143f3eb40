"""A draft model for the serving engine's speculation (vLLM's ``{"model": PATH, "num_speculative_tokens": k}``).

The draft is loaded with the target's dtype and position-table length; when its architecture has a policy it is
fused and runs over its own paged KV cache (a second :class:`~.runner.PagedRunner`, its own blocks), else it runs
transformers' forward on the whole sequence per proposed token (one warning: correct, slow). Each request that may
speculate (:func:`~.speculation.may_speculate`) keeps a draft-side copy of its sequence: before a step the draft
catches up with the tokens it has not computed (the previous step's accepted proposals and the target's own token; the
KV it wrote for rejected proposals is simply overwritten, as in the target's cache), then proposes ``k`` tokens
greedily, one draft step each; each draft step runs all the speculating requests together (a ragged step of the
draft, as the target's). The engine verifies them like n-gram proposals (:func:`~.speculation.verify`): greedy
requests keep plain decoding's tokens; sampled ones keep the target's distribution (a greedy draft is a point mass).

The draft must share the target's vocabulary: the same LM-head size and, where both folders have a tokenizer, the
same token-to-id map; otherwise it is refused (a ``ValueError`` naming ``speculative_config``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..log import logger
from .blocks import OutOfBlocks
from .requests import SamplingParams, Sequence
from .scheduler import StepPlan
from .speculation import SpeculativeConfig, may_speculate, room_for

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def load_draft(path: Any, target: nn.Module, max_positions: int, target_vocab: int) -> nn.Module:
    """The draft model at ``path`` in ``target``'s dtype and on its device (fused where a policy exists); refused when
    its vocabulary differs from the target's (``target_vocab`` logits per token). ``path`` may be a loaded model
    (``generate_batch(assistant_model=...)``): it is used as it is, and must sit on the target's device."""
    import transformers

    weight = target.get_output_embeddings().weight
    if isinstance(path, nn.Module):
        where = path.get_output_embeddings().weight.device
        if where != weight.device:
            raise ValueError(f"assistant_model is on {where}, the model on {weight.device}: move it there first")
        check_same_vocabulary(type(path).__name__, path, target, target_vocab)
        return path.eval()
    config = {"dtype": _DTYPES.get(weight.dtype, "fp32"), "max_out_tokens": int(max_positions)}
    try:
        draft = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=config)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config model={path!r}: the draft model could not be loaded ({e})") from e
    draft = draft.to(weight.device).eval()
    check_same_vocabulary(path, draft, target, target_vocab)
    return draft


def check_same_vocabulary(path: str, draft: nn.Module, target: nn.Module, target_vocab: int) -> None:
    """Raise ``ValueError`` unless ``draft`` and ``target`` produce the same token ids (LM-head rows, tokenizers)."""
    dv, tv = draft.get_output_embeddings().weight.shape[0], target_vocab
    if dv != tv:
        raise ValueError(f"speculative_config model={path!r}: the draft's vocabulary has {dv} tokens, the target's "
                         f"{tv}: a draft model must use the target's tokenizer (pick a smaller model of the same "
                         "family)")  # fmt: skip
    vocabs = [_tokenizer_vocab(m) for m in (draft, target)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise ValueError(f"speculative_config model={path!r}: the draft's tokenizer maps tokens to other ids than the "
                         f"target's (e.g. {differ}): a draft model must use the target's tokenizer")  # fmt: skip


def _tokenizer_vocab(model: nn.Module) -> dict[str, int] | None:
    """The token-to-id map of the tokenizer saved beside ``model`` (None when there is none to read)."""
    import transformers

    path = getattr(model, "name_or_path", None) or getattr(model.config, "name_or_path", None)
    if not path:
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path).get_vocab()
    except Exception:  # noqa: BLE001 - no tokenizer saved (or unreadable): the LM-head size is the check left
        return None


def _name(model: Any) -> str:
    return model if isinstance(model, str) else getattr(model, "name_or_path", None) or type(model).__name__


class DraftSpeculator:
    """Greedy draft-model proposals per request for the scheduler (module docstring)."""

    def __init__(self, config: SpeculativeConfig, runner: Any):
        from .runner import PagedRunner, unsupported_reason

        self.config = config
        self.draft = load_draft(config.model, runner.model, runner.max_positions, runner.vocab)
        self.runner = None  # the draft's PagedRunner when it is fused
        reason = unsupported_reason(self.draft)
        if reason is None:
            blocks = runner.blocks
            self.runner = PagedRunner(self.draft, block_size=blocks.block_size, num_blocks=blocks.num_blocks)
        else:
            logger.warning("hf_dsinfer serving: the draft model %s runs unfused, recomputing its whole sequence for "
                           "each proposed token (%s): expect little or no speed-up",
                           _name(config.model), reason)  # fmt: skip
        self.params = SamplingParams(max_new_tokens=1, eos_token_ids=frozenset())  # the draft's own steps: argmax
        self.states: dict[int, Sequence] = {}  # id(request) -> the draft's copy of its sequence (fused draft)
        self.ready: dict[int, list[int]] = {}  # id(request) -> this step's proposal (fused draft, begin_step)
        # an assistant model loaded with a shorter position table than the target's proposes only within it
        own = self.runner.max_positions if self.runner is not None else runner.max_positions
        self.max_positions = min(runner.max_positions, own)

    def begin_step(self, running: list[Sequence]) -> None:
        """Before the scheduler plans a step: free the draft-side state (and blocks) of requests no longer running
        (finished, preempted), then (fused draft) propose for every running request that may speculate, all of them
        in each draft step (``k`` draft steps in all, whatever the number of requests)."""
        keep = {id(seq) for seq in running}
        for key in [k for k in self.states if k not in keep]:
            self._drop(key)
        self.ready = {}
        if self.runner is None:
            return
        states, out = [], {}
        for seq in running:
            room = room_for(seq, self.config.num_speculative_tokens, self.config.num_speculative_tokens + 1,
                            self.max_positions) if may_speculate(seq) else 0  # fmt: skip
            state = self._catch_up(seq, room) if room > 0 else None
            if state is not None:
                states.append((seq, state, room))
                out[id(seq)] = []
        while states:  # one draft step: for each request, the tokens the draft has not computed, then its argmax
            picks = self.runner.run(StepPlan(chunks=[(st, len(st.tokens) - st.num_computed) for _, st, _ in states]))
            for seq, st, room in states:
                st.num_computed = len(st.tokens)
                out[id(seq)].append(picks[id(st)])
                if len(out[id(seq)]) < room:  # the last proposal is never fed to the draft
                    st.tokens.append(picks[id(st)])
            states = [(seq, st, room) for seq, st, room in states if len(out[id(seq)]) < room]
        self.ready = out

    def _drop(self, key: int) -> None:
        state = self.states.pop(key)
        self.runner.blocks.release_all(state.block_table)

    def proposal(self, seq: Sequence, budget: int, max_positions: int | None) -> list[int]:
        """Up to ``k`` tokens the draft proposes after ``seq``'s tokens (``[]``: it decodes one token): those made in
        :meth:`begin_step` (fused draft), cut to this step's room, or the unfused draft's, made now."""
        if not may_speculate(seq):
            return []
        room = room_for(seq, self.config.num_speculative_tokens, budget, max_positions)
        if room <= 0:
            return []
        if self.runner is None:
            return self._eager(seq.tokens, room)
        return self.ready.get(id(seq), [])[:room]  # a cut proposal's extra draft KV is overwritten next time

    def _catch_up(self, seq: Sequence, room: int) -> Sequence | None:
        """The draft's copy of ``seq``: its computed prefix cut to where it still matches ``seq``'s tokens, with blocks
        for ``room`` proposals more (None, and no state kept, when the draft's cache has no room)."""
        state = self.states.get(id(seq))
        if state is None:
            state = Sequence(request_id=f"draft:{seq.request_id}", prompt=list(seq.prompt), params=self.params,
                             handle=None)  # fmt: skip
            self.states[id(seq)] = state
        same = 0
        limit = min(state.num_computed, len(seq.tokens) - 1)  # the last token always runs: its logits are needed
        while same < limit and state.tokens[same] == seq.tokens[same]:
            same += 1
        state.tokens, state.num_computed = list(seq.tokens), same
        bs = self.runner.blocks.block_size
        try:  # positions up to len(tokens) - 1 + room - 1: the last proposal is never fed to the draft
            while len(state.block_table) * bs < len(seq.tokens) + room - 1:
                state.block_table.append(self.runner.blocks.allocate())
        except OutOfBlocks:
            self._drop(id(seq))
            return None
        return state

    @torch.no_grad()
    def _eager(self, tokens: list[int], room: int) -> list[int]:
        """Greedy proposals of an unfused draft: its forward on the whole sequence per token (no cache kept)."""
        device = self.draft.get_output_embeddings().weight.device
        ids = list(tokens)
        for _ in range(room):
            logits = self.draft(input_ids=torch.tensor([ids], device=device), use_cache=False).logits  # [1, L, V]
            ids.append(int(logits[0, -1].argmax()))
        return ids[len(tokens) :]
