"""Tensor parallelism from pickled checkpoints (``.bin`` / ``.pt``) on 2 gloo ranks, against the tp=1 model.

Layouts (each converted here from one tiny llama's safetensors, so every one must give the same model):
HF ``pytorch_model-0000i-of-0000n.bin`` shards with ``pytorch_model.bin.index.json``; one ``pytorch_model.bin``; a
DeepSpeed checkpoint JSON listing ``.pt`` parts of the whole model (BLOOM-style); a Megatron-style JSON with one
``mp_rank_00_model_states.pt`` training checkpoint (``{"module": state_dict, ...}``); per-rank ``mp_rank_XX`` files
and DeepSpeed's TP-split ``tp_RR_MM.pt`` partitions written by the ranks themselves and loaded back. Each gives logits
within ``MODEL_LOGITS_TOL`` and the same greedy tokens as tp=1, with each rank holding only its slices. The memory
check: peak RSS growth per rank while loading an ~80 MB ``.bin`` checkpoint stays within (largest shard file + the
rank's slices) * 1.1. Unsafe pickles are refused by name (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import pytest
import torch

import hf_dsinfer  # noqa: F401  (registers the inference_config flag of from_pretrained)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_parallel import WORLD, _rss_kib, launch  # noqa: E402
from tiny_models import left_pad, prompts, save_tiny  # noqa: E402
from tolerances import MODEL_LOGITS_TOL  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_parallel_bin")

GREEDY_TOKENS = 6
TP2 = {"dtype": "fp32", "replace_with_kernel_inject": False, "tensor_parallel": {"tp_size": WORLD}}
# ~20M parameters = ~80 MB in fp32, saved in shards of at most ~20 MB (largest tensor: the 8000 x 384 embedding)
BIG = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
           vocab_size=8000, tie_word_embeddings=False)  # fmt: skip
BIG_SHARD_BYTES = 20 * 2**20


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoint layouts, written from a safetensors model directory
# ---------------------------------------------------------------------------------------------------------------------


def _state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def _copy_config(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)


def _groups(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """``sd`` cut in order into groups of at most ``max_bytes`` (a larger tensor alone), as save_pretrained shards."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][key] = t
        size += nbytes
    return groups


def write_hf_bin(src: str, dst: str, max_bytes: int | None) -> str:
    """HF's pickled layout: ``pytorch_model-0000i-of-0000n.bin`` + index (or one ``pytorch_model.bin``)."""
    _copy_config(src, dst)
    sd = _state_dict(src)
    if max_bytes is None:
        torch.save(sd, os.path.join(dst, "pytorch_model.bin"))
        return dst
    groups = _groups(sd, max_bytes)
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save(group, os.path.join(dst, name))
        weight_map.update(dict.fromkeys(group, name))
    with open(os.path.join(dst, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * 4 for t in sd.values())}, "weight_map": weight_map}, f)
    return dst


