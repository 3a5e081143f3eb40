"""The answer side of the generating routes: one :class:`ChoiceState` per choice (its engine request's tokens turned
into text incrementally, cut at stop strings, with the log-probs of the tokens each piece of text carries), and
OpenAI's response shapes for log-probs.

Text. Each new token's text comes from an :class:`~.detokenizer.IncrementalDetokenizer` (constant work per token).
The token that ended the request (EOS or one of ``stop_token_ids``) adds no text unless
``include_stop_str_in_output`` (vLLM's rule). Stop strings are searched only in the text a token added plus the
longest stop string's length before it; the first one found ends the text (before it, or after it with
``include_stop_str_in_output``) and cancels the engine request. Streaming holds back the last ``len(stop) - 1``
characters, which could be the start of a stop string, until they cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer, token_bytes

__all__ = ["ChoiceState", "Piece", "chat_logprobs", "completion_logprobs", "vllm_prompt_logprobs"]

#: engine finish reasons -> OpenAI's (vLLM answers "abort" for a cancelled request)
_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


@dataclass
class Piece:
    """What a choice can send now: new ``text`` and the indices ``[start, end)`` of the tokens it carries."""

    text: str
    start: int
    end: int


@dataclass
class ChoiceState:
    """One choice: its engine request's handle and what has been made of its tokens so far."""

    index: int
    prompt_index: int
    tokenizer: Any
    stops: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: frozenset[int] = frozenset()  # tokens that end the request (EOS unless ignore_eos, stop ids)
    min_tokens: int = 0
    handle: Any = None
    text: str = ""  # the text so far (cut at a stop string once found)
    ends: list[int] = field(default_factory=list)  # ends[i]: len(text) once token i was added
    consumed: int = 0  # tokens of the handle read so far
    sent_chars: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """The tokens this choice answers with (up to the one that completed a stop string)."""
        return list(self.handle.tokens[: self.consumed]) if self.handle is not None else []

    def advance(self) -> None:
        """Read the handle's new tokens; sets :attr:`finish_reason` once the choice is complete."""
        if self.done:
            return
        h = self.handle
        finished = h.done  # read before the tokens: once done, the tokens are final
        tokens = h.tokens
        upto = len(tokens)
        while self.consumed < upto:
            token = int(tokens[self.consumed])
            self.consumed += 1
            ends_request = token in self.stop_token_ids and self.consumed > self.min_tokens
            piece = "" if ends_request and not self.include_stop else self._detok.step(token)
            self.text += piece
            self.ends.append(len(self.text))
            if piece and self.stops and self._cut_at_stop(len(piece)):
                h.stop_reason = self.stop_reason  # set before cancelling: /metrics counts it as "stop", not "abort"
                h.cancel()  # the engine stops generating for this choice before its next step
                return
        if finished and self.consumed >= len(h.tokens):
            tail = self._detok.flush()  # a character the last token left incomplete, as tokenizer.decode shows it
            if tail:
                self.text += tail
                if self.ends:
                    self.ends[-1] = len(self.text)
            self.finish_reason = _FINISH.get(h.finish_reason, h.finish_reason)
            self.stop_reason = h.stop_reason if h.finish_reason == "stop" else None
            self.error = h.error

    def _cut_at_stop(self, added: int) -> bool:
        start = max(0, len(self.text) - added - self._longest + 1)
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits, key=lambda h: (h[0], -len(h[1])))
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        self.ends[-1] = len(self.text)
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def pending(self, interval: int = 1) -> Piece | None:
        """The text and tokens not streamed yet that may go now (None: nothing yet, or fewer than ``interval`` new
        tokens while running). Marks them as sent."""
        if not self.done and self.consumed - self.sent_tokens < interval:
            return None
        safe = len(self.text)
        if not self.done and self._longest:
            safe = max(self.sent_chars, safe - self._longest + 1)
        end = self.sent_tokens
        while end < self.consumed and (self.done or self.ends[end] <= safe):
            end += 1
        if safe == self.sent_chars and end == self.sent_tokens:
            return None
        piece = Piece(self.text[self.sent_chars : safe], self.sent_tokens, end)
        self.sent_chars, self.sent_tokens = safe, end
        return piece

    def logprob_entries(self, start: int = 0, end: int | None = None) -> list[Any]:
        """The engine's :class:`~.requests.TokenLogprobs` of tokens ``[start, end)`` (empty when none were asked)."""
        entries = self.handle.logprobs if self.handle is not None else None
        if entries is None:
            return []
        return list(entries[start : self.consumed if end is None else end])

    def offsets(self, start: int, end: int, base: int = 0) -> list[int]:
        """Character offset in the text (plus ``base``) where each token of ``[start, end)`` begins."""
        return [base + (self.ends[i - 1] if i > 0 else 0) for i in range(start, end)]


def _token_text(tokenizer: Any, token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else tokenizer.decode([token])


def chat_logprobs(tokenizer: Any, entries: list[Any], as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _token_text(tokenizer, token, as_ids), "logprob": max(logprob, -9999.0),
                "bytes": token_bytes(tokenizer, token)}  # fmt: skip

    content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content}


def completion_logprobs(tokenizer: Any, entries: list[Any], offsets: list[int], as_ids: bool = False,
                        prompt: list[Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """OpenAI's completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}``. ``prompt``:
    ``(token, entry or None)`` pairs of an echoed prompt, put first (the first prompt token has no log-prob)."""
    tokens, values, tops = [], [], []
    for token, entry in [*(prompt or []), *((e.token, e) for e in entries)]:
        tokens.append(_token_text(tokenizer, token, as_ids))
        values.append(None if entry is None else max(entry.logprob, -9999.0))
        if entry is None:
            tops.append(None)
        else:  # the token itself is among its top entries, as OpenAI's answers have it
            top = {_token_text(tokenizer, t, as_ids): max(lp, -9999.0) for t, lp in entry.top}
            if entry.top:
                top.setdefault(tokens[-1], values[-1])
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Any, prompt_ids: list[int], entries: list[Any] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{id: {logprob, rank, decoded_token}}`` with
    the token itself and its k most likely alternatives."""
    if entries is None:
        return None
    out: list[Any] = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        ranked = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": tokenizer.decode([t])}
                  for r, (t, lp) in enumerate(entry.top)}  # fmt: skip
        ranked.setdefault(str(token), {"logprob": entry.logprob, "rank": entry.rank,
                                       "decoded_token": tokenizer.decode([token])})  # fmt: skip
        out.append(ranked)
    return out
