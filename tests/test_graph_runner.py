"""The graph runner's static-buffer logic (bucket choice, padding, eager above the largest bucket, buffer reuse).

On CPU the runner runs the step eagerly on the same static buffers it would capture, so these tests cover the logic
that CUDA graphs rely on; the capture itself is checked by the CUDA-only tests at the end.
"""

from __future__ import annotations

import pytest
import torch

from hf_dsinfer import InferenceConfig
from hf_dsinfer.generation.graph_runner import GraphRunner, StaticInput, batch_buckets, default_batch_buckets
from hf_dsinfer.log import LOGGER_NAME


class Recorder:
    """A step that doubles ``x`` and adds ``y``, remembering what it was called with."""

    def __init__(self):
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls.append({"x": x, "y": y, "x_copy": x.clone(), "y_copy": y.clone()})
        return x * 2 + y[:, :1]


def _runner(step, buckets=(1, 2, 4, 8), device="cpu", **kw) -> GraphRunner:
    specs = {"x": StaticInput((3,), torch.float32, pad_value=-1.0), "y": StaticInput((1,), torch.long, pad_value=7)}
    return GraphRunner(step, specs, buckets, device, **kw)


def test_default_buckets():
    assert default_batch_buckets(1) == [1]
    assert default_batch_buckets(8) == [1, 2, 4, 8]
    assert default_batch_buckets(12) == [1, 2, 4, 8, 12]
    assert default_batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_batch_buckets(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]
    with pytest.raises(ValueError):
        default_batch_buckets(0)


def test_buckets_from_config():
    cfg = InferenceConfig(max_batch_size=32)
    assert batch_buckets(cfg.cuda_graph_batch_sizes, cfg.max_batch_size) == [1, 2, 4, 8, 16, 24, 32]
    cfg = InferenceConfig(max_batch_size=16, cuda_graph_batch_sizes=[6, 1, 3])
    assert batch_buckets(cfg.cuda_graph_batch_sizes, cfg.max_batch_size) == [1, 3, 6]


