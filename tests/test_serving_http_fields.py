"""``hf-dsinfer serve``'s request fields end to end: SmolLM2-135M-Instruct behind the server on 127.0.0.1, driven by
the ``openai`` client, each honoured field checked against an oracle (HF eager's logits and greedy tokens, seeded
sampling alone vs among others, JSON schemas, tool-call schemas), refused and unknown fields answered 400 by name,
and a non-streaming client that disconnects freeing its engine request and KV blocks."""

import asyncio
import json
import logging
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install openai")

import torch  # noqa: E402

from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path  # noqa: E402
from hf_dsinfer.serving import ServingEngine  # noqa: E402
from hf_dsinfer.serving.serve_cli import load_for_serving  # noqa: E402
from hf_dsinfer.serving.server import OpenAIServer  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: {SMOLLM2_INSTALL}"),
    pytest.mark.usefixtures("one_thread"),
]

MODEL = "smollm2"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served():
    """(client, tokenizer, HF eager model, engine, base URL)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model, tok = load_for_serving(smollm2_path(), {"dtype": "fp32", "max_out_tokens": 256})
    eager = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()
    engine = ServingEngine(model, block_size=16, max_batch_tokens=128, max_num_seqs=8)
    server = OpenAIServer(engine, tok, MODEL)
    base = server.start("127.0.0.1", 0)
    client = openai.OpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0)
    try:
        yield client, tok, eager, engine, base
    finally:
        server.stop()


def _chat_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _eager_logprobs(eager, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of HF eager's fp32 logits at each generated position: ``[len(generated), V]``."""
    ids = torch.tensor([prompt + generated])
    logits = eager(ids).logits[0, len(prompt) - 1 : len(prompt) + len(generated) - 1].float()
    return torch.log_softmax(logits, dim=-1)


