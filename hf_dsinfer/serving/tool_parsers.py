"""Tool-call parsers (``--tool-call-parser``): generated text to OpenAI ``tool_calls``, whole or as streamed deltas.

:mod:`.tool_calls` describes the formats and re-exports these names; this module holds the incremental reader of a
call object and the ``hermes`` and ``json`` parsers.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

_ARG_KEYS = ("arguments", "parameters")


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- reading a call object as it arrives -----------------------------------------------------------------------------


class _CallScanner:
    """Reads one JSON object ``{"name": ..., "arguments": ...}`` fed in pieces: knows the name once its string is
    complete, and where the raw ``arguments`` (or ``parameters``) value starts and ends, so that an object value can
    be streamed as written. Not a full JSON validator: callers that need validity check it with ``json.loads``."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_str = self.escape = False
        self.state = "start"  # start, key_or_end, key, colon, value, string_value, nested, scalar, after, done, bad
        self.key: str | None = None
        self.key_start = self.value_start = 0
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def bad(self) -> bool:
        return self.state == "bad"

    def feed(self, piece: str) -> str:
        """Scan ``piece``; returns the text after the object's closing brace (empty until it closes)."""
        if self.state in ("done", "bad"):
            return piece
        self.text += piece
        text = self.text
        for i in range(self.pos, len(text)):
            self._step(text, i, text[i])
            if self.state in ("done", "bad"):
                self.pos = i + 1
                return text[i + 1:] if self.done else ""
        self.pos = len(text)
        return ""

    def _value_end(self, end: int) -> None:
        raw = self.text[self.value_start:end]
        if self.key == "name":
            self.name = json.loads(raw) if raw.startswith('"') else None
            if self.name is None:
                self.state = "bad"
                return
        elif self.key in _ARG_KEYS and self.args_end is None and self.args_start in (None, self.value_start):
            self.args_start, self.args_end = self.value_start, end
        self.state = "after"

    def _step(self, text: str, i: int, c: str) -> None:
        if self.in_str:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_str = False
                if self.state == "key":
                    self.key, self.state = json.loads(text[self.key_start:i + 1]), "colon"
                elif self.state == "string_value":
                    self._value_end(i + 1)
            return
        if self.state == "nested":
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end(i + 1)
            return
        if self.state == "scalar" and c in ",}":
            self._value_end(self.value_start + len(text[self.value_start:i].rstrip()))
        if c in " \t\r\n" or self.state == "scalar":
            return
        if self.state == "start":
            self.state, self.depth = ("key_or_end", 1) if c == "{" else ("bad", 0)
        elif self.state in ("key_or_end", "key_next"):
            if c == '"':
                self.in_str, self.key_start, self.state = True, i, "key"
            elif c == "}" and self.state == "key_or_end":
                self.state, self.end = "done", i + 1
            else:
                self.state = "bad"
        elif self.state == "colon":
            self.state = "value" if c == ":" else "bad"
        elif self.state == "value":
            self.value_start = i
            if c == '"':
                self.in_str, self.state = True, "string_value"
            elif c in "{[":
                self.depth, self.state = 2, "nested"
                if self.key in _ARG_KEYS and self.args_start is None:
                    self.args_start = i  # streamed from here on, as written
            else:
                self.state = "scalar"
        elif self.state == "after":
            if c == ",":
                self.state = "key_next"
            elif c == "}":
                self.state, self.end = "done", i + 1
            else:
                self.state = "bad"

    def arguments(self, final: bool = False) -> str | None:
        """The arguments' JSON text known so far: an object value grows as it arrives; a string value (JSON text in a
        string) and a scalar come whole once complete; ``"{}"`` at the end when there are none (or ``null``)."""
        if self.args_start is None:
            return "{}" if final else None
        raw = self.text[self.args_start:self.args_end if self.args_end is not None else self.pos]
        if raw[:1] in "{[":
            return raw
        if self.args_end is None:
            return None
        if raw.startswith('"'):
            return json.loads(raw)
        return "{}" if raw == "null" else raw


