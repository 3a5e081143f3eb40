"""Incremental detokenization for ``hf-dsinfer serve``: the text of each new token with constant work per token.

Decoding the whole output again after every token costs O(length) per token, O(length^2) per request. A fast
(Rust) tokenizer gets ``tokenizers.decoders.DecodeStream``, which keeps a small window of the last tokens and gives
the new text once it is whole UTF-8; other tokenizers (or ones that clean up spaces after decoding, which a window
cannot reproduce) get a prefix-offset window over ``tokenizer.decode``, the scheme vLLM uses for slow tokenizers.
Either way the pieces joined equal ``tokenizer.decode(tokens, skip_special_tokens=...)`` of the same tokens.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

__all__ = ["IncrementalDetokenizer", "token_bytes"]


class IncrementalDetokenizer:
    """The text of a growing token sequence: :meth:`step` returns the text one more token adds ("" while the token
    ends inside a multi-byte character: that text comes with a later token)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # window start and the first token whose text is not out yet

    def step(self, token_id: int) -> str:
        ids = self._ids
        ids.append(int(token_id))
        if self._stream is not None:
            out = self._stream.step(self._backend, int(token_id))
            if out:
                self._ids = []  # held ids: those since the last text out (they start on a character boundary)
            return out or ""
        before = self.tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(ids[self._prefix :], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new, or a character still incomplete
        self._prefix, self._read = self._read, len(ids)
        return after[len(before) :]

    def flush(self) -> str:
        """The text of the tokens still held at the end of the output (a character cut by the last token: as
        ``tokenizer.decode`` writes it, with replacement characters)."""
        if self._stream is not None:
            held, self._ids = self._ids, []
            return self.tokenizer.decode(held, skip_special_tokens=self.skip) if held else ""
        ids = self._ids
        before = self.tokenizer.decode(ids[self._prefix : self._read], skip_special_tokens=self.skip)
        after = self.tokenizer.decode(ids[self._prefix :], skip_special_tokens=self.skip)
        self._prefix = self._read = len(ids)
        return after[len(before) :]


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others for 256 + i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The UTF-8 bytes one token stands for (OpenAI's ``bytes`` of a log-prob entry): exact for byte-level BPE and
    byte-fallback tokens, whose text alone may be part of a character; the token's decoded text otherwise."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if piece is not None and backend is not None and type(backend.decoder).__name__ == "ByteLevel":
        alphabet = _byte_level_alphabet()
        if all(ch in alphabet for ch in piece):
            return [alphabet[ch] for ch in piece]
    if piece is not None and (m := _BYTE_FALLBACK.match(piece)):
        return [int(m.group(1), 16)]
    return list(tokenizer.decode([int(token_id)]).encode("utf-8"))
