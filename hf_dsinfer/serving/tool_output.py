"""What the generating routes need from structured outputs and tool calling (:mod:`.structured`,
:mod:`.tool_calls`): the request's output constraint, and the tool calls parsed from a choice's text, whole or
streamed, in OpenAI's shapes.

The constraint comes from exactly one of ``response_format``, ``structured_outputs`` (or vLLM's old ``guided_*``
names) or a ``tool_choice`` of ``"required"`` / a named function (the protocol refuses two at once). Tool calls are
parsed when the request has ``tools`` and ``tool_choice`` is not ``"none"``.
"""

from __future__ import annotations

from typing import Any

from .http_common import RequestError
from .protocol import ParsedRequest

__all__ = ["ToolOutput", "constraint_for", "tool_parser_for"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _forces_call(req: ParsedRequest) -> bool:
    return bool(req.chat and req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, dict)))


def constraint_for(req: ParsedRequest, tokenizer: Any, vocab: int, eos_token_ids: frozenset[int]) -> Any:
    """The compiled constraint the request asks for, or None; an invalid schema / regex / grammar is a 400 naming
    the field. ``eos_token_ids``: what ends the output once the grammar may end."""
    from . import structured

    if _forces_call(req):
        from .tool_calls import tool_choice_spec

        name, make = "tool_choice", lambda: tool_choice_spec(req.tools, req.tool_choice, req.parallel_tool_calls)
    elif req.response_format is not None and req.response_format.get("type", "text") != "text":
        name, make = "response_format", lambda: structured.response_format_to_spec(req.response_format)
    elif req.structured_outputs is not None:
        name, make = "structured_outputs", lambda: structured.structured_outputs_to_spec(req.structured_outputs)
    else:
        old = [n for n in _GUIDED if req.get(n) is not None]
        if not old:
            return None
        name = old[0]
        make = lambda: structured.structured_outputs_to_spec({_GUIDED[name]: req[name]})  # noqa: E731
    try:
        spec = make()
        return None if spec is None else structured.compile_constraint(spec, tokenizer, vocab, eos_token_ids)
    except ValueError as e:
        raise RequestError(f"'{name}': {e}", param=name) from e


def tool_parser_for(req: ParsedRequest, tokenizer: Any, parser_name: str | None) -> ToolOutput | None:
    """A fresh :class:`ToolOutput` for one choice when the request may call tools, else None. A forced call
    (``required`` / named) is read with the ``json`` parser (its constraint's format); otherwise ``parser_name``
    (``--tool-call-parser``) or the one the chat template implies."""
    if not req.chat or not req.tools or req.tool_choice == "none":
        return None
    from . import tool_calls

    names = [t["function"]["name"] for t in req.tools]
    if _forces_call(req):
        parser_name = "json"
    elif parser_name is None:
        parser_name = tool_calls.default_parser(tokenizer)
    return ToolOutput(tool_calls.make_tool_parser(parser_name, names), first_only=req.parallel_tool_calls is False)


class ToolOutput:
    """Tool calls of one choice: :meth:`parse` for a whole text, :meth:`feed` for streamed pieces (OpenAI's
    ``tool_calls`` entries and streamed deltas, as :mod:`.tool_calls` writes them)."""

    def __init__(self, parser: Any, first_only: bool = False):
        self.parser, self.first_only = parser, first_only
        self.called = False

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content left once the calls are taken out, OpenAI's ``tool_calls``)."""
        content, calls = self.parser.parse(text)
        calls = calls[:1] if self.first_only else calls
        self.called = bool(calls)
        return content or "", calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content to stream now, tool-call deltas) for a new piece of text; ``final``: the output ended."""
        deltas = self.parser.feed(text) if text else []
        if final:
            deltas += self.parser.finish()
        content, calls = "", []
        for delta in deltas:
            content += delta.get("content") or ""
            calls += [c for c in delta.get("tool_calls", []) if not (self.first_only and c.get("index", 0) > 0)]
        self.called = self.called or bool(calls)
        return content, calls