def test_bucket_choice():
    r = _runner(Recorder(), buckets=(4, 1, 2, 8))
    assert r.buckets == [1, 2, 4, 8]
    assert [r.bucket_for(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert not r.use_graphs  # CPU: no capture
    r.capture()  # a no-op without graphs
    assert not r.captured


def test_padding_and_output_slicing():
    step = Recorder()
    r = _runner(step)
    x = torch.arange(9, dtype=torch.float32).view(3, 3)
    y = torch.tensor([[1], [2], [3]])
    out = r(x=x, y=y)
    assert out.shape == (3, 3)
    torch.testing.assert_close(out, x * 2 + y)
    seen = step.calls[-1]
    assert seen["x"].shape == (4, 3)  # padded to bucket 4
    torch.testing.assert_close(seen["x_copy"][:3], x)
    assert (seen["x_copy"][3] == -1).all() and seen["y_copy"][3].item() == 7  # pad values
    assert r.stats.replays == 1 and r.stats.eager_calls == 0


def test_static_buffers_are_reused_and_repadded():
    step = Recorder()
    r = _runner(step)
    r(x=torch.ones(4, 3), y=torch.ones(4, 1, dtype=torch.long))
    r(x=torch.zeros(3, 3), y=torch.zeros(3, 1, dtype=torch.long))  # same bucket, one row fewer
    r(x=torch.zeros(1, 3), y=torch.zeros(1, 1, dtype=torch.long))
    a, b, c = step.calls
    assert a["x"].data_ptr() == b["x"].data_ptr() == c["x"].data_ptr() == r.buffers["x"].data_ptr()
    assert a["y"].data_ptr() == b["y"].data_ptr() == r.buffers["y"].data_ptr()
    # the row left over from the first call was re-padded, not kept
    assert (b["x_copy"][3] == -1).all() and b["y_copy"][3].item() == 7
    assert c["x"].shape == (1, 3)


def test_eager_above_largest_bucket(caplog):
    step = Recorder()
    r = _runner(step, buckets=(1, 2))
    x, y = torch.randn(5, 3), torch.zeros(5, 1, dtype=torch.long)
    with caplog.at_level("INFO", logger=LOGGER_NAME):
        out = r(x=x, y=y)
        r(x=x, y=y)
    torch.testing.assert_close(out, x * 2)
    assert step.calls[-1]["x"] is x  # the caller's tensor, no static buffer
    assert r.stats.eager_calls == 2
    assert sum("above the largest" in m for m in caplog.messages) == 1  # one log line per size


def test_tuple_outputs_and_input_checks():
    r = _runner(lambda x, y: (x + 1, y * 2), buckets=(2,))
    a, b = r(x=torch.zeros(1, 3), y=torch.ones(1, 1, dtype=torch.long))
    assert a.shape == (1, 3) and b.tolist() == [[2]]
    with pytest.raises(TypeError, match="missing"):
        r(x=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="expected"):
        r(x=torch.zeros(1, 4), y=torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch"):
        r(x=torch.zeros(2, 3), y=torch.ones(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="CUDA"):
        _runner(Recorder(), use_graphs=True)


@pytest.mark.cuda
def test_cuda_capture_replays_like_eager():
    dev = torch.device("cuda")
    state = torch.zeros(8, 3, device=dev)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state[: x.shape[0]] += x  # mutates state in place, like a KV cache
        return state[: x.shape[0]] * 2 + y[:, :1]

    r = _runner(step, device=dev)
    r.capture()
    assert r.captured and r.stats.captured == (1, 2, 4, 8)
    state.zero_()  # warm-up and capture ran the step: reset its state, as documented
    x = torch.randn(3, 3, device=dev)
    y = torch.tensor([[1], [2], [3]], device=dev)
    torch.testing.assert_close(r(x=x, y=y), x * 2 + y)
    torch.testing.assert_close(r(x=x, y=y), x * 4 + y)  # the replay saw the updated state
    assert r(x=torch.ones(9, 3, device=dev), y=torch.zeros(9, 1, dtype=torch.long, device=dev)).shape == (9, 3)
    assert r.stats.eager_calls == 1


@pytest.mark.cuda
def test_cuda_capture_with_generator():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev)
    if not hasattr(torch.cuda.CUDAGraph(), "register_generator_state"):
        pytest.skip("this torch cannot register generators with graphs")

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, device=dev, generator=gen)

    r = _runner(step, device=dev, generators=[gen])
    r.capture()
    gen.manual_seed(0)
    x, y = torch.zeros(2, 3, device=dev), torch.zeros(2, 1, dtype=torch.long, device=dev)
    a, b = r(x=x, y=y).clone(), r(x=x, y=y).clone()
    assert not torch.equal(a, b)  # each replay draws new numbers
    gen.manual_seed(0)
    torch.testing.assert_close(r(x=x, y=y), a)  # and reseeding reproduces them


# -- encoder forward graphs (bucket padding and slicing run eagerly on CPU) ---------------------------------------


@pytest.fixture(scope="module")
def bert():
    import transformers
    from tiny_models import build_tiny

    return build_tiny("bert"), transformers


def test_forward_graphs_padding_matches_unpadded(bert):
    from hf_dsinfer.generation.forward_graphs import ForwardGraphs

    model, _ = bert
    fg = ForwardGraphs(model, model.forward, [1, 2, 4], use_graphs=False, seq_multiple=8)
    ids = torch.randint(3, 400, (3, 5))
    mask = torch.ones_like(ids)
    mask[2, 3:] = 0  # a right-padded row
    types = torch.zeros_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        got = fg(input_ids=ids, attention_mask=mask, token_type_ids=types)
        again = fg(input_ids=ids[:1], attention_mask=mask[:1], token_type_ids=types[:1])
    assert got.last_hidden_state.shape == (3, 5, 96) and got.pooler_output.shape == (3, 96)
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.last_hidden_state, want.last_hidden_state[:1], atol=1e-5, rtol=1e-5)
    keys = list(fg.entries)
    assert [k[:2] for k in keys] == [(4, 8), (1, 8)]  # (batch bucket, sequence bucket)
    ptr = fg.entries[keys[0]]["buffers"]["input_ids"].data_ptr()
    with torch.no_grad():
        fg(input_ids=ids[:2, :4])  # (2, 4) -> bucket (2, 8): a new entry
        # (3, 6) -> bucket (4, 8) again: the same static buffers
        fg(input_ids=ids[:, :2].repeat(1, 3)[:, :7])
    assert fg.entries[keys[0]]["buffers"]["input_ids"].data_ptr() == ptr  # static buffers reused


def test_forward_graphs_eager_cases(bert):
    from hf_dsinfer.generation.forward_graphs import ForwardGraphs

    model, _ = bert
    fg = ForwardGraphs(model, model.forward, [1, 2], use_graphs=False)
    ids = torch.randint(3, 400, (3, 5))
    with torch.no_grad():
        fg(input_ids=ids)  # batch above the largest bucket
        fg(input_ids=ids[:1], output_hidden_states=True)  # an argument the graphs do not take
    assert fg.eager_calls == 2 and not fg.entries


def test_encoder_with_enable_cuda_graph_loads_and_matches_on_cpu(bert, tmp_path):
    from tiny_models import save_tiny

    _, transformers = bert
    path = save_tiny("bert", tmp_path)
    ref = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    opt = transformers.AutoModel.from_pretrained(path, inference_config={"dtype": "fp32", "enable_cuda_graph": True})
    assert opt._dsinfer_forward_graphs is not None
    ids = torch.randint(3, 400, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(opt(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state)
