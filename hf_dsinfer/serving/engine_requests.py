"""From a validated request (:mod:`.protocol`) to engine requests: the prompt token ids (chat template, truncation)
and one :class:`~hf_dsinfer.serving.requests.SamplingParams` per choice.

Defaults follow vLLM: a setting the request does not give comes from the model's ``generation_config.json`` when that
file sets it (vLLM's ``--generation-config auto``), else from OpenAI's defaults (temperature 1, top_p 1) and vLLM's
neutral values for its extra settings. ``temperature: 0`` is greedy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .http_common import RequestError
from .protocol import ParsedRequest
from .requests import SamplingParams

__all__ = ["PromptSet", "chat_prompt", "completion_prompts", "model_sampling_defaults", "sampling_params"]

#: The sampling settings a model's generation_config.json may default (vLLM's list).
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# apply_chat_template arguments that chat_template_kwargs must not set: the route sets them, or they are fields.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask", "add_generation_prompt", "continue_final_message", "tools",
    "documents", "chat_template",
}  # fmt: skip
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "reasoning", "reasoning_content"}


@dataclass
class PromptSet:
    """The prompts of one request: token ids and text per prompt (the text is what ``echo`` repeats)."""

    ids: list[list[int]]
    texts: list[str]
    #: chat ``echo``: the final (assistant) message's text the reply continues, else "".
    echo_prefix: str = ""
    tool_names: list[str] = field(default_factory=list)


def model_sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling settings ``generation_config`` sets explicitly (vLLM's default sampling parameters)."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict() if hasattr(generation_config, "to_diff_dict") else {}
    return {k: diff[k] for k in _DEFAULTED if diff.get(k) is not None}


def _content(message: dict, i: int) -> str:
    """A message's text: a string, null, or OpenAI's list of text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
            else:
                raise RequestError(f"messages[{i}].content[{j}] is of type {json.dumps(kind)}: this server serves "
                                   "text only; send text parts or a string", param="messages")  # fmt: skip
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be a string, null or a list of text parts", param="messages")


