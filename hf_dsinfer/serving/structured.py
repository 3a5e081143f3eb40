"""Structured outputs: a token mask per decoding step from a JSON schema, JSON, a regex, a choice list or a grammar.

The grammar engine is **xgrammar** (Apache-2.0; vLLM's and SGLang's default backend). Measured against llguidance
(MIT; OpenAI's, llama.cpp's optional and vLLM's ``guidance`` backend) on SmolLM2-135M's tokenizer (vocab 49152), CPU,
one thread, xgrammar 0.2.8 vs llguidance 1.9.1, on a *loaded* 2-core machine (load average 0.6-4; indicative only):

==========================================  ===========  ============
                                            xgrammar     llguidance
==========================================  ===========  ============
tokenizer info, once per tokenizer          0.41 s       0.86 s
compile: nested schema (enum, array, ...)   24 ms        2 ms
compile: json_object / regex / 4 choices    11 / 1 / 0   1 / 1 / 2 ms
mask per token, a 60-token valid object     9 us         91 us
mask per token, random walks (750 masks)    21 us mean,  50 us mean,
                                            63 us p99    209 us p99, 7 ms max
==========================================  ===========  ============

xgrammar precomputes most of the mask per grammar (hence the slower compile), so the per-step cost on the engine's
stepping thread, which is paid by every request of a batch, is the lower and the steadier; compiled grammars are cached
here, so the compile is paid once per distinct spec. Both ship Linux x86_64 and aarch64 wheels for Python 3.10-3.13
(xgrammar per CPython version, llguidance as abi3); both fill the same int32 bitmask (``ceil(V / 32)`` words per row).
To apply it, xgrammar has a C++ CPU kernel and a Triton kernel on CUDA (``xgrammar.apply_token_bitmask_inplace``);
llguidance applies it with a ``torch.compile``'d function (inductor needs a C compiler on CPU). What xgrammar costs:
its wheel depends on torch, transformers, triton (Linux x86_64) and apache-tvm-ffi. Both engines gave the same allowed
sets on the same random walks.

Specs (``compile_constraint``), one kind each:

- ``{"json_object": True}``: a JSON object (OpenAI's ``json_object``).
- ``{"json_schema": {...}}``: a value valid for the schema. As vLLM with xgrammar: properties in the schema's order,
  properties not declared are refused unless the schema allows them, any whitespace between tokens (add
  ``"any_whitespace": False`` to the spec for xgrammar's fixed ``", "`` and ``": "`` separators, vLLM's
  ``disable_any_whitespace``). Keywords the engine
  would silently not enforce are refused with a ``ValueError`` naming them (``uniqueItems``, ``not``, ``if``,
  ``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``allOf`` of several schemas, look-around in a
  ``pattern``); ``oneOf`` is enforced as ``anyOf``; an unknown ``format`` is an annotation (JSON Schema's rule).
- ``{"regex": "..."}``: the whole output matches the regex (no look-around, no back-references).
- ``{"choice": ["a", "b"]}``: exactly one of the strings.
- ``{"grammar": "..."}``: a context-free grammar in xgrammar's EBNF (GBNF-like: ``root ::= ...``; what vLLM takes
  with xgrammar) when it contains ``::=``, otherwise in Lark syntax with a ``start`` rule (what vLLM's ``guidance``
  backend takes).

A matcher allows the EOS tokens exactly where the grammar may end, and is terminated once it has accepted one. Thread
safety: ``compile_constraint`` may run on any thread (the tokenizer info is built once under a lock, the LRU of
compiled grammars is locked); a ``Matcher`` belongs to one request and is used by one thread (the engine's).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

#: compiled grammars kept per tokenizer (least recently used dropped first)
CACHE_SIZE = 256
SPEC_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_OPTIONS = ("any_whitespace",)
# Schema keywords xgrammar accepts but does not enforce (checked on xgrammar 0.2.8): refused rather than ignored.
_UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies")
# Keywords whose value is one subschema, a list of subschemas, or a name -> subschema map.
_SUB_ONE = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties",
            "unevaluatedItems", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions")
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

_LOCK = threading.Lock()
_COMPILERS: dict[tuple[int, int], _Compiler] = {}


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - the serve and dev extras install it
        raise ImportError(
            "structured outputs need the xgrammar package: pip install xgrammar (or -e '.[serve]' in a clone)"
        ) from e
    return xgrammar


def _engine_message(err: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location: the part a client can act on."""
    return _XGR_PREFIX.sub("", str(err).strip().splitlines()[0] if str(err).strip() else repr(err))