def write_ds_parts(src: str, dst: str) -> str:
    """DeepSpeed's checkpoint JSON listing ``.pt`` parts of the whole model (BLOOM-style, ``parallelization`` "pp")."""
    _copy_config(src, dst)
    sd = _state_dict(src)
    groups = _groups(sd, sum(t.numel() * 4 for t in sd.values()) // 2)
    names = [f"part_{i:02d}.pt" for i in range(len(groups))]
    for name, group in zip(names, groups):
        torch.save(group, os.path.join(dst, name))
    return _write_json(dst, "ds_checkpoint.json", {"type": "BLOOM", "checkpoints": names, "version": 1.0})


def write_megatron_single(src: str, dst: str) -> str:
    """One DeepSpeed training checkpoint (``mp_rank_00_model_states.pt``: the state dict under ``module``)."""
    _copy_config(src, dst)
    state = {"module": _state_dict(src), "ds_version": "0.16.5", "global_steps": 10, "mp_world_size": 1,
             "ds_config": {"train_batch_size": 8, "zero_optimization": {"stage": 0}}, "optimizer": None}  # fmt: skip
    torch.save(state, os.path.join(dst, "mp_rank_00_model_states.pt"))
    desc = {"type": "Megatron", "version": 0, "checkpoints": ["mp_rank_00_model_states.pt"]}
    return _write_json(dst, "megatron.json", desc)


def write_unsafe(src: str, dst: str) -> str:
    """A training checkpoint that also pickles an ``argparse.Namespace`` (Megatron's ``args``): not weights only."""
    _copy_config(src, dst)
    state = {"module": _state_dict(src), "args": argparse.Namespace(lr=1e-4, tensor_model_parallel_size=1)}
    torch.save(state, os.path.join(dst, "mp_rank_00_model_states.pt"))
    return _write_json(
        dst, "unsafe.json", {"type": "Megatron", "version": 0, "checkpoints": ["mp_rank_00_model_states.pt"]}
    )


def save_marian(directory: str) -> str:
    """A tiny Marian (its checkpoint leaves out the sinusoidal position tables: the model's init computes them)."""
    import transformers

    config = transformers.MarianConfig(
        vocab_size=500, d_model=96, encoder_layers=1, decoder_layers=1, encoder_attention_heads=6,
        decoder_attention_heads=6, encoder_ffn_dim=136, decoder_ffn_dim=136, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config)
    with torch.no_grad():
        model.final_logits_bias.normal_()  # not zero, so a wrongly gathered bias shows
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def marian_logits(model) -> torch.Tensor:
    ids = torch.tensor([[5, 6, 7, 8, 9, 2], [0, 0, 11, 12, 13, 2]])
    return model(
        input_ids=ids, attention_mask=(ids != 0).long(), decoder_input_ids=torch.tensor([[0, 9, 10]] * 2)
    ).logits


def _write_json(directory: str, name: str, desc: dict) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump(desc, f)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# The worker (runs in each rank's process)
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, steps: int = GREEDY_TOKENS) -> torch.Tensor:
    """Greedy tokens by full forwards (no cache, no generate): the same computation on every model compared."""
    ids, mask = left_pad(prompts())
    out = []
    for _ in range(steps):
        nxt = model(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    return torch.cat(out, 1)


@torch.no_grad()
def checks(model) -> dict:
    ids, mask = left_pad(prompts())
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"logits": model(input_ids=ids, attention_mask=mask).logits, "greedy": greedy(model), "local": local}


def _run(out: dict, name: str, fn) -> None:
    try:
        out[name] = checks(fn())
    except Exception:  # noqa: BLE001 - reported by the test
        out[name] = {"error": traceback.format_exc()}


def _write_rank_files(model, directory: str, rank: int) -> None:
    """This rank's slices as DeepSpeed / Megatron would leave them: ``mp_rank_XX_model_states.pt`` (a training
    checkpoint) and two ``tp_RR_MM.pt`` partitions (DeepSpeed's save_mp_checkpoint_path layout)."""
    import torch.distributed as dist

    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save({"module": sd, "mp_world_size": WORLD}, os.path.join(directory, f"mp_rank_{rank:02d}_model_states.pt"))
    keys = list(sd)
    for m, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
        torch.save({k: sd[k] for k in part}, os.path.join(directory, f"tp_{rank:02d}_{m:02d}.pt"))
    if rank == 0:
        mp = [f"mp_rank_{r:02d}_model_states.pt" for r in range(WORLD)]
        _write_json(directory, "megatron.json", {"type": "Megatron", "version": 0, "checkpoints": mp})
        tp = [f"tp_{r:02d}_{m:02d}.pt" for m in range(2) for r in range(WORLD)]
        desc = {"type": "ds_model", "version": 1.0, "parallelization": "tp", "tp_size": WORLD,
                "checkpoints": {"tp": tp, "non_tp": []}}  # fmt: skip
        _write_json(directory, "ds_tp.json", desc)
    dist.barrier()


def _measure(path: str) -> dict:
    import gc

    import transformers

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, inference_config=TP2)
    peak = _rss_kib("VmHWM")
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"before_kib": before, "peak_kib": peak, "local_bytes": local}


def worker(job_path: str) -> None:
    import transformers

    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    out: dict = {}
    load = transformers.AutoModelForCausalLM.from_pretrained
    # first: warm up on the small model (imports, process group, first-call paths), then the measured big load
    _run(out, "hf_bin", lambda: load(job["hf_bin"], inference_config=TP2))
    if job.get("big") and os.path.exists("/proc/self/clear_refs"):
        out["memory"] = _measure(job["big"])
    _run(out, "hf_bin_single", lambda: load(job["hf_bin_single"], inference_config=TP2))
    try:  # an encoder-decoder from one pytorch_model.bin whose position tables are computed, not loaded
        marian = transformers.MarianMTModel.from_pretrained(job["marian_bin"], inference_config=TP2)
        out["marian"] = {"logits": marian_logits(marian), "local": sum(p.numel() for p in marian.parameters())}
    except Exception:  # noqa: BLE001 - reported by the test
        out["marian"] = {"error": traceback.format_exc()}
    for name in ("ds_parts", "megatron_single"):
        _run(out, name, lambda d=job[name]: load(job["config_dir"], inference_config={**TP2, "checkpoint": d}))
    # per-rank files written by the ranks from their own slices, then loaded back without re-slicing
    _write_rank_files(load(job["hf_bin"], inference_config=TP2), job["rank_dir"], rank)
    for name, desc in (("megatron_ranks", "megatron.json"), ("ds_tp_parts", "ds_tp.json")):
        path = os.path.join(job["rank_dir"], desc)
        _run(out, name, lambda d=path: load(job["config_dir"], inference_config={**TP2, "checkpoint": d}))
    torch.save(out, os.path.join(os.path.dirname(job_path), f"rank{rank}.pt"))


