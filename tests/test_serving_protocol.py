"""The request side of ``hf-dsinfer serve`` without a model: the field table (every OpenAI and vLLM field honoured,
accepted or refused by name), validation, the engine settings built from a request, chat prompts, incremental
detokenization and stop strings. The HTTP end to end is tests/test_serving_http*.py."""

import json
import typing
from pathlib import Path

import pytest

from hf_dsinfer.serving.engine_requests import (
    chat_prompt,
    completion_prompts,
    fit_context,
    model_sampling_defaults,
    sampling_params,
)
from hf_dsinfer.serving.http_common import RequestError
from hf_dsinfer.serving.protocol import (
    ACCEPTED,
    FIELDS,
    HONOURED,
    REFUSED,
    fields_markdown,
    parse_request,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def _base(chat: bool) -> dict:
    return dict(CHAT if chat else COMPLETION)


def _refused(body: dict, chat: bool, name: str, match: str = "") -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_request(body, chat)
    assert e.value.status == 400 and e.value.param == name, e.value.message
    assert name in e.value.message and match in e.value.message
    return e.value


def test_the_table_covers_every_field_of_the_openai_client():
    """Each parameter the openai client can send to either route has an entry (so none falls to 'unknown')."""
    chat_params = pytest.importorskip("openai.types.chat.completion_create_params")
    completion_params = pytest.importorskip("openai.types.completion_create_params")
    for module, endpoint in ((chat_params, "chat"), (completion_params, "completions")):
        names = set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}
        table = {f.name for f in FIELDS if endpoint in f.endpoints}
        assert names <= table, sorted(names - table)
    seen = [(f.name, e) for f in FIELDS for e in f.endpoints]
    assert len(seen) == len(set(seen)), "one entry per field and route"
    assert {f.status for f in FIELDS} == {HONOURED, ACCEPTED, REFUSED}
    for f in FIELDS:
        assert f.doc.strip() and f.kinds, f.name
        if f.status == REFUSED:
            assert f.default is None or f.default in f.neutral or f.name == "include_reasoning", f.name


def test_docs_list_every_field():
    """docs/serving.md holds the table generated from FIELDS, as is (regenerate it with fields_markdown())."""
    text = DOCS.read_text()
    assert fields_markdown() in text, "docs/serving.md's field table is stale: paste protocol.fields_markdown()"


@pytest.mark.parametrize("chat", [True, False])
def test_unknown_and_misplaced_fields_are_refused_by_name(chat):
    err = _refused({**_base(chat), "temprature": 0.5}, chat, "temprature", "Unrecognized request argument")
    assert "temperature" in err.message  # the message lists what the route takes
    misplaced = "prompt" if chat else "messages"
    _refused({**_base(chat), misplaced: "x"}, chat, misplaced, "it belongs to")


@pytest.mark.parametrize("chat", [True, False])
def test_refused_fields_name_what_to_do_and_neutral_values_pass(chat):
    for f in FIELDS:
        if f.status != REFUSED or ("chat" if chat else "completions") not in f.endpoints:
            continue
        value = {"string": "x", "integer": 3, "number": 0.5, "boolean": True, "array": ["x"], "object": {"x": 1}}
        bad = value[f.kinds[0]]
        if bad in f.neutral:
            bad = False if f.kinds[0] == "boolean" else 7
        err = _refused({**_base(chat), f.name: bad}, chat, f.name, "not supported by this server")
        assert f.doc in err.message
        for neutral in f.neutral:
            parse_request({**_base(chat), f.name: neutral}, chat)
        parse_request({**_base(chat), f.name: None}, chat)  # null is "not set"


def test_accepted_fields_have_no_effect_and_pass():
    body = {**CHAT, "user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
            "prompt_cache_key": "k", "safety_identifier": "s", "prediction": {"type": "content", "content": "x"},
            "session_id": "s"}  # fmt: skip
    req = parse_request(body, chat=True)
    assert req.user == "u1" and req.store is True
    parse_request({**COMPLETION, "user": "u1"}, chat=False)