def _tool_calls(message: dict, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` in the form transformers' chat templates read (arguments as a dict)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f'messages[{i}].tool_calls: each is {{"id", "type": "function", "function": '
                               '{"name", "arguments"}}', param="messages")  # fmt: skip
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):  # OpenAI sends a JSON string; templates expect the object
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # left as the string the client sent
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _messages(raw: list) -> list[dict]:
    if not raw:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        extra = set(m) - _MESSAGE_KEYS
        if extra:
            raise RequestError(f"messages[{i}] has fields this server does not take: {sorted(extra)} (text messages "
                               "only; function_call: send tool_calls)", param="messages")  # fmt: skip
        role = m["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}].role {json.dumps(role)}: use system, developer, user, assistant or tool "
                               "(the deprecated 'function' role: send 'tool')", param="messages")  # fmt: skip
        msg = {k: v for k, v in m.items() if k not in ("content", "tool_calls", "reasoning_content")}
        msg["content"] = _content(m, i)
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
            msg["tool_calls"] = _tool_calls(m, i)
        if m.get("reasoning_content") is not None and "reasoning" not in m:
            msg["reasoning"] = m["reasoning_content"]  # vLLM's older name
        out.append(msg)
    return out


def _tools_as_text(messages: list[dict], tools: list | None, tokenizer: Any) -> list[dict]:
    """For a chat template that ignores ``tools`` (or ``tool_calls``), as SmolLM2's does: the tools declared in a
    system message and the assistant's calls written as text, in the ``json`` tool parser's format, so that neither
    is dropped silently."""
    from .tool_calls import template_renders_tools, tool_calls_as_text, tools_system_prompt

    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    if "tool_calls" not in template:
        for m in messages:
            if m.get("tool_calls"):
                calls = m.pop("tool_calls")
                m["content"] = (m["content"] + "\n" if m["content"] else "") + tool_calls_as_text(calls)
    if tools and not template_renders_tools(tokenizer):
        note = tools_system_prompt(tools)
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{note}"
        else:
            messages.insert(0, {"role": "system", "content": note})
    return messages


def chat_prompt(req: ParsedRequest, tokenizer: Any) -> PromptSet:
    """Render ``messages`` with the model's chat template (tools, documents, template kwargs) and tokenize them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template: use /v1/completions", param="messages")
    messages = _tools_as_text(_messages(req.messages), req.tools, tokenizer)
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise RequestError(f"'chat_template_kwargs' must not set {reserved}: this server sets them (or they have "
                           "their own request field)", param="chat_template_kwargs")  # fmt: skip
    if req.tools is not None:
        kwargs["tools"] = req.tools
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, **kwargs)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or transformers' ValueError on these messages
        raise RequestError(f"the model's chat template refused these messages: {e}", param="messages") from e
    ids = tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
    last = messages[-1]
    echo = last["content"] if req.echo and last["role"] == "assistant" else ""
    names = [t["function"]["name"] for t in req.tools or []]
    return PromptSet([list(ids)], [text], echo, names)


def completion_prompts(req: ParsedRequest, tokenizer: Any) -> PromptSet:
    """``prompt``: a string, a list of token ids, or a list of either."""
    prompt = req.prompt
    if prompt is None:
        raise RequestError("'prompt' is required", param="prompt")
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompt = [prompt]
    if not prompt:
        raise RequestError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")
    ids, texts = [], []
    vocab = len(tokenizer)
    for p in prompt:
        if isinstance(p, str) and p:
            ids.append(list(tokenizer(p, add_special_tokens=req.add_special_tokens)["input_ids"]))
            texts.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if min(p) < 0 or max(p) >= vocab:
                raise RequestError(f"'prompt' token ids must be in [0, {vocab})", param="prompt")
            ids.append(list(p))
            texts.append(tokenizer.decode(p, skip_special_tokens=req.skip_special_tokens))
        else:
            raise RequestError("each prompt must be a non-empty string or list of token ids", param="prompt")
    if not ids[0] and len(ids) == 1:
        raise RequestError("the prompt has no tokens", param="prompt")
    return PromptSet(ids, texts)


def fit_context(req: ParsedRequest, prompts: PromptSet, max_model_len: int, default_max_tokens: int) -> int:
    """Truncate the prompts as ``truncate_prompt_tokens`` says, check they fit the context with the new tokens asked
    for, and return ``max_tokens`` (the default capped by the room left when the request gives none)."""
    name = "max_completion_tokens" if req.chat and req.max_completion_tokens is not None else "max_tokens"
    asked = req[name]
    keep = req.truncate_prompt_tokens
    if keep is not None:
        if keep == -1:
            keep = max_model_len - max(asked or 1, 1)
        left = req.truncation_side != "right"
        prompts.ids = [(p[-keep:] if left else p[:keep]) if len(p) > keep else p for p in prompts.ids]
    if any(not p for p in prompts.ids):
        raise RequestError("a prompt has no tokens", param="prompt" if not req.chat else "messages")
    longest = max(len(p) for p in prompts.ids)
    room = max_model_len - longest
    if room < 1 or (asked is not None and asked > room):
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {longest} and asks for "
            f"{asked or 1} more: shorten the prompt, lower '{name}' or set 'truncate_prompt_tokens'",
            param=name, code="context_length_exceeded",
        )  # fmt: skip
    if asked is None:
        asked = min(default_max_tokens, room)
    return asked


def sampling_params(req: ParsedRequest, *, index: int, max_tokens: int, eos_token_ids: frozenset[int], vocab: int,
                    defaults: dict[str, Any], constraint: Any = None) -> SamplingParams:  # fmt: skip
    """The engine settings of choice ``index`` (its seed is ``seed + index``, as vLLM's)."""

    def pick(name: str, neutral: Any) -> Any:
        return req[name] if name in req.given else defaults.get(name, neutral)

    temperature = float(pick("temperature", 1.0))
    sample = temperature > 0.0
    top_p, top_k, min_p = float(pick("top_p", 1.0)), int(pick("top_k", 0)), float(pick("min_p", 0.0))
    bias = []
    for key, value in (req.logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < vocab:
            raise RequestError(f"'logit_bias' token {key} is outside the vocabulary [0, {vocab})", param="logit_bias")
        bias.append((token, float(value)))
    stop_ids = frozenset(req.stop_token_ids or ())
    if stop_ids and max(stop_ids) >= vocab:
        raise RequestError(f"'stop_token_ids' must be in [0, {vocab})", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({req.min_tokens}) must not exceed the new tokens asked for ({max_tokens})",
                           param="min_tokens")  # fmt: skip
    if req.chat:
        logprobs = req.top_logprobs if req.logprobs else None
        prompt_logprobs = req.prompt_logprobs
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.prompt_logprobs
        if req.echo and logprobs is not None:  # echo with logprobs reports the prompt's too (vLLM)
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    try:
        return SamplingParams(
            max_new_tokens=max(1, max_tokens),  # echo with max_tokens 0 scores the prompt: one token, dropped
            eos_token_ids=eos_token_ids,
            do_sample=sample,
            temperature=temperature if sample else 1.0,
            top_k=top_k if sample and top_k > 0 else None,
            top_p=top_p if sample and top_p < 1.0 else None,
            min_p=min_p if sample and min_p > 0.0 else None,
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            presence_penalty=float(req.presence_penalty),
            frequency_penalty=float(req.frequency_penalty),
            logit_bias=tuple(bias),
            seed=None if req.seed is None else req.seed + index,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            constraint=constraint,
        )
    except ValueError as e:  # the engine's own range checks, naming the setting
        raise RequestError(str(e)) from e
