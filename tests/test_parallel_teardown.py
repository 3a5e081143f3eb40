"""A tensor-parallel model does not keep a destroyed process group alive (2 gloo processes on CPU).

A gloo process group that survives ``destroy_process_group()`` lives on into interpreter shutdown, where its worker
thread can release the last collective's tensors after Python started finalizing: the thread cannot take the GIL,
exits, and the process aborts ("terminate called without an active exception"; seen in CI under load from
``examples/tp_generate.py``). The model therefore holds its group weakly, so destroying the group joins gloo's threads
at once, while the model is still referenced. Using the model afterwards raises an error that names the cause.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import launch  # noqa: E402
from tiny_models import PAD, left_pad, prompts, save_tiny  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_parallel")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def worker(job_path: str) -> None:
    """One rank: count threads around init / destroy of the process group while a TP model is alive."""
    import json

    import torch
    import torch.distributed as dist
    import transformers

    import hf_dsinfer  # noqa: F401
    from hf_dsinfer.parallel import init_distributed

    with open(job_path) as f:
        job = json.load(f)
    out: dict = {"before_init": _threads()}
    init_distributed()
    out["after_init"] = _threads()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], inference_config={"dtype": "fp32", "tensor_parallel": {"tp_size": 2}}
    )
    ids, mask = left_pad(prompts())
    out["tokens"] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, pad_token_id=PAD)
    dist.barrier()
    out["before_destroy"] = _threads()
    dist.destroy_process_group()  # the model is still referenced here
    out["after_destroy"] = _threads()
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        out["error"] = "no error"
    except RuntimeError as e:
        out["error"] = str(e)
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{os.environ['RANK']}.pt"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_destroying_the_group_joins_its_threads_while_the_model_lives(tmp_path):
    path = save_tiny("llama", tmp_path / "llama")
    results = launch({"model": path}, str(tmp_path), script=__file__)
    for rank, got in enumerate(results):
        gloo_threads = got["after_init"] - got["before_init"]
        assert gloo_threads > 0, f"rank {rank}: init_process_group started no thread? {got}"
        # every thread the group started is gone, though `model` (holding the group's TPGroup) is alive
        assert got["after_destroy"] <= got["before_destroy"] - gloo_threads, f"rank {rank}: {got}"
        assert "destroy_process_group" in got["error"], got["error"]
    assert results[0]["tokens"].tolist() == results[1]["tokens"].tolist()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2])