class _Compiler:
    """One tokenizer's xgrammar ``TokenizerInfo`` and ``GrammarCompiler``, with an LRU of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.tokenizer = tokenizer  # held so that the id() key is not reused while cached
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is unbounded: ours (below) is bounded and keyed by the spec
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=8, cache_enabled=False)
        self.cache: OrderedDict[str, Future] = OrderedDict()
        self.lock = threading.Lock()

    def compiled(self, key: str, build: Any) -> Any:
        """The compiled grammar of ``key``: from the cache, or built once even when several threads ask at once
        (the others wait for it); a failed build is not cached."""
        with self.lock:
            future = self.cache.get(key)
            owner = future is None
            if owner:
                future = self.cache[key] = Future()
                while len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(key)
        if owner:  # compile outside the lock: compiles of other specs proceed meanwhile
            try:
                future.set_result(build(self.compiler))
            except BaseException as e:
                future.set_exception(e)
                with self.lock:
                    if self.cache.get(key) is future:
                        del self.cache[key]
        return future.result()


def _compiler(tokenizer: Any, vocab_size: int) -> _Compiler:
    key = (id(tokenizer), int(vocab_size))
    with _LOCK:  # built once per tokenizer even when two threads ask at once (~0.4 s on SmolLM2's tokenizer)
        comp = _COMPILERS.get(key)
        if comp is None:
            comp = _COMPILERS[key] = _Compiler(tokenizer, int(vocab_size))
        return comp


def prepare(tokenizer: Any, vocab_size: int) -> None:
    """Build the tokenizer's grammar-engine info now (at server start) rather than on the first constrained request."""
    _compiler(tokenizer, vocab_size)


def _check_regex(pattern: Any, where: str) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"{where} must be a string (a regular expression), got {type(pattern).__name__}")
    if _LOOKAROUND.search(pattern):
        raise ValueError(f"{where}: look-ahead and look-behind assertions are not supported by the grammar engine")


