"""Tool calling (``serving.tool_calls``): tools / tool_choice validation, the required / named constraint (compiled
and sampled with random logits on SmolLM2's tokenizer), and the hermes / json parsers whole and streamed."""

import json
import random
import re

import pytest

from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path
from hf_dsinfer.serving.tool_calls import (
    HermesToolParser,
    JsonToolParser,
    default_parser,
    make_tool_parser,
    template_renders_tools,
    tool_calls_as_text,
    tool_choice_spec,
    tools_system_prompt,
    validate_tools,
)

needs_smollm2 = pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: `{SMOLLM2_INSTALL}`")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD_PERSON = {  # its own $defs and a $ref: hoisted to the top of the call schema
    "type": "function",
    "function": {
        "name": "add_person",
        "parameters": {
            "type": "object",
            "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                  "additionalProperties": False}},
            "properties": {"age": {"type": "integer", "minimum": 0}, "home": {"$ref": "#/$defs/Address"}},
            "required": ["age", "home"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD_PERSON, NO_ARGS]
NAMES = ["get_weather", "add_person", "now"]

HERMES_OUTPUTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {"s": "} ] { \\" <tool_call>", "n": [1, {"x": null}]}}</tool_call>\n'
    '<tool_call> {"arguments": {}, "name": "b"} </tool_call> and after',
    '<tool_call>\n{"name": "now"}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": 1}}',  # stopped before the close tag
    "Plain answer, a < b and <tool no call. ",
    "",
]
JSON_OUTPUTS = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, {"name": "now", "parameters": {}}]',
    '  {"name": "add_person", "arguments": {"age": 3, "home": {"city": "}{"}}}\n',
    '{"arguments": {"city": "x", "unit": "F"}, "name": "get_weather"}',
    '{"name": "now"}',
    "The answer is 42.",
    '{"answer": 42}',
    '{"name": "undeclared", "arguments": {}}',
    "[]",
    "   ",
]


def merge(deltas):
    """Concatenate streamed deltas as an OpenAI client does: content, and each call's name and arguments."""
    content, calls = "", {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # a call's first delta
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"])
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [calls[i] for i in sorted(calls)]


def plain(result):
    content, calls = result
    for c in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
    return content, [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def streamed(parser, text, rng):
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
    deltas, prev = [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[prev:cut])
        prev = cut
    return merge(deltas + parser.finish())


@pytest.mark.parametrize("name, outputs", [("hermes", HERMES_OUTPUTS), ("json", JSON_OUTPUTS)])
def test_streamed_deltas_add_up_to_the_parse(name, outputs):
    rng = random.Random(0)
    for text in outputs:
        whole = plain(make_tool_parser(name, NAMES if name == "json" else None).parse(text))
        for _ in range(25):
            assert streamed(make_tool_parser(name, NAMES if name == "json" else None), text, rng) == whole, text


def test_hermes_parse():
    content, calls = plain(HermesToolParser().parse(HERMES_OUTPUTS[1]))
    assert content == "and after"
    assert [c["name"] for c in calls] == ["a", "b"]
    assert calls[0]["arguments"] == '{"s": "} ] { \\" <tool_call>", "n": [1, {"x": null}]}'  # as written
    assert json.loads(calls[0]["arguments"]) == {"s": '} ] { " <tool_call>', "n": [1, {"x": None}]}
    assert calls[1]["arguments"] == "{}"
    assert plain(HermesToolParser().parse(HERMES_OUTPUTS[0])) == (
        "Let me check.", [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}])
    assert plain(HermesToolParser().parse(HERMES_OUTPUTS[2]))[1] == [{"name": "now", "arguments": "{}"}]
    assert plain(HermesToolParser().parse(HERMES_OUTPUTS[3]))[1] == [{"name": "f", "arguments": '{"q": 1}'}]
    assert plain(HermesToolParser().parse(HERMES_OUTPUTS[4]))[1] == [{"name": "f", "arguments": '{"q": 1}'}]
    assert HermesToolParser().parse(HERMES_OUTPUTS[5]) == (HERMES_OUTPUTS[5], [])
    assert HermesToolParser().parse("") == (None, [])
    bad = 'Hi <tool_call>{"name": "f", "arguments": {oops}}</tool_call>'
    assert HermesToolParser().parse(bad) == (bad, [])  # a malformed call: the whole text is content (as vLLM)


def test_json_parse():
    parser = JsonToolParser(NAMES)
    assert plain(parser.parse(JSON_OUTPUTS[0])) == (None, [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}, {"name": "now", "arguments": "{}"}])
    assert plain(parser.parse(JSON_OUTPUTS[1])) == (None, [
        {"name": "add_person", "arguments": '{"age": 3, "home": {"city": "}{"}}'}])
    assert plain(parser.parse(JSON_OUTPUTS[2]))[1] == [
        {"name": "get_weather", "arguments": '{"city": "x", "unit": "F"}'}]
    for text in [*JSON_OUTPUTS[4:], '{"name": "now", "arguments": {}} trailing']:
        assert parser.parse(text) == (text, []), text  # not (only) calls of declared tools: content
    assert plain(JsonToolParser().parse(JSON_OUTPUTS[6]))[1][0]["name"] == "undeclared"  # no names given: any name


