"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for ``hf-dsinfer serve`` (both runners), and
:func:`chat_prompt_ids`, the chat-template rendering these routes share with the embeddings route.

``/tokenize`` takes ``prompt`` (a text; ``add_special_tokens`` default true) or ``messages`` (a chat rendered by the
model's chat template; ``add_generation_prompt`` default true, ``add_special_tokens`` default false, as vLLM) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. Unknown fields get a 400 naming them.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime.
from typing import Any

from .http_common import RequestError, json_body, param

__all__ = ["TokenizeService", "chat_prompt_ids"]

# vLLM's fields of each request. Anything else is refused by name.
_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {
    "model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs",
}  # fmt: skip
# apply_chat_template arguments a request's chat_template_kwargs must not set (this layer sets or forbids them).
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask",
}  # fmt: skip


def _message(m: Any) -> dict:
    """One chat message for the template: OpenAI's text parts (``[{"type": "text", "text": ...}]``) joined."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError("each message must be an object with a string 'role'", param="messages")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise RequestError("message content parts must be text parts ({'type': 'text', 'text': ...}); this "
                               "model takes text only", param="messages")  # fmt: skip
        m = {**m, "content": "".join(str(p.get("text", "")) for p in content)}
    elif content is not None and not isinstance(content, str):
        raise RequestError("a message's 'content' must be a string or a list of text parts", param="messages")
    return m


def chat_prompt_ids(tokenizer: Any, messages: Any, *, add_generation_prompt: bool | None = True,
                    continue_final_message: bool | None = False, add_special_tokens: bool = False,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None,
                    tools: list | None = None) -> list[int]:  # fmt: skip
    """The prompt token ids of a chat: ``tokenizer.apply_chat_template(messages, ...)`` as text, then tokenized with
    ``add_special_tokens`` (false by default: the template writes them). With the defaults this is what
    ``/v1/chat/completions`` feeds the model. Raises :class:`RequestError` (400) naming the bad field.

    ``continue_final_message`` leaves the last message open (no generation prompt; asking for both is an error).
    ``chat_template_kwargs`` reach the template as variables (vLLM's field).
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    messages = [_message(m) for m in messages]
    if continue_final_message and add_generation_prompt:
        raise RequestError("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                           param="continue_final_message")  # fmt: skip
    if chat_template is not None and not isinstance(chat_template, str):
        raise RequestError("'chat_template' must be a string (a Jinja template)", param="chat_template")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template: send 'prompt' (text), or a 'chat_template'",
                           param="messages")  # fmt: skip
    kwargs = chat_template_kwargs or {}
    if not isinstance(kwargs, dict) or set(kwargs) & _RESERVED_TEMPLATE_KWARGS:
        reserved = ", ".join(sorted(_RESERVED_TEMPLATE_KWARGS))
        raise RequestError(f"'chat_template_kwargs' must be an object of template variables (not {reserved})",
                           param="chat_template_kwargs")  # fmt: skip
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of tool objects", param="tools")
    kwargs = dict(kwargs)
    kwargs["add_generation_prompt"] = bool(add_generation_prompt)
    kwargs["continue_final_message"] = bool(continue_final_message)
    if tools:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template that cannot render these messages is the request's fault
        raise RequestError(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                           param="messages") from e  # fmt: skip
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


class TokenizeService:
    """``POST /tokenize`` and ``POST /detokenize`` over one tokenizer.

    Args:
        tokenizer: the model's tokenizer.
        model_name: the id clients may pass as ``model`` (optional in these requests, as in vLLM).
        max_model_len: the model's context length, reported by ``/tokenize``.
    """

    def __init__(self, tokenizer: Any, model_name: str, max_model_len: int):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len

    def register(self, app: Any) -> None:
        """Add the routes to the FastAPI ``app``."""
        from fastapi import Request

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict:
            return self.tokenize(await json_body(request))

        @app.post("/detokenize")
        async def detokenize(request: Request) -> dict:
            return self.detokenize(await json_body(request))

    def _check(self, body: dict, fields: set[str]) -> None:
        for name in body:
            if name in fields:
                continue
            if name in _CHAT_FIELDS:  # a chat option on a text prompt
                raise RequestError(f"'{name}' applies to 'messages' (a chat), not to 'prompt'", param=name)
            raise RequestError(f"Unrecognized request argument supplied: '{name}'; this route takes: "
                               f"{', '.join(sorted(fields))}", param=name)  # fmt: skip
        model = param(body, "model", str)
        if model is not None and model != self.model_name:
            raise RequestError(f"The model '{model}' does not exist: this server serves '{self.model_name}'",
                               status=404, param="model", code="model_not_found")  # fmt: skip

    def tokenize(self, body: dict) -> dict:
        """The answer of ``/tokenize`` to ``body``; raises :class:`RequestError`."""
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise RequestError("pass exactly one of 'prompt' (a text) and 'messages' (a chat)", param="prompt")
        if body.get("prompt") is not None:
            self._check(body, _PROMPT_FIELDS)
            prompt = param(body, "prompt", str)
            special = param(body, "add_special_tokens", bool, True)
            ids = self.tokenizer(prompt, add_special_tokens=special)["input_ids"]
        else:
            self._check(body, _CHAT_FIELDS)
            for name in ("mm_processor_kwargs", "media_io_kwargs"):
                if body.get(name):
                    raise RequestError(f"'{name}' is for multimodal models; this one takes text only", param=name)
            continue_final = param(body, "continue_final_message", bool, False)
            # vLLM's default is true, unless the last message is continued (then false unless asked for).
            generation_prompt = param(body, "add_generation_prompt", bool, not continue_final)
            ids = chat_prompt_ids(
                self.tokenizer, body["messages"], add_generation_prompt=generation_prompt,
                continue_final_message=continue_final,
                add_special_tokens=param(body, "add_special_tokens", bool, False),
                chat_template=body.get("chat_template"),
                chat_template_kwargs=param(body, "chat_template_kwargs", dict), tools=body.get("tools"),
            )  # fmt: skip
        strs = self.tokenizer.convert_ids_to_tokens(ids) if param(body, "return_token_strs", bool, False) else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: dict) -> dict:
        """The answer of ``/detokenize`` to ``body``; raises :class:`RequestError`."""
        self._check(body, {"model", "tokens"})
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestError("'tokens' must be a list of token ids", param="tokens")
        vocab = len(self.tokenizer)
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of this model's vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(tokens)}