def _check_schema(schema: Any, path: str) -> None:
    """Refuse what xgrammar would accept without enforcing it (see the module docstring), naming the keyword."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{path} must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
    for keyword in _UNENFORCED:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            raise ValueError(f"{path}.{keyword}: the JSON schema keyword {keyword!r} is not supported by the grammar "
                             "engine (it would not be enforced); remove it from the schema")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise ValueError(f"{path}.allOf: allOf of several schemas is not supported by the grammar engine (it would not "
                         "be enforced); merge them into one schema")
    if "pattern" in schema:
        _check_regex(schema["pattern"], f"{path}.pattern")
    for keyword in _SUB_ONE:
        if isinstance(schema.get(keyword), dict):
            _check_schema(schema[keyword], f"{path}.{keyword}")
    for keyword in _SUB_LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                _check_schema(sub, f"{path}.{keyword}[{i}]")
    for keyword in _SUB_MAP:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                if keyword == "patternProperties":
                    _check_regex(name, f"{path}.patternProperties key {name!r}")
                _check_schema(sub, f"{path}.{keyword}.{name}")


def _validated(spec: Any) -> tuple[str, Any, bool]:
    """``(kind, value, any_whitespace)`` of a spec, or ValueError naming what is wrong with it."""
    if not isinstance(spec, dict):
        raise ValueError(f"a structured-output spec must be a dict, got {type(spec).__name__}")
    kinds = [k for k in SPEC_KINDS if k in spec]
    unknown = sorted(set(spec) - set(SPEC_KINDS) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown structured-output spec key(s) {unknown}; the kinds are {list(SPEC_KINDS)}")
    if len(kinds) != 1:
        raise ValueError(f"a structured-output spec takes exactly one of {list(SPEC_KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    any_whitespace = spec.get("any_whitespace", True)
    if not isinstance(any_whitespace, bool):
        raise ValueError(f"any_whitespace must be a boolean, got {any_whitespace!r}")
    if kind == "json_object" and value is not True:
        raise ValueError(f"json_object must be true, got {value!r}")
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise ValueError(f"json_schema must be a JSON schema object, got {type(value).__name__}")
        _check_schema(value, "json_schema")
    if kind == "regex":
        _check_regex(value, "regex")
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise ValueError("choice must be a non-empty list of strings")
        for i, c in enumerate(value):
            if not isinstance(c, str) or not c:
                raise ValueError(f"choice[{i}] must be a non-empty string, got {c!r}")
    if kind == "grammar" and (not isinstance(value, str) or not value.strip()):
        raise ValueError("grammar must be a non-empty string (xgrammar EBNF with a root rule, or Lark: a start rule)")
    return kind, value, any_whitespace


def _build(kind: str, value: Any, any_whitespace: bool) -> Any:
    """A function of an xgrammar ``GrammarCompiler`` giving the compiled grammar (or ValueError naming the problem)."""

    def build(compiler: Any) -> Any:
        try:
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "json_schema":
                return compiler.compile_json_schema(json.dumps(value), any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":  # EBNF string literals take JSON's escapes
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                         for c in value))
            if "::=" in value:
                return compiler.compile_grammar(value)
            return compiler.compile_lark(value)
        except RuntimeError as e:
            what = {"json_object": "json_object", "json_schema": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar (xgrammar EBNF with a root rule, or Lark with a start rule)"}[kind]
            raise ValueError(f"invalid {what}: {_engine_message(e)}") from None

    return build


class Constraint:
    """A compiled structured-output spec for one tokenizer; ``matcher()`` gives each request its own state."""

    def __init__(self, spec: dict, compiled: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiled = compiled

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""
        return Matcher(self)

    def __repr__(self) -> str:
        return f"Constraint({json.dumps(self.spec)[:80]})"


class Matcher:
    """One request's position in its grammar: the allowed next tokens, and the tokens taken so far."""

    def __init__(self, constraint: Constraint) -> None:
        xgr = _xgrammar()
        self._vocab = constraint.vocab_size
        self._eos = constraint.eos_token_ids
        self._matcher = xgr.GrammarMatcher(constraint._compiled, override_stop_tokens=list(self._eos) or None)
        # [1, ceil(V / 32)] int32, bit j of word i = token 32 i + j; refilled in place at every step
        self._bitmask = xgr.allocate_token_bitmask(1, self._vocab)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed tokens into ``bitmask[row]`` (int32 ``[B, ceil(V / 32)]`` on CPU, xgrammar's packed
        form, for ``xgrammar.apply_token_bitmask_inplace``)."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for t in self._eos:
                word = (int(bitmask[row, t // 32]) & 0xFFFFFFFF) | (1 << (t % 32))
                bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as a signed int32
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed(self, vocab: int) -> torch.Tensor:
        """``[vocab]`` bool, True where the token may come next. Ids past the tokenizer's vocabulary are not allowed;
        once terminated only the EOS tokens are."""
        self.fill_bitmask(self._bitmask)
        # little-endian bytes of the int32 words: bit order "little" gives token 32 i + j at position 32 i + j
        bits = np.unpackbits(self._bitmask[0].numpy().astype("<i4", copy=False).view(np.uint8), bitorder="little")
        if vocab <= self._vocab:
            return torch.from_numpy(bits[:vocab]).view(torch.bool)
        out = torch.zeros(vocab, dtype=torch.bool)
        out[: self._vocab] = torch.from_numpy(bits[: self._vocab]).view(torch.bool)
        return out

    def accept(self, token: int) -> None:
        """Advance past ``token``; ValueError when the grammar does not allow it here (the state is unchanged)."""
        token = int(token)
        if self._matcher.is_terminated():
            raise ValueError(f"token {token} after the constraint was complete (it accepted an EOS token already)")
        if not 0 <= token < self._vocab or not self._matcher.accept_token(token):
            raise ValueError(f"token {token} is not allowed by the structured-output constraint at this position")

    def is_terminated(self) -> bool:
        """The grammar is complete and an EOS token was accepted: the request is finished."""
        return bool(self._matcher.is_terminated())

    def can_stop(self) -> bool:
        """The text so far is a complete match (an EOS token is allowed next)."""
        return bool(self._matcher.is_terminated() or self._matcher.is_completed())


def _eos_ids(tokenizer: Any, eos_token_ids: Iterable[int] | None) -> tuple[int, ...]:
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    return tuple(sorted({int(t) for t in eos_token_ids if int(t) >= 0}))


def compile_constraint(spec: dict, tokenizer: Any, vocab_size: int,
                       eos_token_ids: Iterable[int] | None = None) -> Constraint:
    """Compile a structured-output spec (module docstring) for ``tokenizer``'s tokens; ``vocab_size`` is the LM head's
    (ids past the tokenizer's are never allowed). ``eos_token_ids``: the tokens that end the output where the grammar
    may end (default: the tokenizer's EOS). Invalid spec, schema, regex or grammar: ValueError naming the problem.

    Compiles of the same spec (same JSON, key order included: xgrammar keeps the schema's property order) are cached.
    The first call per tokenizer builds its vocabulary info (about half a second on SmolLM2); see :func:`prepare`.
    """
    kind, value, any_whitespace = _validated(spec)
    comp = _compiler(tokenizer, vocab_size)
    key = json.dumps([kind, value, any_whitespace], ensure_ascii=False, separators=(",", ":"))
    compiled = comp.compiled(key, _build(kind, value, any_whitespace))
    eos = _eos_ids(tokenizer, eos_token_ids)
    if any(t >= vocab_size for t in eos):
        raise ValueError(f"eos_token_ids {list(eos)} out of the vocabulary of {vocab_size} tokens")
    return Constraint(dict(spec), compiled, int(vocab_size), eos)


def _json_schema_value(value: Any, field: str) -> dict:
    """A JSON schema given as a dict or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON schema object, got {type(value).__name__}")
    return value


def response_format_to_spec(response_format: dict | None) -> dict | None:
    """OpenAI's ``response_format`` as a spec for :func:`compile_constraint` (None: unconstrained text).

    ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "description": ..., "strict": ...}}``; anything else is a ValueError naming the field.
    ``strict`` is accepted either way: the schema is always enforced (as vLLM does).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise ValueError(f"response_format.type must be one of {list(allowed)}, got {kind!r}")
    extra = sorted(set(response_format) - allowed[kind])
    if extra:
        raise ValueError(f"response_format of type {kind!r} does not take the field(s) {extra}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
    extra = sorted(set(js) - {"name", "schema", "description", "strict"})
    if extra:
        raise ValueError(f"response_format.json_schema does not take the field(s) {extra}")
    name = js.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"response_format.json_schema.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise ValueError(f"response_format.json_schema.strict must be a boolean, got {js['strict']!r}")
    if "schema" not in js:
        raise ValueError("response_format.json_schema.schema is required (the JSON schema of the response)")
    return {"json_schema": _json_schema_value(js["schema"], "response_format.json_schema.schema")}


def structured_outputs_to_spec(obj: dict | None) -> dict | None:
    """vLLM's ``structured_outputs`` request field as a spec: exactly one of ``json`` (a schema, dict or JSON text),
    ``json_object``, ``regex``, ``choice``, ``grammar``; ``disable_any_whitespace`` (no free whitespace) and
    ``disable_fallback`` (no effect: one backend) are accepted; other vLLM options are refused by name."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"structured_outputs must be an object, got {type(obj).__name__}")
    kinds = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
             "grammar": "grammar"}
    options = {"disable_any_whitespace", "disable_fallback"}
    unknown = sorted(set(obj) - set(kinds) - options)
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]} is not supported here; use one of {list(kinds)}")
    given = [k for k in kinds if obj.get(k) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured_outputs takes exactly one of {list(kinds)}, got {given or 'none'}")
    field = given[0]
    value = obj[field]
    if field == "json":
        value = _json_schema_value(value, "structured_outputs.json")
    spec: dict[str, Any] = {kinds[field]: value}
    for flag in options:
        if obj.get(flag) is not None and not isinstance(obj[flag], bool):
            raise ValueError(f"structured_outputs.{flag} must be a boolean, got {obj[flag]!r}")
    if obj.get("disable_any_whitespace"):
        spec["any_whitespace"] = False
    try:
        _validated(spec)
    except ValueError as e:
        raise ValueError(f"structured_outputs.{field}: {e}") from None
    return spec
