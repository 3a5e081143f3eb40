"""Tool calling: ``tools`` / ``tool_choice`` validation, the constraint for ``required`` and named choices, and parsers
that turn generated text into OpenAI ``tool_calls``, whole or as streamed deltas (:mod:`.tool_parsers`, re-exported).

- ``tool_choice_spec``: for ``"required"`` a JSON array (at least one item) of ``{"name": <a tool's name>,
  "parameters": <that tool's arguments>}`` objects, ``anyOf`` over the tools; for a named function one such object
  of that tool (vLLM's format). The output of either is parsed with ``JsonToolParser``, whatever the model's parser.
- Parsers (``--tool-call-parser``, vLLM's names): ``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` blocks (Qwen2.5, Hermes, ... templates); text outside them is content, without the whitespace that
  touches a block. ``json`` reads an output that is, as a whole, one call object or a list of them (``arguments`` or
  ``parameters``); anything else is content. A call's ``arguments`` is the JSON text of its value as the model wrote it
  (so streamed fragments add up to it exactly). A malformed call: the whole text is content (as vLLM), when parsed
  whole; when streamed, deltas already sent stay sent.
- Chat templates that do not render ``tools`` (SmolLM2's ignores them and drops an assistant message's ``tool_calls``;
  it renders a ``role: "tool"`` message as ``<|im_start|>tool\\n{content}<|im_end|>``): ``tools_system_prompt`` and
  ``tool_calls_as_text`` give text to put in the messages instead, in the ``json`` parser's format.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    JsonToolParser,
    ToolParser,
    _template_text,
    default_parser,
    make_tool_parser,
)

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "JsonToolParser",
    "ToolParser",
    "default_parser",
    "make_tool_parser",
    "template_renders_tools",
    "tool_calls_as_text",
    "tool_choice_spec",
    "tools_system_prompt",
    "validate_tool_choice",
    "validate_tools",
]

_NO_PARAMETERS = {"type": "object", "properties": {}}


# -- tools and tool_choice ------------------------------------------------------------------------------------------


def validate_tools(tools: Any) -> list[dict]:
    """OpenAI ``tools`` as a list of ``{"name", "description", "parameters"}`` (parameters defaulted to an empty
    object schema); ValueError naming the field that is wrong."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': ...}}, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            raise ValueError(f"{where}.type must be 'function', got {tool.get('type')!r}")
        if set(tool) - {"type", "function"}:
            raise ValueError(f"{where} does not take the field(s) {sorted(set(tool) - {'type', 'function'})}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a 'name'")
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise ValueError(f"{where}.function does not take the field(s) {extra}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is declared twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
        params = fn.get("parameters")
        if params is None:
            params = dict(_NO_PARAMETERS)
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got {type(params).__name__}")
        if params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must describe an object (type 'object'), "
                             f"got type {params['type']!r}")
        out.append({"name": name, "description": fn.get("description"), "parameters": params})
    return out


def validate_tool_choice(tool_choice: Any, tools: list[dict]) -> str | None:
    """``None``, ``"none"``, ``"auto"``, ``"required"``, or the name of the chosen function; ValueError naming the
    field. ``tools`` as :func:`validate_tools` gives them."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return tool_choice
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs tools: declare at least one in tools")
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {tool_choice!r}")
    if tool_choice.get("type") != "function" or set(tool_choice) - {"type", "function"}:
        raise ValueError("tool_choice as an object must be {'type': 'function', 'function': {'name': ...}}, "
                         f"got {tool_choice!r}")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict) or set(fn) != {"name"} or not isinstance(fn["name"], str):
        raise ValueError(f"tool_choice.function must be {{'name': <a tool's name>}}, got {fn!r}")
    names = [t["name"] for t in tools]
    if fn["name"] not in names:
        raise ValueError(f"tool_choice.function.name {fn['name']!r} is not one of the tools: {names}")
    return fn["name"]


def _hoisted(params: dict, key: str, defs: dict) -> dict:
    """``params`` as a ``$ref`` to ``#/$defs/<key>`` when it refers to itself or has its own ``$defs`` (refs start at
    the root of the whole schema once it is nested in the call's object), with its refs rewritten; else unchanged."""
    text = json.dumps(params)
    if '"$ref"' not in text and '"$defs"' not in text and '"definitions"' not in text:
        return params

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = f"#/$defs/{key}" + v[1:]
            elif k in ("const", "enum", "default", "examples"):  # values, not schemas
                out[k] = copy.deepcopy(v)
            else:
                out[k] = rewrite(v)
        return out

    defs[key] = rewrite(params)
    return {"$ref": f"#/$defs/{key}"}


def tool_choice_spec(tools: Any, tool_choice: Any, parallel_tool_calls: bool = True) -> dict | None:
    """The structured-output spec (``serving.structured``) that makes the output a valid call: ``"required"``: a
    non-empty JSON array of calls of any of ``tools`` (one call when ``parallel_tool_calls`` is False); a named
    function: one call of it. ``"none"``, ``"auto"`` or absent: None. ValueError naming an invalid field."""
    fns = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, fns)
    if choice in (None, "none", "auto"):
        return None
    from .structured import _check_schema

    defs: dict = {}

    def call_schema(i: int, fn: dict) -> dict:
        _check_schema(fn["parameters"], f"tools[{i}].function.parameters")
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": _hoisted(fn["parameters"], f"tool_{i}_parameters", defs)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    if choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(i, f) for i, f in enumerate(fns)]}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
    else:
        i = [f["name"] for f in fns].index(choice)
        schema = call_schema(i, fns[i])
    if defs:
        schema["$defs"] = defs
    return {"json_schema": schema}


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads ``tools`` at all (SmolLM2's does not: it drops them silently)."""
    return "tools" in _template_text(tokenizer)


def tools_system_prompt(tools: Any) -> str:
    """System-prompt text declaring ``tools`` in the json parser's format, for chat templates that ignore ``tools``."""
    lines = ["You can call these functions. Each is given as JSON: its name, what it does, and the JSON schema of "
             "its arguments."]
    for fn in validate_tools(tools):
        lines.append(json.dumps({k: v for k, v in fn.items() if v is not None}, ensure_ascii=False))
    lines.append('To call a function, answer with only a JSON object {"name": <function name>, "arguments": '
                 "<arguments object>}, or a JSON list of such objects to call several. Otherwise answer normally.")
    return "\n".join(lines)


def tool_calls_as_text(tool_calls: list[dict]) -> str:
    """An assistant message's OpenAI ``tool_calls`` as text in the json parser's format, for chat templates that
    drop ``tool_calls``."""
    calls = []
    for call in tool_calls:
        fn = call.get("function", {})
        args = fn.get("arguments", "{}")
        calls.append({"name": fn.get("name"), "arguments": json.loads(args) if isinstance(args, str) else args})
    return json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
