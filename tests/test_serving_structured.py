"""Structured outputs (``serving.structured``) on SmolLM2's tokenizer with random logits: no model needed.

Every run samples its first 20 tokens from random logits under the mask, then steers towards an end (EOS when allowed,
else closing tokens) and checks the text against the spec with checkers independent of the grammar engine: ``json``
plus a small JSON-schema validator, ``re.fullmatch``, membership in the choices.
"""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path

pytest.importorskip("xgrammar", reason="the serve and dev extras install xgrammar")
pytestmark = pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`")

from hf_dsinfer.serving import structured  # noqa: E402
from hf_dsinfer.serving.structured import (  # noqa: E402
    compile_constraint,
    response_format_to_spec,
    structured_outputs_to_spec,
)

V = 49152  # SmolLM2's LM head = its tokenizer
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PHONE = r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", 'say "maybe"', "naïve\tmixed"]


def validate(value, schema, path="$"):
    """A small JSON-schema validator for the keywords these tests use; AssertionError names the path."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), path
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), path
    elif kind is not None:
        assert isinstance(value, types[kind]), (path, kind, value)
    if "enum" in schema:
        assert value in schema["enum"], path
    if "const" in schema:
        assert value == schema["const"], path
    if "minimum" in schema:
        assert value >= schema["minimum"], path
    if "pattern" in schema:
        assert re.search(schema["pattern"], value), (path, value)
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                return validate(value, sub, path)
            except AssertionError as e:
                errors.append(e)
        raise AssertionError((path, "no anyOf branch", errors))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (path, "missing", key)
        for key, item in value.items():
            if key in props:
                validate(item, props[key], f"{path}.{key}")
            else:
                assert schema.get("additionalProperties", True) is not False, (path, "extra", key)
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value)), path
        assert len(value) >= schema.get("minItems", 0), path
        for i, item in enumerate(value):
            if "items" in schema:
                validate(item, schema["items"], f"{path}[{i}]")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def steering_bias(tok):
    """[len(tok)] logit bias to end an output: + for tokens made only of closing characters (they end strings, arrays
    and objects), - for whitespace-only tokens (JSON allows any whitespace between tokens; random logits pick it)."""
    texts = tok.batch_decode([[i] for i in range(len(tok))])
    bias = torch.zeros(len(tok))
    bias[[i for i, t in enumerate(texts) if t.strip() and set(t.strip()) <= set('"}])')]] = 50.0
    bias[[i for i, t in enumerate(texts) if t and not t.strip()]] = -50.0
    return bias


@pytest.fixture(scope="module")
def closers(tok):
    return steering_bias(tok)


def run(constraint, tok, closers, seed, free_steps=20, limit=400, vocab=V):
    """Sample under the mask: random logits for ``free_steps`` tokens, then EOS when allowed, else closers first.
    Returns the generated ids without the final EOS; asserts the matcher terminated."""
    gen = torch.Generator().manual_seed(seed)
    matcher = constraint.matcher()
    eos = tok.eos_token_id
    ids = []
    for step in range(limit):
        allowed = matcher.allowed(vocab)
        assert allowed.shape == (vocab,) and allowed.dtype == torch.bool and allowed.any()
        logits = torch.randn(vocab, generator=gen)
        if step >= free_steps:
            logits[: len(closers)] += closers
            logits[eos] += 100.0
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        matcher.accept(token)
        if matcher.is_terminated():
            assert token == eos
            return ids
        assert token != eos
        ids.append(token)
    raise AssertionError(f"not terminated after {limit} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate(tok, closers, seed):
    constraint = compile_constraint({"json_schema": SCHEMA}, tok, V)
    text = tok.decode(run(constraint, tok, closers, seed))
    validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_object_outputs_parse_as_objects(tok, closers, seed):
    text = tok.decode(run(compile_constraint({"json_object": True}, tok, V), tok, closers, seed))
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(3))
def test_regex_outputs_match(tok, closers, seed):
    text = tok.decode(run(compile_constraint({"regex": PHONE}, tok, V), tok, closers, seed, free_steps=100))
    assert re.fullmatch(PHONE, text), text


@pytest.mark.parametrize("seed", range(4))
def test_choice_outputs_are_choices(tok, closers, seed):
    text = tok.decode(run(compile_constraint({"choice": CHOICES}, tok, V), tok, closers, seed, free_steps=100))
    assert text in CHOICES


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "(" item (", " item)* ")"\nitem ::= [a-z]+ | [0-9]+',  # xgrammar's EBNF
        'start: "(" item (", " item)* ")"\nitem: /[a-z]+/ | /[0-9]+/',  # Lark
    ],
)
def test_grammar_outputs_match(tok, closers, grammar):
    text = tok.decode(run(compile_constraint({"grammar": grammar}, tok, V), tok, closers, seed=7, free_steps=8))
    assert re.fullmatch(r"\((?:[a-z]+|[0-9]+)(?:, (?:[a-z]+|[0-9]+))*\)", text), text


def test_eos_only_where_the_grammar_may_end(tok):
    matcher = compile_constraint({"choice": ["yes", "yesterday"]}, tok, V).matcher()
    eos = tok.eos_token_id
    assert not matcher.allowed(V)[eos] and not matcher.can_stop()
    for t in tok.encode("yes", add_special_tokens=False):
        matcher.accept(t)
    allowed = matcher.allowed(V)
    assert allowed[eos] and allowed.sum() > 1 and matcher.can_stop()  # "yes" may end or go on to "yesterday"
    assert not matcher.is_terminated()
    matcher.accept(eos)
    assert matcher.is_terminated()
    assert matcher.allowed(V).nonzero().flatten().tolist() == [eos]
    with pytest.raises(ValueError, match="complete"):
        matcher.accept(eos)


def test_rejected_token_raises_and_leaves_the_state(tok):
    matcher = compile_constraint({"choice": ["positive", "negative"]}, tok, V).matcher()
    before = matcher.allowed(V).clone()
    with pytest.raises(ValueError, match="not allowed"):
        matcher.accept(tok.encode("Hello", add_special_tokens=False)[0])
    with pytest.raises(ValueError, match="not allowed"):
        matcher.accept(V + 3)
    assert torch.equal(matcher.allowed(V), before)


def test_larger_lm_head_vocab_disallows_the_extra_ids(tok, closers):
    constraint = compile_constraint({"json_object": True}, tok, V + 64)
    allowed = constraint.matcher().allowed(V + 64)
    assert allowed.shape == (V + 64,) and allowed[: V].any() and not allowed[V:].any()
    assert isinstance(json.loads(tok.decode(run(constraint, tok, closers, seed=1, vocab=V + 64))), dict)


def test_allowed_matches_the_packed_bitmask(tok):
    import xgrammar

    matcher = compile_constraint({"json_schema": SCHEMA}, tok, V).matcher()
    for t in tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False):
        matcher.accept(t)
    bitmask = xgrammar.allocate_token_bitmask(2, V)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.zeros(2, V)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=[1])
    assert torch.equal(logits[1] == 0, matcher.allowed(V))
    assert torch.equal(logits[0], torch.zeros(V))  # an unconstrained row is left alone


def test_whitespace_option(tok):
    newline = [i for i in range(len(tok)) if tok.decode([i]) == "\n"]
    free = compile_constraint({"json_object": True}, tok, V).matcher()
    tight = compile_constraint({"json_object": True, "any_whitespace": False}, tok, V).matcher()
    for m in (free, tight):
        m.accept(tok.encode("{", add_special_tokens=False)[0])
    assert free.allowed(V)[newline].all() and not tight.allowed(V)[newline].any()


def test_compiled_grammars_are_cached_by_spec(tok):
    a = compile_constraint({"json_schema": SCHEMA}, tok, V)
    b = compile_constraint(json.loads(json.dumps({"json_schema": SCHEMA})), tok, V)
    reordered = {"json_schema": {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}}
    c = compile_constraint(reordered, tok, V)  # key order is part of the key: xgrammar keeps property order
    assert a._compiled is b._compiled and a._compiled is not c._compiled


def test_tokenizer_info_built_once_across_threads(monkeypatch):
    import xgrammar
    from transformers import AutoTokenizer

    fresh = AutoTokenizer.from_pretrained(smollm2_path())  # a tokenizer object no other test has prepared
    calls = []
    original = xgrammar.TokenizerInfo.from_huggingface

    def counting(*args, **kwargs):
        calls.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", counting)
    specs = [{"regex": "[a-z]{3}"}, {"choice": ["x", "y"]}, {"json_object": True}, {"regex": "[a-z]{3}"}]
    with ThreadPoolExecutor(4) as pool:
        constraints = list(pool.map(lambda s: compile_constraint(s, fresh, V), specs))
    assert len(calls) == 1
    assert constraints[0]._compiled is constraints[3]._compiled
    structured._COMPILERS.pop((id(fresh), V))


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json_schema": {"type": "objekt"}}, "invalid JSON schema: .*objekt"),
        ({"json_schema": {"type": "array", "minItems": 3, "maxItems": 1}}, "minItems"),
        ({"json_schema": {"$ref": "#/$defs/missing"}}, "invalid JSON schema"),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema.uniqueItems"),
        ({"json_schema": {"properties": {"a": {"not": {"type": "string"}}}}}, r"json_schema.properties.a.not"),
        ({"json_schema": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}, "allOf"),
        ({"json_schema": {"type": "string", "pattern": "(?!x)y"}}, "pattern: look-ahead"),
        ({"json_schema": [1]}, "JSON schema object"),
        ({"regex": "a(b"}, "invalid regex: .*parenthesis"),
        ({"regex": "(a)\\1"}, "invalid regex: .*[Bb]ackreference"),
        ({"grammar": "root ::= undefined_rule"}, "invalid grammar.*undefined_rule"),
        ({"grammar": "start: missing"}, "invalid grammar.*missing"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", 3]}, r"choice\[1\]"),
        ({"json_object": False}, "json_object must be true"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"json": {}}, "unknown structured-output spec key"),
        ({"json_object": True, "any_whitespace": "no"}, "any_whitespace"),
    ],
)
def test_invalid_specs_raise_value_error(tok, spec, message):
    with pytest.raises(ValueError, match=message):
        compile_constraint(spec, tok, V)
    assert compile_constraint({"regex": "ok"}, tok, V).matcher().allowed(V).any()  # still usable


def test_property_names_are_not_taken_for_keywords(tok):
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    compile_constraint({"json_schema": schema}, tok, V)  # properties named like keywords are fine


def test_response_format_to_spec():
    assert response_format_to_spec(None) is None
    assert response_format_to_spec({"type": "text"}) is None
    assert response_format_to_spec({"type": "json_object"}) == {"json_object": True}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    assert response_format_to_spec(rf) == {"json_schema": SCHEMA}
    bad = [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, r"does not take the field\(s\) \['schema'\]"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema is required"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}}, "strict"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "extra": 1}}, r"\['extra'\]"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": 5}}, "schema must be a JSON schema"),
        ("json", "response_format must be an object"),
    ]
    for rf, message in bad:
        with pytest.raises(ValueError, match=message):
            response_format_to_spec(rf)


def test_structured_outputs_to_spec():
    assert structured_outputs_to_spec(None) is None
    assert structured_outputs_to_spec({"json": SCHEMA}) == {"json_schema": SCHEMA}
    assert structured_outputs_to_spec({"json": json.dumps(SCHEMA)}) == {"json_schema": SCHEMA}
    assert structured_outputs_to_spec({"regex": PHONE, "disable_fallback": True}) == {"regex": PHONE}
    assert structured_outputs_to_spec({"choice": CHOICES}) == {"choice": CHOICES}
    assert structured_outputs_to_spec({"grammar": "root ::= \"a\""}) == {"grammar": "root ::= \"a\""}
    assert structured_outputs_to_spec({"json_object": True, "disable_any_whitespace": True}) == {
        "json_object": True, "any_whitespace": False}
    assert structured_outputs_to_spec({"json_object": False, "regex": "a"}) == {"regex": "a"}
    bad = [
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern is not supported"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag is not supported"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"choice": "abc"}, "structured_outputs.choice: choice must be a non-empty list"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace must be a boolean"),
        ([1], "structured_outputs must be an object"),
    ]
    for obj, message in bad:
        with pytest.raises(ValueError, match=message):
            structured_outputs_to_spec(obj)
