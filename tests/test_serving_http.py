"""``hf-dsinfer serve``'s HTTP layer end to end: SmolLM2-135M-Instruct behind the OpenAI-compatible server on
127.0.0.1, driven by the ``openai`` client. Every answer is checked against ``generate`` of that request alone."""

import argparse
import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")
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
CONTEXT = 256  # max_out_tokens: the longest request (prompt + new tokens)
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Say hello in Spanish.",
    "Why is the sky blue?",
    "Name a famous painter.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
]
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three laws of motion are",
    "My favourite food is",
    "In 1492, Columbus",
    "Paris is a city",
    "The best way to learn a language is",
]


@pytest.fixture(scope="module")
def served():
    """(base URL, tokenizer, references): references are fused ``generate`` runs, one request at a time, computed
    before the server starts (so nothing else shares the model meanwhile)."""
    model, tok = load_for_serving(smollm2_path(), {"dtype": "fp32", "max_out_tokens": CONTEXT})

    def alone(ids: list[int], new: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=tok.eos_token_id)  # fmt: skip
        return out[0, len(ids) :].tolist()

    refs = {}
    for i, text in enumerate(CHATS):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        refs["chat", i] = alone(tok(chat, add_special_tokens=False)["input_ids"], 8 + i)
    for i, text in enumerate(PROMPTS):
        refs["completion", i] = alone(tok(text)["input_ids"], 8 + i)
    engine = ServingEngine(model, block_size=16, max_batch_tokens=128, max_num_seqs=16)
    server = OpenAIServer(engine, tok, MODEL)
    base = server.start("127.0.0.1", 0)
    try:
        yield base, tok, refs, engine
    finally:
        server.stop()
    assert not engine.is_running


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def _finish(tok, ids: list[int], new: int) -> str:
    return "stop" if ids and ids[-1] == tok.eos_token_id else "length"


async def _chat(client, i: int, stream: bool):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": CHATS[i]}], max_tokens=8 + i, temperature=0)
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    parts, finish, roles = [], None, []
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        roles += [delta.role] if delta.role else []
        parts += [delta.content] if delta.content else []
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    return "".join(parts), finish, None


async def _completion(client, i: int, stream: bool):
    kwargs = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=8 + i, temperature=0)
    if not stream:
        r = await client.completions.create(**kwargs)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    parts, finish = [], None
    async for chunk in await client.completions.create(stream=True, **kwargs):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish, None


def test_sixteen_concurrent_requests_equal_generate_alone(served):
    base, tok, refs, engine = served
    engine.reset_stats()

    async def main():
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0) as client:
            jobs = [_chat(client, i, stream=i % 2 == 1) for i in range(len(CHATS))]
            jobs += [_completion(client, i, stream=i % 2 == 1) for i in range(len(PROMPTS))]
            return await asyncio.gather(*jobs)

    answers = asyncio.run(main())
    keys = [("chat", i) for i in range(len(CHATS))] + [("completion", i) for i in range(len(PROMPTS))]
    assert len(answers) == 16
    for key, (text, finish, used) in zip(keys, answers):
        ref = refs[key]
        assert text == _text(tok, ref), key
        assert finish == _finish(tok, ref, 8 + key[1]), key
        assert used in (None, len(ref)), key
    stats = engine.stats
    assert stats.requests_finished == 16 and stats.generated_tokens == sum(len(r) for r in refs.values())
    assert stats.steps < stats.generated_tokens  # requests shared steps (continuous batching)


def test_models_n_and_stop(served):
    base, tok, refs, _ = served
    client = openai.OpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    ref = _text(tok, refs["completion", 1])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=9, temperature=0, n=2)
    assert [c.text for c in r.choices] == [ref, ref] and [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(tok(PROMPTS[1])["input_ids"])  # once per prompt, not once per choice
    stop = ref.strip().split()[2]  # a word inside the reference answer: the text ends just before it
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=9, temperature=0, stop=[stop])
    assert r.choices[0].text == ref[: ref.find(stop)] and r.choices[0].finish_reason == "stop"


def _post(base: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served):
    base, tok, refs, _ = served
    client = openai.OpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0)
    msgs = [{"role": "user", "content": CHATS[0]}]
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist: this server serves 'smollm2'"):
        client.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {CONTEXT} tokens"):
        client.completions.create(model=MODEL, prompt="word " * 300, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="lower 'max_tokens'"):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="'temperature' must be in"):
        client.chat.completions.create(model=MODEL, messages=msgs, temperature=5)
    with pytest.raises(openai.BadRequestError, match="'use_beam_search' is not supported"):
        client.chat.completions.create(model=MODEL, messages=msgs, extra_body={"use_beam_search": True})
    status, body = _post(base, "/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(base, "/completions", json.dumps({"model": MODEL, "prompt": []}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = _post(base, "/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "3"}).encode())
    assert status == 400 and "'max_tokens' must be int" in body["error"]["message"]
    status, body = _post(base, "/completions", json.dumps(["not", "an", "object"]).encode())
    assert status == 400 and "JSON object" in body["error"]["message"]
    # Still serving, with the same answers.
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == _text(tok, refs["chat", 0])


def test_client_disconnect_cancels_its_engine_request(served):
    """A stream closed after two chunks frees the engine: its request stops long before its answer would end."""
    base, _, _, engine = served
    engine.reset_stats()
    client = openai.OpenAI(base_url=base, api_key="unused", timeout=300, max_retries=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    deadline = time.monotonic() + 120
    while engine.has_work and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.has_work
    # Left alone, this request runs 164 tokens (greedy, then EOS; measured with generate): it stopped far earlier.
    assert engine.stats.generated_tokens < 64


def test_serve_command_line():
    from hf_dsinfer import cli
    from hf_dsinfer.serving.serve_cli import serve_main

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    args = argparse.Namespace(inference_config='{"dtype": ', model="unused")
    with pytest.raises(SystemExit, match="--inference-config is not valid JSON"):
        serve_main(args)
