"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` on ``hf-dsinfer serve`` with the real SmolLM2-135M-Instruct.
The oracle is the tokenizer itself (and its chat template), and the chat route: a chat's token count from
``/tokenize`` equals the ``prompt_tokens`` that ``/v1/chat/completions`` reports for the same messages."""


import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install openai")

from http_json import post_json  # noqa: E402

from hf_dsinfer.real_model import SMOLLM2_INSTALL, smollm2_available, smollm2_path  # noqa: E402
from hf_dsinfer.serving.serve_cli import build_server  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not smollm2_available(), reason=f"SmolLM2 is not installed: {SMOLLM2_INSTALL}"),
    pytest.mark.usefixtures("one_thread"),
]

MODEL = "smollm2"
CONTEXT = 256
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
]




@pytest.fixture(scope="module")
def served():
    """(server root URL, /v1 URL, tokenizer, server): SmolLM2 served as ``hf-dsinfer serve`` builds it."""
    server = build_server(smollm2_path(), {"dtype": "fp32"}, served_model_name=MODEL, max_model_len=CONTEXT,
                          max_num_seqs=4)  # fmt: skip
    assert server.engine is not None, "SmolLM2 is detected as a generating model"
    base = server.start("127.0.0.1", 0)
    try:
        yield base.removesuffix("/v1"), base, server.tokenizer, server
    finally:
        server.stop()


def test_tokenize_a_prompt(served):
    root, _, tok, server = served
    text = "The quick brown fox jumps over the lazy dog. <|im_start|> 1234"
    status, answer = post_json(root + "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert status == 200, answer
    ids = tok(text)["input_ids"]
    assert answer == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                      "token_strs": tok.convert_ids_to_tokens(ids)}  # fmt: skip
    assert server.max_model_len == server.engine.runner.max_positions == CONTEXT
    status, plain = post_json(root + "/tokenize", {"prompt": text, "add_special_tokens": False})  # model is optional
    assert status == 200 and plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] is None


def test_tokenize_messages_as_the_chat_route_does(served):
    root, base, tok, _ = served
    status, answer = post_json(root + "/tokenize", {"model": MODEL, "messages": CHAT})
    assert status == 200, answer
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert answer["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    client = openai.OpenAI(base_url=base, api_key="unused")
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == answer["count"]

    # OpenAI's text parts are the same text.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    assert post_json(root + "/tokenize", {"messages": parts})[1]["tokens"] == answer["tokens"]
    # Without the generation prompt, and with the last message left open (vLLM's continue_final_message).
    bare = post_json(root + "/tokenize", {"messages": CHAT, "add_generation_prompt": False})[1]
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert bare["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and bare["count"] < answer["count"]
    prefill = CHAT + [{"role": "assistant", "content": "Madrid is"}]
    status, open_ended = post_json(root + "/tokenize", {"messages": prefill, "continue_final_message": True})
    assert status == 200, open_ended
    text = tok.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert open_ended["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(open_ended["tokens"]).endswith("Madrid is")
    # Tools: rendered as the chat route renders them (SmolLM2's template ignores tools: they are written as text).
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    status, with_tools = post_json(root + "/tokenize", {"messages": CHAT, "tools": tools})
    assert status == 200, with_tools
    assert with_tools["count"] > answer["count"] and "get_weather" in tok.decode(with_tools["tokens"])
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == with_tools["count"]
    # Template variables the template does not use change nothing (as on the chat route).
    assert post_json(root + "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"unused": 1}})[1] == answer


def test_detokenize(served):
    root, _, tok, _ = served
    text = "Hello, world! Ünïcödé and 漢字."
    ids = post_json(root + "/tokenize", {"prompt": text})[1]["tokens"]
    assert post_json(root + "/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": text})
    chat_ids = post_json(root + "/tokenize", {"messages": CHAT[:2]})[1]["tokens"]
    assert post_json(root + "/detokenize", {"tokens": chat_ids})[1]["prompt"] == tok.decode(chat_ids)  # specials kept
    assert post_json(root + "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": "x", "foo": 1}, 400, "foo"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),  # chat only
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ["x"]}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, 400,
         "add_generation_prompt"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"a": 1}}, 400, "mm_processor_kwargs"),
        ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),  # as the chat route
        ("/tokenize", {"messages": CHAT, "tools": []}, 400, "tools"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(served, route, body, status, param):
    root, _, _, _ = served
    got, answer = post_json(root + route, body)
    assert got == status, answer
    assert answer["error"]["param"] == param, answer
    assert post_json(root + "/tokenize", {"prompt": "still serving"})[0] == 200