def test_kinds_ranges_and_rules_between_fields():
    _refused({**CHAT, "temperature": "0.5"}, True, "temperature", "must be number")
    _refused({**CHAT, "n": True}, True, "n", "must be integer")
    _refused({**CHAT, "temperature": 2.5}, True, "temperature", "must be in [0, 2]")
    _refused({**CHAT, "top_p": 0}, True, "top_p", "(0, 1]")
    _refused({**CHAT, "top_logprobs": 21}, True, "top_logprobs", "[0, 20]")
    _refused({**COMPLETION, "logprobs": 21}, False, "logprobs", "[0, 20]")
    _refused({**CHAT, "logit_bias": {"12": 300}}, True, "logit_bias", "[-100, 100]")
    _refused({**CHAT, "logit_bias": {"a": 1}}, True, "logit_bias", "token ids")
    _refused({**CHAT, "stop": ["ok", ""]}, True, "stop", "non-empty")
    _refused({**CHAT, "top_logprobs": 3}, True, "top_logprobs", "needs 'logprobs'")
    _refused({**CHAT, "stream_options": {"include_usage": True}}, True, "stream_options", "'stream': true")
    _refused({**CHAT, "stream": True, "stream_options": {"x": 1}}, True, "stream_options", "include_usage")
    _refused({**CHAT, "max_tokens": 0}, True, "max_tokens", "0 only with 'echo'")
    parse_request({**COMPLETION, "max_tokens": 0, "echo": True}, chat=False)
    _refused({**COMPLETION, "stream": True, "prompt_logprobs": 1}, False, "prompt_logprobs", "stream")
    _refused({**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, True, "guided_regex",
             "one output constraint")  # fmt: skip
    parse_request({**CHAT, "response_format": {"type": "text"}, "guided_regex": "a+"}, chat=True)
    req = parse_request({**CHAT, "continue_final_message": True}, chat=True)
    assert req.add_generation_prompt is False  # vLLM: continuing the last message adds no generation prompt
    _refused({**CHAT, "continue_final_message": True, "add_generation_prompt": True}, True, "add_generation_prompt")


def test_tools_and_tool_choice_rules():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parse_request({**CHAT, "tools": tools}, chat=True)
    parse_request({**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                  chat=True)  # fmt: skip
    _refused({**CHAT, "tools": []}, True, "tools", "must not be empty")
    _refused({**CHAT, "tools": [{"type": "web_search"}]}, True, "tools", "function tools only")
    _refused({**CHAT, "tool_choice": "required"}, True, "tool_choice", "needs 'tools'")
    _refused({**CHAT, "tools": tools, "tool_choice": "always"}, True, "tool_choice")
    _refused({**CHAT, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True,
             "tool_choice", "not in 'tools'")  # fmt: skip
    _refused({**CHAT, "tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}, True,
             "tool_choice", "cannot be combined")  # fmt: skip




def _params(body: dict, chat: bool = True, index: int = 0, max_tokens: int = 8, defaults: dict | None = None):
    req = parse_request({**_base(chat), **body}, chat)
    return sampling_params(req, index=index, max_tokens=max_tokens, eos_token_ids=frozenset({2}), vocab=100,
                           defaults=defaults or {})  # fmt: skip


def test_sampling_params_follow_openai_and_vllm_defaults():
    p = _params({})
    assert p.do_sample and p.temperature == 1.0 and p.top_p is None and p.top_k is None  # OpenAI: T=1, top_p=1
    assert not _params({"temperature": 0, "top_p": 0.5, "top_k": 5}).do_sample  # 0: greedy, the rest unused
    p = _params({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.9, 5, 0.1, 1.2)
    assert _params({"top_k": -1}).top_k is None
    p = _params({"top_p": 0.8}, defaults={"temperature": 0.6, "top_p": 0.95})  # generation_config.json's defaults
    assert (p.temperature, p.top_p) == (0.6, 0.8)
    p = _params({"seed": 7, "n": 3}, index=2)
    assert p.seed == 9  # choice i of n: seed + i, as vLLM
    p = _params({"logit_bias": {"5": 100, "7": -100}, "stop_token_ids": [3], "ignore_eos": True, "min_tokens": 4,
                 "presence_penalty": 0.5, "frequency_penalty": -0.5})  # fmt: skip
    assert dict(p.logit_bias) == {5: 100.0, 7: -100.0} and p.stop_token_ids == {3} and p.ignore_eos
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty, p.eos_token_ids) == (4, 0.5, -0.5, {2})
    assert _params({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert _params({"logprobs": True}).logprobs == 0 and _params({}).logprobs is None
    p = _params({"logprobs": 3, "echo": True, "max_tokens": 0}, chat=False, max_tokens=0)
    assert p.logprobs == 3 and p.prompt_logprobs == 3 and p.max_new_tokens == 1  # echo scores the prompt
    with pytest.raises(RequestError, match="outside the vocabulary"):
        _params({"logit_bias": {"500": 1}})
    with pytest.raises(RequestError, match="'stop_token_ids' must be in"):
        _params({"stop_token_ids": [100]})
    with pytest.raises(RequestError, match="'min_tokens' .* must not exceed"):
        _params({"min_tokens": 9})


def test_model_sampling_defaults_read_only_what_the_file_sets():
    from transformers import GenerationConfig

    assert model_sampling_defaults(GenerationConfig(eos_token_id=2)) == {}
    got = model_sampling_defaults(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9))
    assert got == {"temperature": 0.6, "top_p": 0.9}


@pytest.fixture(scope="module")
def tok():
    from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path

    if not smollm2_available():
        pytest.skip(f"SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path())


def test_chat_prompts_render_tool_messages_and_refuse_non_text(tok):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]  # fmt: skip
    req = parse_request({"model": "m", "messages": messages}, chat=True)
    prompts = chat_prompt(req, tok)
    # SmolLM2's template drops tool_calls: the call is written as text in the json tool parser's format instead
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": call_text}, {"role": "tool", "tool_call_id": "c1", "content": "22 C"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert prompts.texts == [expected] and prompts.ids == [tok(expected, add_special_tokens=False)["input_ids"]]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = chat_prompt(parse_request({"model": "m", "messages": messages, "tools": tools}, chat=True), tok)
    assert with_tools.texts[0].startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")
    assert '"name": "get_weather"' in with_tools.texts[0].split("<|im_end|>")[0]  # declared, not dropped
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(RequestError, match="content\\[0\\] is of type \"image_url\""):
        chat_prompt(parse_request({"model": "m", "messages": [image]}, chat=True), tok)
    with pytest.raises(RequestError, match="fields this server does not take"):
        chat_prompt(parse_request({**CHAT, "messages": [{"role": "user", "content": "x", "audio": 1}]}, True), tok)
    with pytest.raises(RequestError, match="must not set"):
        chat_prompt(parse_request({**CHAT, "chat_template_kwargs": {"tokenize": True}}, True), tok)
    cont = parse_request({"model": "m", "echo": True, "continue_final_message": True, "messages": [
        {"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]}, chat=True)  # fmt: skip
    prompts = chat_prompt(cont, tok)
    assert prompts.texts[0].endswith("1, 2,") and prompts.echo_prefix == "1, 2,"


def test_completion_prompts_and_context(tok):
    req = parse_request({"model": "m", "prompt": ["Hello", [1, 2, 3]], "max_tokens": 4}, chat=False)
    prompts = completion_prompts(req, tok)
    assert prompts.ids == [tok("Hello")["input_ids"], [1, 2, 3]]
    assert fit_context(req, prompts, 16, 16) == 4
    long = parse_request({"model": "m", "prompt": list(range(3, 40)), "max_tokens": 4}, chat=False)
    with pytest.raises(RequestError, match="maximum context length is 16 tokens") as e:
        fit_context(long, completion_prompts(long, tok), 16, 16)
    assert e.value.code == "context_length_exceeded"
    cut = parse_request({"model": "m", "prompt": list(range(3, 40)), "max_tokens": 4, "truncate_prompt_tokens": 5},
                        chat=False)  # fmt: skip
    prompts = completion_prompts(cut, tok)
    assert fit_context(cut, prompts, 16, 16) == 4 and prompts.ids == [list(range(35, 40))]
    with pytest.raises(RequestError, match="token ids must be in"):
        completion_prompts(parse_request({"model": "m", "prompt": [1, 10**6]}, chat=False), tok)


class _Handle:
    """A stand-in for the engine's RequestHandle, fed by the test."""

    def __init__(self):
        self.tokens, self.logprobs, self.done, self.finish_reason, self.stop_reason, self.error = [], None, False, None, None, None  # noqa: E501
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


def _run(tok, text: str, **kw):
    from hf_dsinfer.serving.responses import ChoiceState

    ids = tok(text)["input_ids"]
    c = ChoiceState(0, 0, tok, **kw)
    c.handle = h = _Handle()
    streamed = []
    for i, t in enumerate(ids):
        h.tokens.append(t)
        if i == len(ids) - 1:
            h.done, h.finish_reason = True, "length"
        c.advance()
        piece = c.pending()
        if piece is not None:
            streamed.append(piece.text)
        if c.done:
            break
    return c, "".join(streamed), ids


def test_incremental_text_equals_the_full_decode_with_multibyte_characters(tok):
    from hf_dsinfer.serving.detokenizer import IncrementalDetokenizer, token_bytes

    text = "Héllo wörld — 日本語 🙂 naïve café. <|im_end|> ok"
    c, streamed, ids = _run(tok, text)
    assert c.text == streamed == tok.decode(ids, skip_special_tokens=True)
    slow = IncrementalDetokenizer(tok)
    slow._stream = None  # the prefix-offset window used for slow tokenizers
    assert "".join(slow.step(t) for t in ids) == tok.decode(ids, skip_special_tokens=True)
    assert bytes(b for t in ids for b in token_bytes(tok, t)).decode() == text
    for cut in range(1, len(ids)):  # an output that ends inside a character: as tokenizer.decode shows it
        for fast in (True, False):
            d = IncrementalDetokenizer(tok)
            if not fast:
                d._stream = None
            got = "".join(d.step(t) for t in ids[:cut]) + d.flush()
            assert got == tok.decode(ids[:cut], skip_special_tokens=True), (cut, fast)


def test_stop_strings_cut_the_text_and_the_engine_request(tok):
    text = "one two three four five"
    c, streamed, ids = _run(tok, text, stops=("three", "zzz"))
    assert c.text == streamed == "one two " and c.finish_reason == "stop" and c.stop_reason == "three"
    assert c.handle.cancelled and c.consumed < len(ids)
    c, streamed, _ = _run(tok, text, stops=("three",), include_stop=True)
    assert c.text == streamed == "one two three"
    c, streamed, _ = _run(tok, text, stops=("ee fo",))  # across token boundaries
    assert c.text == streamed == "one two thr"
    c, streamed, ids = _run(tok, text + "<|im_end|>", stop_token_ids=frozenset({2}), skip_special_tokens=False)
    assert c.text == streamed == text  # the token that ends the request adds no text (vLLM)


def test_json_body_shapes_of_the_table():
    """fields_markdown renders each entry as one table row."""
    rows = fields_markdown().splitlines()[2:]
    assert len(rows) == len(FIELDS)
    assert all(row.count(" | ") >= 5 for row in rows)
    assert json.loads(json.dumps([f.default for f in FIELDS]))  # defaults are JSON


def test_stream_interval_batches_tokens_per_chunk(tok):
    from hf_dsinfer.serving.responses import ChoiceState

    ids = tok("one two three four five six seven eight")["input_ids"]
    c = ChoiceState(0, 0, tok)
    c.handle = h = _Handle()
    pieces = []
    for i, t in enumerate(ids):
        h.tokens.append(t)
        h.done, h.finish_reason = i == len(ids) - 1, "length" if i == len(ids) - 1 else None
        c.advance()
        if (piece := c.pending(interval=3)) is not None:
            pieces.append(piece)
    assert [p.end - p.start for p in pieces[:-1]] == [3] * (len(pieces) - 1) and pieces[-1].end == len(ids)
    assert "".join(p.text for p in pieces) == tok.decode(ids) and c.finish_reason == "length"