def test_greedy_logprobs_equal_hf_eager(served):
    client, tok, eager, _, _ = served
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"return_token_ids": True})  # fmt: skip
    choice = r.choices[0]
    tokens = choice.model_extra["token_ids"]
    ref = _eager_logprobs(eager, _chat_ids(tok, ASK), tokens)
    assert tokens == ref.argmax(-1).tolist()  # greedy: HF eager's argmax at every position
    content = choice.logprobs.content
    assert len(content) == len(tokens) and "".join(e.token for e in content) == choice.message.content
    for j, entry in enumerate(content):
        assert abs(entry.logprob - ref[j, tokens[j]].item()) < 1e-4
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        top = ref[j].topk(3)
        assert [e.token for e in entry.top_logprobs] == [tok.decode([t]) for t in top.indices.tolist()]
        assert max(abs(e.logprob - v) for e, v in zip(entry.top_logprobs, top.values.tolist())) < 1e-4
    # streamed: each chunk carries its tokens' log-probs; together they are the same
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, stream=True,
                                                 logprobs=True, top_logprobs=3))  # fmt: skip
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_completion_echo_scores_the_prompt_as_hf_eager(served):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0."""
    client, tok, eager, _, _ = served
    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    ids = tok(prompt)["input_ids"]
    assert r.choices[0].text == prompt and lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and r.usage.completion_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(eager(torch.tensor([ids])).logits[0].float(), -1)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < 1e-4
    assert lp.text_offset == [len(tok.decode(ids[:j])) for j in range(len(ids))]


def test_seeded_sampling_is_the_same_alone_and_among_others(served):
    client, _, _, _, base = served
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, temperature=1.0,
              seed=1234, n=2)  # fmt: skip
    alone = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert alone[0] != alone[1]  # choice i uses seed + i

    async def crowd():
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0) as c:
            others = [c.completions.create(model=MODEL, prompt=f"Number {i}:", max_tokens=8, temperature=1.0)
                      for i in range(3)]  # fmt: skip
            return await asyncio.gather(c.chat.completions.create(**kw), *others)

    among = asyncio.run(crowd())[0]
    assert [c.message.content for c in among.choices] == alone


def test_stop_controls(served):
    client, tok, _, _, _ = served
    base = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True}).choices[0]  # fmt: skip
    ids = base.model_extra["token_ids"]
    assert base.finish_reason == "stop" and ids[-1] == tok.eos_token_id  # the answer ends by itself
    # ignore_eos: exactly max_tokens tokens
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=len(ids) + 3, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == len(ids) + 3 and r.choices[0].finish_reason == "length"
    # min_tokens: EOS cannot end it earlier
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=len(ids) + 4, temperature=0,
                                       extra_body={"min_tokens": len(ids) + 2})  # fmt: skip
    assert r.usage.completion_tokens >= len(ids) + 2
    # stop_token_ids: the request ends at that token, whose text is left out
    at = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    stop_id = ids[at]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=16, temperature=0,
                                       extra_body={"stop_token_ids": [stop_id], "return_token_ids": True})  # fmt: skip
    c = r.choices[0]
    assert c.model_extra["token_ids"] == ids[: at + 1] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop_id and c.message.content == tok.decode(ids[:at])
    # logit_bias +100 forces a token
    forced = tok(" blue", add_special_tokens=False)["input_ids"][0]
    bias = {str(forced): 100}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0, logit_bias=bias,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == [forced] * 3


def test_structured_json_and_a_required_tool_call(served):
    client, _, _, _, _ = served
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris as JSON."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}},
    )  # fmt: skip
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "sunny"} and isinstance(value["city"], str) and isinstance(value["sunny"], bool)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       max_tokens=40, temperature=0, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False)  # fmt: skip (one call: the greedy model repeats it)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, repr(c.message.content)
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # streamed: the call arrives as tool_call deltas that add up to the same call
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40, temperature=0,
        tools=tools, tool_choice="required", parallel_tool_calls=False, stream=True))  # fmt: skip
    deltas = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # the call goes back as an assistant message, its result as a tool message
    follow = [{"role": "user", "content": "Weather in Paris?"}, c.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=4, temperature=0, tools=tools)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")



def test_a_named_tool_choice_calls_that_tool(served):
    """tool_choice naming a function: the answer is one call of that function (constrained to its schema), even when
    another tool fits the question better; naming a tool that is not in ``tools`` is a 400 naming tool_choice."""
    client, _, _, _, _ = served
    def tool(name: str, arg: str) -> dict:
        schema = {"type": "object", "properties": {arg: {"type": "string", "maxLength": 20}}, "required": [arg],
                  "additionalProperties": False}  # fmt: skip
        return {"type": "function", "function": {"name": name, "parameters": schema}}

    tools = [tool("get_weather", "city"), tool("get_time", "timezone")]
    chosen = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       max_tokens=40, temperature=0, tools=tools, tool_choice=chosen)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, repr(c.message.content)
    call = c.message.tool_calls[0]
    assert call.function.name == "get_time" and set(json.loads(call.function.arguments)) == {"timezone"}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})

def test_refused_and_unknown_fields_get_400_and_the_server_keeps_serving(served, caplog):
    client, _, _, _, _ = served
    cases = {"use_beam_search": True, "best_of": 3, "suffix": "x", "chat_template": "{{ x }}", "typo_field": 1,
             "audio": {"voice": "alloy"}, "priority": 5}  # fmt: skip
    for name, value in cases.items():
        route = client.completions if name in ("best_of", "suffix") else client.chat.completions
        kw = {"prompt": "Hi"} if route is client.completions else {"messages": ASK}
        with pytest.raises(openai.BadRequestError) as e:
            route.create(model=MODEL, max_tokens=2, extra_body={name: value}, **kw)
        assert e.value.body["param"] == name and name in e.value.body["message"]
    caplog.set_level(logging.INFO, logger="transformers.hf_dsinfer")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, n=2)
    assert r.usage.completion_tokens == 4 and len(r.choices) == 2
    lines = [rec.getMessage() for rec in caplog.records if "hf_dsinfer request cmpl-" in rec.getMessage()]
    assert any("completion_tokens=4" in line and "latency=" in line for line in lines), lines


def test_streamed_multibyte_text_equals_the_full_decode(served):
    client, tok, _, _, _ = served
    prompt = "French: Le café est très chaud. Émoji: 😀😃😄. Japanese: 日本語. French:"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert len(ids) == 12 and text == tok.decode(ids, skip_special_tokens=True)
    assert any(ord(ch) > 127 for ch in text), text  # the model wrote multi-byte characters


def test_a_non_streaming_client_that_disconnects_frees_its_request(served):
    client, _, _, engine, base = served
    host, port = base.split("//")[1].split("/")[0].split(":")
    free = engine.runner.blocks.num_available
    body = json.dumps({"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    engine.reset_stats()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    deadline = time.monotonic() + 120
    while engine.stats.generated_tokens < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats.generated_tokens >= 2, "the request never started"
    sock.close()
    deadline = time.monotonic() + 60
    while (engine.scheduler.running or engine.has_work) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.scheduler.running and not engine.has_work
    assert engine.runner.blocks.num_available == free  # its KV blocks are back
    assert engine.stats.generated_tokens < 100  # it stopped long before its 200 tokens
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
