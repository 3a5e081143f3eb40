"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for ``hf-dsinfer serve`` (both runners), and
:func:`chat_prompt_ids`, the chat-template rendering these routes share with the embeddings route.

``/tokenize`` takes ``prompt`` (a text; ``add_special_tokens`` default true) or ``messages`` (a chat rendered by the
model's chat template; ``add_generation_prompt`` default true, ``add_special_tokens`` default false, as vLLM) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with ``return_token_strs``).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. Unknown fields get a 400 naming them.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``request: Request``) at runtime.
from typing import Any

from .http_common import RequestError, json_body, model_not_found, param, unknown_field

__all__ = ["TokenizeService", "chat_prompt_ids"]

# vLLM's fields of each request. Anything else is refused by name.
_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {
    "model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "tools", "documents", "mm_processor_kwargs", "media_io_kwargs",
}  # fmt: skip


def chat_prompt_ids(tokenizer: Any, messages: Any, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    chat_template_kwargs: dict | None = None, tools: list | None = None,
                    documents: list | None = None) -> list[int]:  # fmt: skip
    """The prompt token ids ``/v1/chat/completions`` feeds the model for this chat: the same fields are validated by
    the chat route's own parser (:func:`.protocol.parse_request`) and rendered by its own code
    (:func:`.engine_requests.chat_prompt`: the chat template as text, then tokenized with ``add_special_tokens``,
    tools written as text for templates that ignore them). Raises :class:`RequestError` (400) naming the bad field.
    """
    from .engine_requests import chat_prompt
    from .protocol import parse_request

    body = {"messages": messages, "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message, "add_special_tokens": add_special_tokens,
            "chat_template_kwargs": chat_template_kwargs, "tools": tools, "documents": documents}  # fmt: skip
    request = parse_request({k: v for k, v in body.items() if v is not None}, chat=True)
    return list(chat_prompt(request, tokenizer).ids[0])


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
            raise unknown_field(name, "this route", fields)
        model = param(body, "model", str)
        if model is not None and model != self.model_name:
            raise model_not_found(model, self.model_name)

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
            if body.get("chat_template") is not None:  # as the chat route (and vLLM without its trust flag)
                raise RequestError("'chat_template': a per-request Jinja template is refused, as by the chat route; "
                                   "the model's own template renders the chat", param="chat_template")  # fmt: skip
            ids = chat_prompt_ids(
                self.tokenizer, body["messages"], add_generation_prompt=generation_prompt,
                continue_final_message=continue_final,
                add_special_tokens=param(body, "add_special_tokens", bool, False),
                chat_template_kwargs=param(body, "chat_template_kwargs", dict), tools=body.get("tools"),
                documents=body.get("documents"),
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