def _is_call(obj: Any, tool_names: set[str] | None) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return False
    if tool_names is not None and obj["name"] not in tool_names:
        return False
    args = next((obj[k] for k in _ARG_KEYS if k in obj), None)
    return args is None or isinstance(args, (dict, list, str))


def _call_of(scanner: _CallScanner) -> dict:
    """The OpenAI tool call read by a scanner that saw a whole call object."""
    return {"id": _call_id(), "type": "function",
            "function": {"name": scanner.name, "arguments": scanner.arguments(final=True)}}


class _StreamedCall:
    """One call being streamed: its first delta once the name is known, then its arguments as they grow."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.scanner = _CallScanner()
        self.header = False
        self.sent = 0

    def deltas(self, final: bool = False, names: set[str] | None = None) -> list[dict] | None:
        """New deltas (None: the name is not one of ``names``, so this is no call)."""
        out: list[dict] = []
        if not self.header:
            name = self.scanner.name
            if name is None:
                return out
            if names is not None and name not in names:
                return None
            self.header = True
            out.append({"tool_calls": [{"index": self.index, "id": _call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        args = self.scanner.arguments(final)
        if args is not None and len(args) > self.sent:
            out.append({"tool_calls": [{"index": self.index, "function": {"arguments": args[self.sent:]}}]})
            self.sent = len(args)
        return out


def _content(out: list[dict], text: str) -> None:
    if text:
        out.append({"content": text})


class ToolParser:
    """Turns generated text into ``(content, tool_calls)``, whole (``parse``) or streamed (``feed`` each new piece of
    text, then ``finish``; each returns OpenAI delta dicts: ``{"content": ...}`` or ``{"tool_calls": [...]}``).
    A parser instance streams one output. ``tool_names``: declared tools (the json parser takes an object naming
    another function for plain content)."""

    name = ""

    def __init__(self, tool_names: list[str] | set[str] | None = None) -> None:
        self.tool_names = set(tool_names) if tool_names is not None else None
        self._buf = ""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        raise NotImplementedError

    def feed(self, delta_text: str) -> list[dict]:
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> list[dict]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[dict]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; text outside them is content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: list[str] | set[str] | None = None) -> None:
        super().__init__(tool_names)
        self._call: _StreamedCall | None = None
        self._count = 0
        self._after_call = False

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        calls: list[dict] = []
        pieces: list[str] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            end = text.find(self.CLOSE, start)
            body = text[start + len(self.OPEN):end if end >= 0 else len(text)]
            try:
                obj = json.loads(body)
            except ValueError:
                return text or None, []
            if not _is_call(obj, None):
                return text or None, []
            scanner = _CallScanner()
            scanner.feed(body.strip())
            calls.append(_call_of(scanner))
            pos = end + len(self.CLOSE) if end >= 0 else len(text)
        pieces.append(text[pos:])
        # whitespace touching a block is not content (the streamed form cannot know it is content until later)
        for j in range(len(pieces)):
            pieces[j] = pieces[j].rstrip() if j < len(calls) else pieces[j]
            pieces[j] = pieces[j].lstrip() if j > 0 else pieces[j]
        return "".join(pieces) or None, calls

    def _safe_len(self) -> int:
        """Length of the buffer's head that is content for sure: not a trailing prefix of the open tag, nor the
        whitespace before it."""
        buf = self._buf
        held = next((k for k in range(min(len(self.OPEN) - 1, len(buf)), 0, -1) if self.OPEN.startswith(buf[-k:])), 0)
        return len(buf[:len(buf) - held].rstrip())

    def _drain(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._call is None:
                if self._after_call:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._after_call = False
                start = self._buf.find(self.OPEN)
                if start >= 0:
                    _content(out, self._buf[:start].rstrip())
                    self._buf = self._buf[start + len(self.OPEN):]
                    self._call = _StreamedCall(self._count)
                    self._count += 1
                    continue
                keep = len(self._buf) if final else self._safe_len()
                _content(out, self._buf[:keep])
                self._buf = self._buf[keep:]
                break
            call = self._call
            if not call.scanner.done:
                if call.scanner.state == "start":
                    self._buf = self._buf.lstrip()
                self._buf = call.scanner.feed(self._buf)
                out += call.deltas()
            if call.scanner.bad or (final and not call.scanner.done):  # malformed: what was not sent is content
                if not call.header:
                    _content(out, self.OPEN + call.scanner.text)
                self._call = None
                continue
            if not call.scanner.done:
                break
            out += call.deltas(final=True)
            tail = self._buf.lstrip()
            if tail.startswith(self.CLOSE):
                self._buf, self._call, self._after_call = tail[len(self.CLOSE):], None, True
                continue
            if not final and self.CLOSE.startswith(tail):
                break  # the close tag may be arriving
            self._buf, self._call, self._after_call = tail, None, not tail  # unclosed at the end, or text after it
        return out


class JsonToolParser(ToolParser):
    """The whole output is a call object ``{"name": ..., "arguments" | "parameters": {...}}`` or a list of them (what
    ``tool_choice_spec`` constrains to); any other output is content."""

    name = "json"

    def __init__(self, tool_names: list[str] | set[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = "start"  # start, text, object, element, next, first, sep, after
        self._raw = ""  # the text so far, while no call was sent: content if it turns out not to be a call
        self._calls: list[_StreamedCall] = []

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        stripped = text.strip()
        if stripped[:1] not in ("{", "["):
            return text or None, []
        try:
            value = json.loads(stripped)
        except ValueError:
            return text or None, []
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or not items or not all(_is_call(x, self.tool_names) for x in items):
            return text or None, []
        rest = stripped[1:] if isinstance(value, list) else stripped
        calls = []
        for _ in items:
            rest = rest.lstrip()
            rest = rest[1:] if rest.startswith(",") else rest
            scanner = _CallScanner()
            rest = scanner.feed(rest.lstrip())
            calls.append(_call_of(scanner))
        return None, calls

    def feed(self, delta_text: str) -> list[dict]:
        if self._state == "text":
            return [{"content": delta_text}] if delta_text else []
        if not any(c.header for c in self._calls):
            self._raw += delta_text
        return super().feed(delta_text)

    def _as_text(self, out: list[dict]) -> None:
        """Not a call after all: everything so far is content, and so is what follows."""
        _content(out, self._buf.lstrip() if any(c.header for c in self._calls) else self._raw)
        self._state, self._buf = "text", ""

    def _drain(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while self._state != "text":
            if self._state in ("object", "element"):
                call = self._calls[-1]
                self._buf = call.scanner.feed(self._buf)
                new = call.deltas(names=self.tool_names)
                if new is None or call.scanner.bad:
                    self._as_text(out)
                    break
                out += new
                if not call.scanner.done:
                    if final:
                        self._as_text(out)
                    break
                if not call.header:  # an object without a name
                    self._as_text(out)
                    break
                out += call.deltas(final=True) or []
                self._state = "after" if self._state == "object" else "sep"
                continue
            head = self._buf.lstrip()
            if not head:
                if final and self._state != "after":
                    self._as_text(out)
                self._buf = ""
                break
            c = head[0]
            if self._state == "start" and c in "{[":
                self._state, self._buf = ("object", head) if c == "{" else ("first", head[1:])
                if c == "{":
                    self._calls.append(_StreamedCall(0))
            elif self._state in ("first", "next") and c == "{":
                self._calls.append(_StreamedCall(len(self._calls)))
                self._state, self._buf = "element", head
            elif self._state == "sep" and c in ",]":
                self._state, self._buf = ("next" if c == "," else "after"), head[1:]
            else:  # not a call, or malformed
                self._as_text(out)
        return out


TOOL_PARSERS = {"hermes": HermesToolParser, "json": JsonToolParser}


def make_tool_parser(name: str, tool_names: list[str] | set[str] | None = None) -> ToolParser:
    """A fresh parser by ``--tool-call-parser`` name; ValueError naming the choices."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tool_names)


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def default_parser(tokenizer: Any) -> str:
    """``"hermes"`` when the chat template writes ``<tool_call>`` blocks, else ``"json"``."""
    return "hermes" if "<tool_call>" in _template_text(tokenizer) else "json"
