"""HybridEngine over FSDP2-sharded training weights: 2 gloo processes on CPU, spawned by the test.

Each rank builds the same tiny llama + LoRA, computes the unsharded reference (``merge_and_unload`` of a copy),
then shards the training model with ``fully_shard`` (its parameters become DTensors) and generates through the
engine, which gathers each tensor with ``full_tensor()`` while refreshing. Tokens must equal the reference, and the
training shards must be untouched.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any group exists: a clean exit, see docs/tensor_parallel.md)
import torch.multiprocessing as mp
from tiny_models import PAD, build_tiny, left_pad, prompts

WORLD = 2
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lora_model() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = build_tiny("llama", seed=0)
    peft_model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", use_rslora=True)
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return peft_model


def _worker(rank: int, port: int, out_dir: str) -> None:
    result: dict = {"rank": rank}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        import hf_dsinfer

        torch.set_num_threads(1)  # tiny tensors: avoid thread-pool contention between the two ranks
        torch.manual_seed(0)
        peft_model = _lora_model()
        ids, mask = left_pad(prompts((5, 9, 3)))
        gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
        reference = copy.deepcopy(peft_model).merge_and_unload().eval().generate(**gen)

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in peft_model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(peft_model, mesh=mesh)
        sharded = [n for n, p in peft_model.named_parameters() if isinstance(p, DTensor)]
        before = {n: p.to_local().clone() for n, p in peft_model.named_parameters()}

        he = hf_dsinfer.HybridEngine(peft_model, inference_config={"max_out_tokens": 64})
        he.eval()
        out = he.generate(**gen)
        he.train()
        unchanged = all(torch.equal(before[n], p.to_local()) for n, p in peft_model.named_parameters())
        result.update(
            sharded=len(sharded),
            equal=bool(torch.equal(out, reference)),
            unchanged=unchanged,
            out=out.tolist(),
            ref=reference.tolist(),
        )
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # reported to the parent through the result file
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_fsdp2_engine_matches_unsharded_reference(tmp_path):
    ctx = mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        ctx.join(timeout=TIMEOUT_S)  # returns False while processes still run
        for p in ctx.processes:
            p.join(timeout=max(1, TIMEOUT_S // 3))
        alive = [p.pid for p in ctx.processes if p.is_alive()]
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    assert not alive, f"FSDP2 workers did not finish within {TIMEOUT_S}s"
    for rank in range(WORLD):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result"
        result = json.loads(path.read_text())
        if "error" in result:
            pytest.fail(f"rank {rank} failed:\n{result['error']}")
        assert result["sharded"] > 0, "fully_shard left no DTensor parameters: the test would prove nothing"
        assert result["equal"], f"rank {rank}: {result['out']} != {result['ref']}"
        assert result["unchanged"], f"rank {rank}: training shards changed"