# ---------------------------------------------------------------------------------------------------------------------
# The tests (run in pytest's process)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("bin")
    src = save_tiny("llama", base / "st")
    big_src = save_tiny("llama", base / "big_st", **BIG)
    paths = {
        "src": src,
        "hf_bin": write_hf_bin(src, str(base / "hf_bin"), max_bytes=120_000),
        "hf_bin_single": write_hf_bin(src, str(base / "hf_bin_single"), max_bytes=None),
        "config_dir": str(base / "hf_bin"),
        "ds_parts": write_ds_parts(src, str(base / "ds_parts")),
        "megatron_single": write_megatron_single(src, str(base / "megatron_single")),
        "unsafe": write_unsafe(src, str(base / "unsafe")),
        "big": write_hf_bin(big_src, str(base / "big_bin"), max_bytes=BIG_SHARD_BYTES),
        "rank_dir": str(base / "ranks"),
        "marian_st": save_marian(str(base / "marian_st")),
    }
    paths["marian_bin"] = write_hf_bin(paths["marian_st"], str(base / "marian_bin"), max_bytes=None)
    os.makedirs(paths["rank_dir"])
    return paths


@pytest.fixture(scope="module")
def run(layouts, tmp_path_factory):
    return launch(layouts, str(tmp_path_factory.mktemp("bin_run")), script=__file__)


@pytest.fixture(scope="module")
def reference(layouts):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(layouts["src"], dtype=torch.float32).eval()
    return checks(model), sum(p.numel() * p.element_size() for p in model.parameters())


def test_layouts_are_what_they_say(layouts):
    names = sorted(os.listdir(layouts["hf_bin"]))
    assert "pytorch_model.bin.index.json" in names and sum(n.endswith(".bin") for n in names) >= 3
    assert not any(n.endswith(".safetensors") for n in names)
    assert "pytorch_model.bin" in os.listdir(layouts["hf_bin_single"])


@pytest.mark.parametrize(
    "name", ["hf_bin", "hf_bin_single", "ds_parts", "megatron_single", "megatron_ranks", "ds_tp_parts"]
)
def test_tp2_from_pickled_checkpoints_matches_tp1(run, reference, name):
    ref, total = reference
    for rank, res in enumerate(run):
        got = res[name]
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(got["logits"], ref["logits"], **MODEL_LOGITS_TOL[torch.float32])
        assert torch.equal(got["greedy"], ref["greedy"]), f"{name} rank {rank}: greedy tokens differ from tp=1"
        assert got["local"] < 0.75 * total, f"{name} rank {rank} holds {got['local']} of {total} bytes"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_peak_memory_within_one_shard_file_plus_the_rank_slices(run, layouts, capsys):
    files = [os.path.join(layouts["big"], n) for n in os.listdir(layouts["big"]) if n.endswith(".bin")]
    largest = max(os.path.getsize(f) for f in files)
    total = sum(os.path.getsize(f) for f in files)
    assert len(files) >= 4 and largest < 0.35 * total
    for rank, res in enumerate(run):
        m = res["memory"]
        grown = (m["peak_kib"] - m["before_kib"]) * 1024
        bound = (largest + m["local_bytes"]) * 1.1
        with capsys.disabled():
            print(f"\nrank {rank}: checkpoint {total / 2**20:.0f} MiB in {len(files)} files (largest "
                  f"{largest / 2**20:.0f}), slices {m['local_bytes'] / 2**20:.0f} MiB, peak RSS growth "
                  f"{grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")  # fmt: skip
        assert m["local_bytes"] < 0.6 * total
        assert grown <= bound, f"rank {rank}: peak RSS grew {grown / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"