def header(delta):
    """The (index, name) of a call's first delta, after checking its OpenAI shape."""
    (tc,) = delta["tool_calls"]
    assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
    assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"]) and tc["function"]["arguments"] == ""
    return tc["index"], tc["function"]["name"]


def args(index, text):
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def test_hermes_streams_without_holding_back_more_than_it_must():
    p = HermesToolParser()
    assert p.feed("Hello wor") == [{"content": "Hello wor"}]
    assert p.feed("ld \n") == [{"content": "ld"}]  # the whitespace waits: it is dropped before a call
    assert p.feed("<tool") == []  # may be the open tag
    out = p.feed('_call>\n{"name": "get_weather", "arguments": {"ci')
    assert header(out[0]) == (0, "get_weather") and out[1:] == [args(0, '{"ci')]
    assert p.feed('ty": "Paris"}}\n</tool_') == [args(0, 'ty": "Paris"}')]
    assert p.feed("call>\n\nBye") == [{"content": "Bye"}]
    assert p.finish() == []
    q = HermesToolParser()
    assert q.feed("a <tox") == [{"content": "a <tox"}]  # not the tag after all
    assert q.feed(" ") == [] and q.finish() == [{"content": " "}]  # trailing whitespace of the output is content


def test_json_streams_without_holding_back_more_than_it_must():
    q = JsonToolParser(NAMES)
    assert q.feed('[{"name": "get_we') == []  # not yet known to be a call of a declared tool
    out = q.feed('ather", "parameters": {"ci')
    assert header(out[0]) == (0, "get_weather") and out[1:] == [args(0, '{"ci')]
    assert q.feed('ty": "Paris"') == [args(0, 'ty": "Paris"')]
    out = q.feed(', "unit": "C"}}, {"name": "now", "parameters": {')
    assert out[0] == args(0, ', "unit": "C"}') and header(out[1]) == (1, "now") and out[2:] == [args(1, "{")]
    assert q.feed("}}]") == [args(1, "}")] and q.finish() == []
    r = JsonToolParser(NAMES)
    assert r.feed("Sure") == [{"content": "Sure"}] and r.feed(", here.") == [{"content": ", here."}]
    u = JsonToolParser(NAMES)
    assert u.feed('{"name": "undeclared", "argu') == [{"content": '{"name": "undeclared", "argu'}]
    assert u.feed("ments") == [{"content": "ments"}]


@pytest.mark.parametrize(
    "tools, message",
    [
        ("get_weather", "tools must be a list"),
        ([{"type": "code_interpreter"}], r"tools\[0\].type must be 'function'"),
        ([{"type": "function"}], r"tools\[0\].function must be an object"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\].function.name"),
        ([WEATHER, {"type": "function", "function": {"name": "get_weather"}}], r"tools\[1\].function.name .* twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], r"tools\[0\].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "type 'object'"),
        ([{"type": "function", "function": {"name": "f", "params": {}}}], r"does not take the field\(s\) \['params'\]"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], r"tools\[0\] does not take"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
    ],
)
def test_invalid_tools(tools, message):
    with pytest.raises(ValueError, match=message):
        tool_choice_spec(tools, "required")


