"""The request fields of ``hf-dsinfer serve``'s generating routes: one table, one entry per field.

Every field of OpenAI's chat-completions and completions requests, and vLLM's extra request fields, has one entry in
:data:`FIELDS`: its JSON kinds, its default, what this server does with it and a line of documentation. The entry is
either *honoured* (it does what OpenAI / vLLM document), *accepted* (it has no effect by nature here, e.g. ``user``;
the docs say so) or *refused* (a 400 naming it and saying what to do, unless it holds a value that asks for nothing,
e.g. ``use_beam_search: false``). A field in no entry is refused by name, as OpenAI does with unknown parameters.
:func:`parse_request` validates a body against the table; docs/serving.md's field table is :func:`fields_markdown`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .http_common import RequestError, unknown_field

__all__ = ["ACCEPTED", "FIELDS", "HONOURED", "REFUSED", "FieldSpec", "ParsedRequest", "fields_markdown",
           "parse_request"]  # fmt: skip

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
#: The most log-probs per position (chat's top_logprobs limit; vLLM's default --max-logprobs is 20 as well).
MAX_LOGPROBS = 20

# JSON kinds: the Python types a JSON value of that kind decodes to (booleans are not numbers here).
_KINDS: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                                       "array": (list,), "object": (dict,)}  # fmt: skip


@dataclass(frozen=True)
class FieldSpec:
    """One request field: ``name``, its JSON ``kinds``, its ``default`` (used when absent or null), ``status``
    (honoured / accepted / refused), ``doc`` (what it does here), the ``endpoints`` it belongs to, ``check`` (a
    value -> error message or None) and, for a refused field, the ``neutral`` values that ask for nothing."""

    name: str
    kinds: tuple[str, ...]
    default: Any
    status: str
    doc: str
    endpoints: tuple[str, ...] = BOTH
    check: Callable[[Any], str | None] | None = None
    neutral: tuple = ()
    origin: str = "OpenAI"


def _range(lo: float | None, hi: float | None, lo_open: bool = False) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            low = "(-inf" if lo is None else f"{'(' if lo_open else '['}{lo}"
            return f"must be in {low}, {'inf)' if hi is None else f'{hi}]'}"
        return None

    return check


def _one_of(*values: Any) -> Callable[[Any], str | None]:
    return lambda v: None if v in values else f"must be one of {', '.join(json.dumps(x) for x in values)}"


def _stop(v: Any) -> str | None:
    stops = [v] if isinstance(v, str) else v
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 64:
        return "must be a non-empty string or a list of up to 64 non-empty strings"
    return None


def _ints(v: Any) -> str | None:
    ok = all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)
    return None if ok else "must be a list of token ids (integers >= 0)"


def _bias(v: Any) -> str | None:
    for key, value in v.items():
        if not str(key).lstrip("-").isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
            return 'maps token ids to numbers, e.g. {"50256": -100}'
        if not -100 <= value <= 100:
            return f"values must be in [-100, 100], got {value} for token {key}"
    return None


def _f(name: str, kinds: str, default: Any, status: str, doc: str, **kw: Any) -> FieldSpec:
    return FieldSpec(name, tuple(kinds.split("|")), default, status, doc, **kw)


_V = {"origin": "vLLM"}
_SP = "vLLM sampling parameter"
#: Every request field of the two routes (one entry per field and endpoint kind).
FIELDS: tuple[FieldSpec, ...] = (
    # -- OpenAI, both routes ------------------------------------------------------------------------------------
    _f("model", "string", None, HONOURED, "The served model's id (`GET /v1/models`); absent: the served model."),
    _f("n", "integer", 1, HONOURED, "Choices per prompt: one engine request each, batched together.",
       check=_range(1, None)),
    _f("stream", "boolean", False, HONOURED, "Server-sent events: one chunk per new piece of text, then `[DONE]`."),
    _f("stream_options", "object", None, HONOURED, "`include_usage` (a last chunk with `usage`), vLLM's "
       "`continuous_usage_stats` (`usage` on every chunk); needs `stream`."),
    _f("stop", "string|array", None, HONOURED, "Up to 64 strings; the text ends before the first one found "
       "(finish_reason `stop`) unless `include_stop_str_in_output`.", check=_stop),
    _f("temperature", "number", 1.0, HONOURED, "0: greedy (argmax); otherwise sampling at this temperature.",
       check=_range(0, 2)),
    _f("top_p", "number", 1.0, HONOURED, "Nucleus sampling: the smallest set of tokens with this probability mass.",
       check=_range(0, 1, lo_open=True)),
    _f("seed", "integer", None, HONOURED, "The request's own random generator: the same text alone and among other "
       "requests; choice `i` of `n` uses `seed + i` (as vLLM).", check=_range(-(2**63), 2**63 - 1)),
    _f("presence_penalty", "number", 0.0, HONOURED, "Subtracted from the logit of every token generated so far.",
       check=_range(-2, 2)),
    _f("frequency_penalty", "number", 0.0, HONOURED, "Times the count of each token generated so far, subtracted "
       "from its logit.", check=_range(-2, 2)),
    _f("logit_bias", "object", None, HONOURED, "Token id (a string) -> bias in [-100, 100] added to its logit before "
       "sampling; -100 bans a token, 100 forces it.", check=_bias),
    _f("max_tokens", "integer", None, HONOURED, "New tokens at most. Default: chat, the server's "
       "`--default-max-tokens`; completions, 16 (OpenAI's). Capped by the context left.", check=_range(0, None)),
    _f("user", "string", None, ACCEPTED, "An end-user id for OpenAI's abuse monitoring: no effect here."),
    _f("response_format", "object", None, HONOURED, '`{"type": "text"}`, `{"type": "json_object"}` or '
       '`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: the output is constrained to it '
       "while decoding."),
    # -- OpenAI, chat ------------------------------------------------------------------------------------------
    _f("messages", "array", None, HONOURED, "The conversation, rendered by the model's chat template: roles "
       "`system` / `developer` / `user` / `assistant` (with `tool_calls`) / `tool`; text content (a string or text "
       "parts).", endpoints=(CHAT,)),
    _f("logprobs", "boolean", False, HONOURED, "Log-probs of the generated tokens in `choices[i].logprobs.content` "
       "(computed from the fp32 logits before any sampling setting, as OpenAI).", endpoints=(CHAT,)),
    _f("top_logprobs", "integer", 0, HONOURED, "0-20 most likely tokens per position as well; needs `logprobs`.",
       endpoints=(CHAT,), check=_range(0, MAX_LOGPROBS)),
    _f("max_completion_tokens", "integer", None, HONOURED, "OpenAI's newer name for `max_tokens` (wins over it).",
       endpoints=(CHAT,), check=_range(1, None)),
    _f("tools", "array", None, HONOURED, "Functions the model may call, passed to the chat template as `tools=` "
       "(a template that ignores them, as SmolLM2's, gets them in a system message instead); calls in the output are "
       "parsed into `tool_calls` (`--tool-call-parser`).", endpoints=(CHAT,)),
    _f("tool_choice", "string|object", None, HONOURED, '`"none"`, `"auto"` (default with tools), `"required"` or '
       '`{"type": "function", "function": {"name"}}`: required and named are constrained to a valid call.',
       endpoints=(CHAT,)),
    _f("parallel_tool_calls", "boolean", True, HONOURED, "false: only the first parsed tool call is returned.",
       endpoints=(CHAT,)),
    _f("reasoning_effort", "string", None, HONOURED, "Passed to the chat template as `reasoning_effort` (templates "
       "that do not read it ignore it, as in vLLM).", endpoints=(CHAT,)),
    _f("metadata", "object", None, ACCEPTED, "Tags for OpenAI's stored completions: nothing is stored here.",
       endpoints=(CHAT,)),
    _f("store", "boolean", False, ACCEPTED, "OpenAI stores the completion for its dashboard: nothing is stored here.",
       endpoints=(CHAT,)),
    _f("service_tier", "string", None, ACCEPTED, "OpenAI's processing tier: one tier here.", endpoints=(CHAT,)),
    _f("prompt_cache_key", "string", None, ACCEPTED, "A routing hint for OpenAI's prompt cache; this server shares "
       "identical prompt prefixes by itself.", endpoints=(CHAT,)),
    _f("prompt_cache_options", "object", None, ACCEPTED, "OpenAI's cache breakpoints and lifetime: prefix sharing "
       "here is automatic.", endpoints=(CHAT,)),
    _f("prompt_cache_retention", "string", None, ACCEPTED, "OpenAI's cache lifetime: prefix sharing here keeps "
       "blocks until the room is needed.", endpoints=(CHAT,)),
    _f("safety_identifier", "string", None, ACCEPTED, "An end-user id for OpenAI's abuse monitoring: no effect here.",
       endpoints=(CHAT,)),
    _f("prediction", "object", None, ACCEPTED, "OpenAI's predicted output only speeds up decoding; the output is the "
       "same without it.", endpoints=(CHAT,)),
    _f("audio", "object", None, REFUSED, "Audio output: this server generates text only; leave it out.",
       endpoints=(CHAT,)),
    _f("modalities", "array", None, REFUSED, 'Output kinds: only `["text"]` is accepted.', endpoints=(CHAT,),
       neutral=(["text"],)),
    _f("moderation", "object", None, REFUSED, "OpenAI's moderation of input and output: none runs here; leave it "
       "out.", endpoints=(CHAT,)),
    _f("verbosity", "string", None, REFUSED, "A hint to OpenAI's reasoning models this server cannot pass on; ask "
       "for brevity in the prompt instead.", endpoints=(CHAT,)),
    _f("web_search_options", "object", None, REFUSED, "No web search here; leave it out.", endpoints=(CHAT,)),
    _f("functions", "array", None, REFUSED, "OpenAI's deprecated form of `tools`: send `tools` instead.",
       endpoints=(CHAT,)),
    _f("function_call", "string|object", None, REFUSED, "OpenAI's deprecated form of `tool_choice`: send "
       "`tool_choice` instead.", endpoints=(CHAT,)),
    # -- OpenAI, completions -----------------------------------------------------------------------------------
    _f("prompt", "string|array", None, HONOURED, "A string, a list of token ids, or a list of either (each prompt "
       "gets `n` choices).", endpoints=(COMPLETIONS,)),
    _f("logprobs", "integer", None, HONOURED, "Log-probs of the generated tokens and the k (0-20; OpenAI allows 5) "
       "most likely per position, in `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.",
       endpoints=(COMPLETIONS,), check=_range(0, MAX_LOGPROBS)),
    _f("echo", "boolean", False, HONOURED, "The prompt text before the completion (with `logprobs`: the prompt's "
       "log-probs too, the first null); `max_tokens: 0` with `echo` scores the prompt only.", endpoints=(COMPLETIONS,)),
    _f("best_of", "integer", None, REFUSED, "Server-side candidates ranked by log-prob: not done here (vLLM removed "
       "it too); send `n` and rank with `logprobs`.", endpoints=(COMPLETIONS,), neutral=(1,)),
    _f("suffix", "string", None, REFUSED, "Fill-in-the-middle needs a model-specific template: put the text in the "
       "prompt yourself.", endpoints=(COMPLETIONS,), neutral=("",)),
    # -- vLLM's sampling parameters, both routes ---------------------------------------------------------------
    _f("top_k", "integer", 0, HONOURED, "Sample among the k most likely tokens (0 or -1: all).",
       check=_range(-1, None), **_V),
    _f("min_p", "number", 0.0, HONOURED, "Drop tokens below this fraction of the most likely one's probability.",
       check=_range(0, 1), **_V),
    _f("repetition_penalty", "number", 1.0, HONOURED, "transformers' / vLLM's multiplicative penalty on the prompt "
       "and generated tokens (> 1 discourages repeats).", check=_range(0, None, lo_open=True), **_V),
    _f("stop_token_ids", "array", None, HONOURED, "Token ids that end the request (finish_reason `stop`).",
       check=_ints, **_V),
    _f("include_stop_str_in_output", "boolean", False, HONOURED, "Keep the matched stop string in the text.", **_V),
    _f("ignore_eos", "boolean", False, HONOURED, "EOS does not end the request: it runs to `max_tokens` (for "
       "benchmarks).", **_V),
    _f("min_tokens", "integer", 0, HONOURED, "EOS and `stop_token_ids` cannot end the request before this many "
       "tokens.", check=_range(0, None), **_V),
    _f("skip_special_tokens", "boolean", True, HONOURED, "Leave special tokens out of the text.", **_V),
    _f("prompt_logprobs", "integer", None, HONOURED, "Log-probs of the prompt tokens (and the k most likely) in "
       "`prompt_logprobs` (vLLM's shape); not with `stream`.", check=_range(0, MAX_LOGPROBS), **_V),
    _f("truncate_prompt_tokens", "integer", None, HONOURED, "Keep only this many prompt tokens (-1: as many as the "
       "context allows), from the side `truncation_side` says.", check=_range(-1, None), **_V),
    _f("truncation_side", "string", "left", HONOURED, "`left` keeps the last tokens, `right` the first.",
       check=_one_of("left", "right"), **_V),
    _f("structured_outputs", "object", None, HONOURED, "vLLM's constraint: one of `json` (a schema), `regex`, "
       "`choice` (a list of strings), `grammar` (EBNF), `json_object`.", **_V),
    _f("guided_json", "string|object", None, HONOURED, "vLLM's old name for `structured_outputs.json` (removed in "
       "vLLM 0.12, kept here so old clients are not silently unconstrained).", **_V),
    _f("guided_regex", "string", None, HONOURED, "Old name for `structured_outputs.regex`.", **_V),
    _f("guided_choice", "array", None, HONOURED, "Old name for `structured_outputs.choice`.", **_V),
    _f("guided_grammar", "string", None, HONOURED, "Old name for `structured_outputs.grammar`.", **_V),
    _f("request_id", "string", None, HONOURED, "The response's `id` (after `chatcmpl-` / `cmpl-`) and the access "
       "log's request id.", **_V),
    _f("return_token_ids", "boolean", False, HONOURED, "`prompt_token_ids` on the response (first chunk when "
       "streaming) and `token_ids` on each choice / chunk.", **_V),
    _f("return_tokens_as_token_ids", "boolean", False, HONOURED, "Log-prob tokens written `token_id:N`.", **_V),
    _f("stream_interval", "integer", 1, HONOURED, "Tokens per streamed chunk at most once this many have come "
       "(the first and last chunks go at once).", check=_range(1, None), **_V),
    _f("session_id", "string", None, ACCEPTED, "vLLM's session routing hint: one engine here.", **_V),
    _f("spaces_between_special_tokens", "boolean", True, REFUSED, "Only the default (true) is accepted: this "
       "server's detokenizer does not insert spaces.", neutral=(True,), **_V),
    _f("use_beam_search", "boolean", False, REFUSED, "No beam search on the batched engine: use `n` with sampling, or "
       "`model.generate(num_beams=...)` offline.", neutral=(False,), **_V),
    _f("length_penalty", "number", 1.0, REFUSED, "Beam search only; leave it out.", neutral=(1, 1.0), **_V),
    _f("allowed_token_ids", "array", None, REFUSED, "Not honoured: use `structured_outputs` (`choice`, `regex`) or "
       "`logit_bias`.", neutral=([],), **_V),
    _f("bad_words", "array", None, REFUSED, "Not honoured: ban single tokens with `logit_bias` -100.", neutral=([],),
       **_V),
    _f("logprob_token_ids", "array", None, REFUSED, "Not honoured: use `logprobs` / `top_logprobs`.", **_V),
    _f("logits_processors", "array", None, REFUSED, "Custom logits processors cannot be loaded per request here.",
       neutral=([],), **_V),
    _f("priority", "integer", 0, REFUSED, "Requests are served first come first served here (as vLLM without "
       "--scheduling-policy priority): leave it at 0.", neutral=(0,), **_V),
    _f("cache_salt", "string", None, REFUSED, "The prefix cache cannot be salted here: run the server with "
       "--no-prefix-sharing to keep users' prefixes apart, and leave it out.", **_V),
    _f("guided_decoding_backend", "string", None, REFUSED, "Removed by vLLM 0.12; the grammar engine here is fixed: "
       "leave it out.", **_V),
    _f("guided_whitespace_pattern", "string", None, REFUSED, "Removed by vLLM 0.12; leave it out.", **_V),
    _f("watermarking", "boolean|object", None, REFUSED, "No watermarking here; leave it out.", neutral=(False,), **_V),
    _f("repetition_detection", "object", None, REFUSED, "Not done here: use `repetition_penalty` or "
       "`frequency_penalty`.", **_V),
    _f("thinking_token_budget", "integer", None, REFUSED, "No reasoning parser here: cap the output with "
       "`max_tokens`.", neutral=(-1,), **_V),
    _f("vllm_xargs", "object", None, REFUSED, "vLLM's extension arguments: no extensions here.", **_V),
    _f("kv_transfer_params", "object", None, REFUSED, "No disaggregated serving here.", **_V),
    _f("prompt_embeds", "string|array", None, REFUSED, "Prompts are text or token ids here.",
       endpoints=(COMPLETIONS,), **_V),
    # -- vLLM, chat ----------------------------------------------------------------------------------------------
    _f("add_generation_prompt", "boolean", True, HONOURED, "The chat template's `add_generation_prompt`.",
       endpoints=(CHAT,), **_V),
    _f("continue_final_message", "boolean", False, HONOURED, "Continue the last (assistant) message instead of "
       "starting a new one (then `add_generation_prompt` defaults to false).", endpoints=(CHAT,), **_V),
    _f("echo", "boolean", False, HONOURED, "When the last message is the assistant's: the reply starts with its "
       "text (vLLM's chat echo).", endpoints=(CHAT,), **_V),
    _f("add_special_tokens", "boolean", False, HONOURED, "Let the tokenizer add its special tokens (BOS) after the "
       "chat template rendered the prompt.", endpoints=(CHAT,), **_V),
    _f("documents", "array", None, HONOURED, "Passed to the chat template as `documents=` (RAG templates).",
       endpoints=(CHAT,), **_V),
    _f("chat_template_kwargs", "object", None, HONOURED, "Extra variables for the chat template (e.g. "
       "`enable_thinking`).", endpoints=(CHAT,), **_V),
    _f("chat_template", "string", None, REFUSED, "A per-request Jinja template is refused (vLLM too, without "
       "--trust-request-chat-template): the model's template is used.", endpoints=(CHAT,), **_V),
    _f("include_reasoning", "boolean", True, REFUSED, "No reasoning parser here: reasoning stays in `content`; only "
       "true is accepted.", endpoints=(CHAT,), neutral=(True,), **_V),
    _f("media_io_kwargs", "object", None, REFUSED, "Text-only models here.", endpoints=(CHAT,), **_V),
    _f("mm_processor_kwargs", "object", None, REFUSED, "Text-only models here.", endpoints=(CHAT,), **_V),
    # -- vLLM, completions ---------------------------------------------------------------------------------------
    _f("add_special_tokens", "boolean", True, HONOURED, "Let the tokenizer add its special tokens (BOS) to string "
       "prompts.", endpoints=(COMPLETIONS,), **_V),
)  # fmt: skip

_BY_ENDPOINT = {ep: {f.name: f for f in FIELDS if ep in f.endpoints} for ep in BOTH}


class ParsedRequest(dict):
    """A validated request body: every field of the endpoint's table, present or at its default (``req.name`` or
    ``req["name"]``); ``given`` holds the names the client set (non-null)."""

    def __init__(self, values: dict[str, Any], given: frozenset[str], chat: bool):
        super().__init__(values)
        self.given, self.chat = given, chat

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


def _kind_ok(value: Any, kinds: tuple[str, ...]) -> bool:
    for kind in kinds:
        types = _KINDS[kind]
        if isinstance(value, bool) and kind != "boolean":
            continue
        if isinstance(value, types):
            return True
    return False


def parse_request(body: dict, chat: bool) -> ParsedRequest:
    """Validate ``body`` (a decoded JSON object) field by field; raises :class:`RequestError` (400) naming the first
    unknown, refused or invalid field and saying what to do."""
    table = _BY_ENDPOINT[CHAT if chat else COMPLETIONS]
    other = _BY_ENDPOINT[COMPLETIONS if chat else CHAT]
    route = "/v1/chat/completions" if chat else "/v1/completions"
    values: dict[str, Any] = {}
    given = set()
    for name, value in body.items():
        spec = table.get(name)
        if spec is None:
            hint = f" (it belongs to {'/v1/completions' if chat else '/v1/chat/completions'})" if name in other else ""
            raise unknown_field(name, route, table, hint)
        if value is None:
            continue
        if not _kind_ok(value, spec.kinds):
            raise RequestError(f"'{name}' must be {' or '.join(spec.kinds)}, got {json.dumps(value)[:80]}", param=name)
        if spec.status == REFUSED and value not in spec.neutral:
            raise RequestError(f"'{name}' is not supported by this server: {spec.doc}", param=name)
        if spec.check is not None and (problem := spec.check(value)) is not None:
            raise RequestError(f"'{name}' {problem}, got {json.dumps(value)[:80]}", param=name)
        values[name] = value
        given.add(name)
    out = ParsedRequest({**{n: s.default for n, s in table.items()}, **values}, frozenset(given), chat)
    _check_together(out)
    return out


def _check_together(req: ParsedRequest) -> None:
    """Rules between fields (OpenAI's and vLLM's)."""
    if "stream_options" in req.given:
        if not req.stream:
            raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
        unknown = set(req.stream_options) - {"include_usage", "continuous_usage_stats", "include_obfuscation"}
        if unknown:
            raise RequestError(f"'stream_options' takes include_usage and continuous_usage_stats, not "
                               f"{sorted(unknown)}", param="stream_options")  # fmt: skip
        if req.stream_options.get("include_obfuscation"):
            raise RequestError("'stream_options.include_obfuscation' is not supported: chunks carry no obfuscation "
                               "padding here; set it to false", param="stream_options")  # fmt: skip
    if req.chat and req.top_logprobs and not req.logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise RequestError("'prompt_logprobs' is not available with 'stream': true", param="prompt_logprobs")
    if req.get("max_tokens") == 0 and not (not req.chat and req.echo):
        raise RequestError("'max_tokens' must be >= 1 (0 only with 'echo' on /v1/completions)", param="max_tokens")
    constraints = [n for n in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                               "guided_grammar") if n in req.given]  # fmt: skip
    if "response_format" in constraints and req.response_format.get("type") == "text":
        constraints.remove("response_format")
    if len(constraints) > 1:
        raise RequestError(f"one output constraint per request: {' and '.join(constraints)} were both given",
                           param=constraints[1])  # fmt: skip
    if req.chat:
        _check_chat(req, constraints)


def _check_chat(req: ParsedRequest, constraints: list[str]) -> None:
    if req.continue_final_message:
        if "add_generation_prompt" not in req.given:
            req["add_generation_prompt"] = False
        elif req.add_generation_prompt:
            raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                               param="add_generation_prompt")  # fmt: skip
    tools, choice = req.tools, req.tool_choice
    if tools is not None:
        if not tools:
            raise RequestError("'tools' must not be empty: give at least one tool or leave it out", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not fn["name"]:  # fmt: skip
                raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                                   '"parameters": {...}}}}} (function tools only)', param="tools")  # fmt: skip
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got "
                               f"{json.dumps(choice)}", param="tool_choice")  # fmt: skip
    else:
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError('\'tool_choice\' as an object must be {"type": "function", "function": {"name": ...}} '
                               "(allowed_tools and custom tools are not supported)", param="tool_choice")  # fmt: skip
        if not any(t["function"]["name"] == fn["name"] for t in tools or []):
            raise RequestError(f"'tool_choice' names the function '{fn['name']}', which is not in 'tools'",
                               param="tool_choice")  # fmt: skip
    if choice != "none" and tools is None:
        raise RequestError("'tool_choice' needs 'tools'", param="tool_choice")
    if constraints and (choice == "required" or isinstance(choice, dict)):
        raise RequestError(f"'tool_choice' {json.dumps(choice)} constrains the output to a tool call: it cannot be "
                           f"combined with '{constraints[0]}'", param="tool_choice")  # fmt: skip


def fields_markdown() -> str:
    """docs/serving.md's table of every request field (generated from :data:`FIELDS`)."""
    rows = ["| field | route | kinds | default | here | what it does |", "|---|---|---|---|---|---|"]
    for f in FIELDS:
        route = "both" if f.endpoints == BOTH else ("chat" if f.endpoints == (CHAT,) else "completions")
        default = "" if f.default is None else f"`{json.dumps(f.default)}`"
        origin = "" if f.origin == "OpenAI" else " (vLLM)"
        rows.append(f"| `{f.name}`{origin} | {route} | {' / '.join(f.kinds)} | {default} | {f.status} | {f.doc} |")
    return "\n".join(rows)