def test_tp2_marian_from_bin_computes_its_position_tables_like_hf(run, layouts):
    """Parameters the checkpoint leaves out because the model's init computes them (Marian's sinusoidal position
    tables, ``_keys_to_ignore_on_load_missing``) are computed by transformers' init after the sliced load."""
    import transformers

    ref = transformers.MarianMTModel.from_pretrained(layouts["marian_st"], dtype=torch.float32).eval()
    want = marian_logits(ref)
    total = sum(p.numel() for p in ref.parameters())
    for rank, res in enumerate(run):
        got = res["marian"]
        assert "error" not in got, got.get("error")
        torch.testing.assert_close(got["logits"], want, **MODEL_LOGITS_TOL[torch.float32])
        assert got["local"] < 0.8 * total, f"rank {rank} holds {got['local']} of {total} parameters"


def test_tp1_description_computes_what_the_checkpoint_leaves_out(layouts):
    import transformers

    desc = _write_json(layouts["marian_st"], "ds.json", {"type": "ds_model", "checkpoints": ["model.safetensors"]})
    ref = transformers.MarianMTModel.from_pretrained(layouts["marian_st"], dtype=torch.float32).eval()
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": False, "checkpoint": desc}
    got = transformers.MarianMTModel.from_pretrained(layouts["marian_st"], inference_config=cfg)
    assert torch.equal(got.model.decoder.embed_positions.weight, ref.model.decoder.embed_positions.weight)
    torch.testing.assert_close(marian_logits(got), marian_logits(ref), **MODEL_LOGITS_TOL[torch.float32])


def test_unsafe_pickle_refused_with_the_fix(layouts):
    import transformers

    with pytest.raises(ValueError, match=r"holds Python objects besides tensors.*weights_only=True.*re-save"):
        transformers.AutoModelForCausalLM.from_pretrained(
            layouts["config_dir"], inference_config={"dtype": "fp32", "checkpoint": layouts["unsafe"]}
        )


def test_tp1_reads_a_pt_checkpoint_description(layouts, reference):
    """One process: the same description readers (the files of a BLOOM-style JSON and a Megatron training file)."""
    import transformers

    ref, _ = reference
    for name in ("ds_parts", "megatron_single"):
        cfg = {"dtype": "fp32", "replace_with_kernel_inject": False, "checkpoint": layouts[name]}
        got = checks(transformers.AutoModelForCausalLM.from_pretrained(layouts["config_dir"], inference_config=cfg))
        torch.testing.assert_close(got["logits"], ref["logits"], **MODEL_LOGITS_TOL[torch.float32])
        assert torch.equal(got["greedy"], ref["greedy"])


def test_split_checkpoint_for_another_tp_size_is_refused(layouts, tmp_path):
    from hf_dsinfer.parallel.groups import TPGroup
    from hf_dsinfer.parallel.loading import _checkpoint_layout, read_description

    desc = {"type": "Megatron", "version": 0, "checkpoints": ["mp_rank_00.pt", "mp_rank_01.pt"]}
    with pytest.raises(ValueError, match=r"split for 2 mp_rank files but this run has tp_size=1"):
        _checkpoint_layout(read_description(desc, str(tmp_path)), TPGroup(None, 1, 0))


def test_pickled_state_dict_with_quantized_pairs_is_refused(tmp_path):
    from hf_dsinfer.parallel.checkpoint_index import CheckpointIndex

    path = str(tmp_path / "q.pt")
    torch.save({"w": [torch.zeros(2, 2, dtype=torch.int8), torch.ones(2)]}, path)
    with pytest.raises(ValueError, match=r"not tensors .*quantized checkpoints"):
        CheckpointIndex([path])


def test_pickled_files_read_per_slice_including_the_pre_zip_format(tmp_path):
    """A slice read from a memory-mapped (zip) file and from a torch < 1.6 file (read whole) is a private copy."""
    from hf_dsinfer.parallel.checkpoint_index import CheckpointIndex
    from hf_dsinfer.parallel.shard import Shard

    w = torch.arange(24.0).view(6, 4)
    paths = [str(tmp_path / "zip.pt"), str(tmp_path / "legacy.pt")]
    torch.save({"module": {"w": w}, "global_steps": 3}, paths[0])
    torch.save({"w2": w}, paths[1], _use_new_zipfile_serialization=False)
    index = CheckpointIndex(paths)
    assert index.where == {"w": paths[0], "w2": paths[1]}
    rows = index.read("w", Shard(0, ((2, 4),), 6))
    cols = index.read("w2", Shard(1, ((0, 1), (3, 4)), 4))
    index.close()
    assert torch.equal(rows, w[2:4]) and torch.equal(cols, w[:, [0, 3]])
    assert rows.untyped_storage().nbytes() == rows.numel() * 4  # only the slice's bytes, not a view of the file


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    worker(sys.argv[2])
    sys.exit(0)