@pytest.mark.parametrize(
    "tool_choice, message",
    [
        ("always", "tool_choice must be"),
        ({"type": "function", "function": {"name": "missing"}}, r"tool_choice.function.name 'missing' is not one"),
        ({"type": "function", "function": {}}, "tool_choice.function must be"),
        ({"type": "allowed_tools", "tools": []}, "tool_choice as an object must be"),
        ({"type": "function", "name": "now"}, "tool_choice as an object must be"),
    ],
)
def test_invalid_tool_choice(tool_choice, message):
    with pytest.raises(ValueError, match=message):
        tool_choice_spec(TOOLS, tool_choice)


def test_tool_choice_spec_shapes():
    for choice in (None, "none", "auto"):
        assert tool_choice_spec(TOOLS, choice) is None
    assert tool_choice_spec(None, None) is None
    with pytest.raises(ValueError, match="tool_choice 'required' needs tools"):
        tool_choice_spec([], "required")
    schema = tool_choice_spec(TOOLS, "required")["json_schema"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [[n] for n in NAMES]
    assert schema["$defs"]["tool_1_parameters"]["properties"]["home"] == {
        "$ref": "#/$defs/tool_1_parameters/$defs/Address"}
    assert tool_choice_spec(TOOLS, "required", parallel_tool_calls=False)["json_schema"]["maxItems"] == 1
    named = tool_choice_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}})["json_schema"]
    assert named["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert named["properties"]["parameters"] == WEATHER["function"]["parameters"]
    with pytest.raises(ValueError, match=r"tools\[0\].function.parameters.properties.x.uniqueItems"):
        tool_choice_spec([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}], "required")


def test_validate_tools_defaults():
    assert validate_tools([NO_ARGS]) == [{"name": "now", "description": None,
                                          "parameters": {"type": "object", "properties": {}}}]


def resolve(schema, root):
    """``schema`` with a ``$ref`` into ``root`` followed (for the validator of the structured tests)."""
    while "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return {k: resolve(v, root) if isinstance(v, dict) and k != "enum" else
            ({p: resolve(s, root) for p, s in v.items()} if k == "properties" else v) for k, v in schema.items()}


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("xgrammar", reason="the serve and dev extras install xgrammar")
    from test_serving_structured import steering_bias
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    return tok, steering_bias(tok)


@needs_smollm2
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_constrained_sampling_gives_valid_calls(smollm2, choice, seed):
    from test_serving_structured import V, run, validate

    from hf_dsinfer.serving.structured import compile_constraint

    tok, bias = smollm2
    named = NAMES[seed % len(NAMES)]
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": named}}
    constraint = compile_constraint(tool_choice_spec(TOOLS, tool_choice), tok, V)
    text = tok.decode(run(constraint, tok, bias, seed, free_steps=25))
    content, calls = JsonToolParser(NAMES).parse(text)
    assert content is None and calls, text
    if choice == "named":
        assert [c["function"]["name"] for c in calls] == [named]
    by_name = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for call in calls:
        params = by_name[call["function"]["name"]]
        validate(json.loads(call["function"]["arguments"]), resolve(params, params))


@needs_smollm2
def test_smollm2_template_and_fallback_text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    assert default_parser(tok) == "json" and not template_renders_tools(tok)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with_tools = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert with_tools == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # ignored
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]
    round_trip = messages + [
        {"role": "assistant", "content": tool_calls_as_text(calls)},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = tok.apply_chat_template(round_trip, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>tool\n22 C<|im_end|>" in text
    assert plain(JsonToolParser(NAMES).parse(tool_calls_as_text(calls)))[1] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}]
    prompt = tools_system_prompt(TOOLS)
    assert all(n in prompt for n in NAMES) and '"arguments"' in prompt


def test_default_parser_by_template():
    class Tok:
        chat_template = "{% for tool in tools %}...{% endfor %}<tool_call>\n{{ call | tojson }}\n</tool_call>"

    assert default_parser(Tok()) == "hermes" and template_renders_tools(Tok())
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is not one of"):
        make_tool_parser("mistral")
