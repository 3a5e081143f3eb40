"""The Hybrid Engine benchmark: generation inside a training loop, HF ``generate`` vs the engine, in one run.

Every iteration generates ``new_tokens`` tokens for ``batch`` prompts, then takes one training step (LM loss on the
prompts, AdamW). Two training setups, each on one random-weight model of ``preset`` that both contenders share
(their iterations alternate, so a busy machine slows both alike):

* ``full`` (full fine-tune, every weight trained): ``hf`` = ``model.generate`` in eval mode (HF's loop over the
  training model's modules) vs ``hybrid`` = ``HybridEngine.eval()`` (refresh), ``generate``, ``train()``;
* ``lora`` (peft LoRA on every linear layer, non-zero B): ``peft`` = ``peft_model.generate`` (HF's loop over the
  unmerged LoRA layers) vs ``hybrid`` (LoRA fused into the packed inference copy at each refresh).

The setup DeepSpeed published for its Hybrid Engine is OPT-1.3B, batch 8, prompt 256, 128 new tokens, LoRA.

A real preset (``smollm2-real``: SmolLM2-135M-Instruct's trained weights) runs the **GRPO shape** instead: ``batch``
rollout rows made of ``batch // G`` chat prompts (the tokenizer's chat template) each repeated ``G`` times in a row
(TRL's ``num_generations``, default 8, and its ``repeat_interleave``), sampled with TRL's defaults (temperature 1,
top-k 0, top-p 1), ``new_tokens`` new tokens per row (``min_new_tokens`` too, so both contenders generate the same
count); the training step runs on the distinct prompts. A random-weight preset runs the same shape with
``num_generations`` > 1 (``batch // G`` random prompts of ``prompt_len`` tokens; the GPU goal's Qwen2.5-1.5B 8 x 8
batch is ``--preset qwen2-1.5b --batch-sizes 64 --num-generations 8``), else ``batch`` distinct prompts, greedy.
Hybrid rows add the engine's ``memory()``, the RSS growth that building it caused, and the last rollout's
``prompt_tokens`` and ``prefill_tokens_computed`` (repeated prompts are prefilled once).
The engine's copy runs as a training run's steady state does: its CPU decode step is compiled during the warm-up
(``cpu_compile=True``; a run's default ``"auto"`` compiles once eager steps have taken 30 s), and the warm-up waits
for it; ``HF_DSINFER_CPU_COMPILE=0`` keeps the step eager. Hybrid rows say which (``decode_step``).
Rows report per-iteration medians, and every iteration in ``runs`` (and the note): generate, refresh (hybrid: wall
``refresh_ms``, and ``refresh_cpu_ms``, its process CPU time), training and end-to-end milliseconds, the generate
calls' process CPU time (``generate_cpu_ms``: on a loaded machine it moves far less than wall time; with one thread
it is the work done), generated tokens per second, peak memory (CUDA), the load average before and after the setup,
and on hybrid rows ``speedup`` (the peer's generate time over the engine's, generate + refresh counted for the
engine), ``cpu_speedup`` (the same on CPU time), ``switch_pct`` (refresh over generate, percent) and
``e2e_speedup``. ``run_hybrid_bench`` returns the rows; ``hf-dsinfer bench
--hybrid`` prints and saves them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def _peak_mib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return None  # the process-wide RSS peak cannot be split between contenders on CPU


#: The GRPO shape's chat prompts (real presets) and completions per prompt (TRL's ``num_generations``).
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List three prime numbers and say why they are prime.",
)
COMPLETIONS = 8


def _loadavg() -> float | None:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except OSError:  # not Linux
        return None


def _rss_bytes() -> int | None:
    """Resident bytes of this process after returning malloc's free pages (Linux; None elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return None


def _check_grpo_batch(preset: str, batch: int, completions: int, max_prompts: int | None) -> None:
    prompts = batch // max(completions, 1)
    if completions < 1 or batch < completions or batch % completions or (max_prompts and prompts > max_prompts):
        most = f" x 1-{max_prompts} prompts" if max_prompts else " x a whole number of prompts"
        raise ValueError(
            f"bench --hybrid on {preset} runs the GRPO shape: --batch-sizes must be --num-generations ({completions}) "
            f"completions{most}, got {batch} rows"
        )


def _grpo_prompts(
    preset: str, batch: int, device: torch.device, completions: int = COMPLETIONS
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The GRPO shape's rows on a real preset: ``batch // completions`` chat prompts, each repeated ``completions``
    times in a row, left-padded; ``(input_ids [batch, P], attention_mask [batch, P], pad id)``."""
    from transformers import AutoTokenizer

    from .decode import REAL_PRESETS

    _check_grpo_batch(preset, batch, completions, len(CHAT_PROMPTS))
    tok = AutoTokenizer.from_pretrained(REAL_PRESETS[preset]())
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in CHAT_PROMPTS[: batch // completions]]  # fmt: skip
    enc = tok(chats, return_tensors="pt", padding=True, padding_side="left")
    ids = enc["input_ids"].repeat_interleave(completions, 0).to(device)  # [batch, P]
    mask = enc["attention_mask"].repeat_interleave(completions, 0).to(device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ids, mask, pad


def _random_grpo_prompts(
    preset: str, batch: int, prompt_len: int, vocab: int, completions: int, seed: int, device: torch.device
) -> torch.Tensor:
    """The GRPO shape on random weights: ``batch // completions`` random prompts of ``prompt_len`` tokens, each
    repeated ``completions`` times in a row; ``input_ids [batch, prompt_len]``."""
    _check_grpo_batch(preset, batch, completions, None)
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(3, vocab, (batch // completions, prompt_len), generator=g)  # [batch / G, P]
    return distinct.repeat_interleave(completions, 0).to(device)  # [batch, P]


def _training_model(preset: str, device: torch.device, dtype: torch.dtype, lora_rank: int, seed: int) -> nn.Module:
    """A random-weight model of ``preset`` (trained weights for a real preset); with ``lora_rank`` > 0, peft LoRA on
    every linear layer (non-zero B)."""
    from .decode import REAL_PRESETS, build_random_model, preset_config  # the shared shape presets

    if preset in REAL_PRESETS:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(REAL_PRESETS[preset](), dtype=dtype).to(device)
        with torch.no_grad():  # read every weight now: file-mapped pages would otherwise show up as the engine's RSS
            for p in model.parameters():
                p.sum()
    else:
        model = build_random_model(preset_config(preset), device, dtype, seed)
    if lora_rank <= 0:
        return model.requires_grad_(True)  # full fine-tune: every weight trains
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear"))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=gen)
    return peft_model


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


_NAMES = {"hf": "HF generate (training model)", "peft": "HF generate (peft, unmerged LoRA)",
          "hybrid": "hf_dsinfer HybridEngine"}  # fmt: skip


def _row(
    peer: str,
    mode: str,
    preset: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    times: dict[str, list[float]],
    device: torch.device,
    error: str | None = None,
    **extra: Any,
) -> dict:
    """One contender's row; ``error`` (``Type: message``) marks a contender that raised: no figures, ``failed``."""
    med = {k: round(statistics.median(v), 3) if v and error is None else None for k, v in times.items() if k != "load"}
    runs = [] if error is not None else [
        {k: v[i] if k == "load" else round(v[i], 3) for k, v in times.items() if len(v) > i}
        for i in range(len(times.get("generate_ms", [])))
    ]  # fmt: skip  every measured iteration
    gen_ms = med.get("generate_ms")
    return dict(
        peer=peer, mode=mode, name=_NAMES[peer], preset=preset, batch=batch, prompt_len=prompt_len,
        new_tokens=new_tokens, **med, tokens_per_s=round(batch * new_tokens * 1e3 / gen_ms, 2) if gen_ms else None,
        peak_mem_mib=_peak_mib(device), failed=error is not None, error=error,
        note=f"FAILED: {error}" if error else "", runs=runs, **extra,
    )  # fmt: skip


def _bench_mode(mode: str, preset: str, batch: int, prompt_len: int, new_tokens: int, dev: torch.device,
                dtype: str, iterations: int, lora_rank: int, seed: int,
                inference_dtype: str | None = None, completions: int | None = None) -> list[dict]:  # fmt: skip
    """Both contenders of one training setup, alternating on one shared model; a row each. ``completions``: rows per
    distinct prompt (None: 8 on a real preset, 1 otherwise)."""
    from ..hybrid.engine import HybridEngine
    from ..log import logger
    from ..policies import get_injection
    from .decode import REAL_PRESETS
    from .report import error_text

    load_before = _loadavg()
    model = _training_model(preset, dev, DTYPES[dtype], lora_rank if mode == "lora" else 0, seed)
    real = preset in REAL_PRESETS
    completions = completions or (COMPLETIONS if real else 1)
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)  # TRL's GRPO defaults
    if real:  # GRPO shape: chat prompts x completions, sampled; train on the distinct prompts
        ids, mask, pad = _grpo_prompts(preset, batch, dev, completions)
        prompt_len = ids.shape[1]
        train_ids = ids[::completions]
    elif completions > 1:  # the same shape on random weights: random prompts x completions
        ids = _random_grpo_prompts(preset, batch, prompt_len, model.config.vocab_size, completions, seed, dev)
        mask, pad, train_ids = torch.ones_like(ids), 0, ids[::completions]
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).to(dev)
        mask, pad, train_ids, sampling = torch.ones_like(ids), 0, ids, dict(do_sample=False)
    gen_kw = dict(
        input_ids=ids, attention_mask=mask, pad_token_id=pad, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        **sampling,
    )  # fmt: skip
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    rss_before = _rss_bytes()
    peer = "peft" if mode == "lora" else "hf"
    errors: dict[str, str] = {}  # contender -> its error; a contender that raised is not called again
    try:
        he = HybridEngine(
            model, inference_config=dict(
                dtype=inference_dtype or dtype, max_out_tokens=prompt_len + new_tokens, max_batch_size=batch,
                enable_cuda_graph=dev.type == "cuda", cpu_compile=True,
            ),
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the engine failing is the bench's finding, the HF peer still runs
        logger.debug("bench --hybrid: HybridEngine failed to start", exc_info=True)
        errors["hybrid"] = error_text(e)
    rss_engine = _rss_bytes() if "hybrid" not in errors else None
    keys = ("generate_ms", "generate_cpu_ms", "train_ms", "e2e_ms", "load")
    times = {peer: {k: [] for k in keys}, "hybrid": {k: [] for k in (*keys, "refresh_ms", "refresh_cpu_ms")}}

    def run_peer(record: bool) -> None:
        load = _loadavg()
        t0, c0 = _now(dev), time.process_time()
        model.eval()
        with torch.no_grad():
            model.generate(**gen_kw)
        t1, c1 = _now(dev), time.process_time()
        _train_step(model, optimizer, train_ids)
        t2 = _now(dev)
        if record:
            for key, value in (("generate_ms", t1 - t0), ("generate_cpu_ms", c1 - c0), ("train_ms", t2 - t1),
                               ("e2e_ms", t2 - t0)):  # fmt: skip
                times[peer][key].append(value * 1e3)
            times[peer]["load"].append(load)

    def run_hybrid(record: bool) -> None:
        load = _loadavg()
        t0 = _now(dev)
        he.eval()
        c0 = time.process_time()
        he.generate(**gen_kw)
        c1 = time.process_time()
        he.train()
        t1 = _now(dev)
        _train_step(model, optimizer, train_ids)
        t2 = _now(dev)
        it = he.stats.last
        if record:
            times["hybrid"]["generate_ms"].append(it.generate_ms)
            times["hybrid"]["generate_cpu_ms"].append((c1 - c0) * 1e3)
            times["hybrid"]["refresh_ms"].append(it.refresh_ms)
            times["hybrid"]["refresh_cpu_ms"].append(it.refresh_cpu_ms)  # process CPU time
            times["hybrid"]["train_ms"].append((t2 - t1) * 1e3)
            times["hybrid"]["e2e_ms"].append((t2 - t0) * 1e3)
            times["hybrid"]["load"].append(load)
            prefill.update(prompt_tokens=it.prompt_tokens, prefill_tokens_computed=it.prefill_tokens_computed)
        elif i_warm[0]:  # the warm-up: let a background compile of the decode step finish (the steady state)
            i_warm[0] = False
            _wait_for_compile(he)

    def attempt(name: str, run: Any, record: bool) -> None:
        if name in errors:
            return
        try:
            run(record)
        except Exception as e:  # noqa: BLE001 - reported in its row, the other contender still runs
            logger.debug("bench --hybrid: %s failed", name, exc_info=True)
            errors[name] = error_text(e)

    i_warm = [True]
    prefill: dict[str, int] = {}  # the last timed rollout's prompt tokens and those prefilled
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(iterations + 1):  # iteration 0 warms both up (allocations, compiled steps, graphs)
        order = ((peer, run_peer), ("hybrid", run_hybrid))
        for name, run in order if i % 2 == 0 else order[::-1]:
            attempt(name, run, i > 0)
    loads = dict(load_before=load_before, load_after=_loadavg())
    peer_row = _row(peer, mode, preset, batch, prompt_len, new_tokens, times[peer], dev, errors.get(peer),
                    num_generations=completions, **loads)  # fmt: skip
    if "hybrid" in errors:
        return [
            peer_row,
            _row("hybrid", mode, preset, batch, prompt_len, new_tokens, times["hybrid"], dev, errors["hybrid"],
                 **loads),  # fmt: skip
        ]
    logp = _logp_diff(he, gen_kw)
    mem = {k: round(v / 2**20, 1) for k, v in he.memory().items()}  # MiB
    copy_mib = mem["weights"]
    built_mib = round((rss_engine - rss_before) / 2**20, 1) if rss_engine and rss_before else None
    hybrid_row = _row(
        "hybrid", mode, preset, batch, prompt_len, new_tokens, times["hybrid"], dev,
        injected=get_injection(he.module) is not None, inference_copy_mib=copy_mib, memory_mib=mem,
        rss_engine_built_mib=built_mib, decode_step=_decode_step(he, ids), inference_dtype=inference_dtype or dtype,
        logp_diff=logp, num_generations=completions, **prefill, **loads,
    )  # fmt: skip
    hybrid_row["switch_pct"] = (
        round(100 * hybrid_row["refresh_ms"] / hybrid_row["generate_ms"], 2) if hybrid_row["generate_ms"] else None
    )
    if peer not in errors:  # a ratio needs both contenders
        engine_ms = hybrid_row["generate_ms"] + (hybrid_row["refresh_ms"] or 0.0)
        hybrid_row["speedup"] = round(peer_row["generate_ms"] / engine_ms, 3)
        hybrid_row["cpu_speedup"] = round(peer_row["generate_cpu_ms"] / hybrid_row["generate_cpu_ms"], 3)
        hybrid_row["e2e_speedup"] = round(peer_row["e2e_ms"] / hybrid_row["e2e_ms"], 3)
    hybrid_row["note"] = (
        f"cpu_speedup {hybrid_row.get('cpu_speedup')}, switch {hybrid_row['switch_pct']}% of generate; memory MiB: "
        f"copy {mem['weights']}, KV {mem['kv_cache']}, packed {mem['cpu_packed']}, shared "
        f"{mem['shared_with_training']}, RSS at build {built_mib}; copy dtype {hybrid_row['inference_dtype']}, "
        f"logp_diff {logp if logp is None else f'{logp:.3g}'}; load {loads['load_before']}-{loads['load_after']}; "
        f"{hybrid_row['decode_step']} decode step; runs: {_runs_text(peer_row)} | {_runs_text(hybrid_row)}"
    )
    if peer not in errors:
        peer_row["note"] = f"runs: {_runs_text(peer_row)}"
    return [peer_row, hybrid_row]


#: Rows the untimed ``logp_diff`` check scores (two teacher-forced forwards each, outside every timed call).
LOGP_ROWS = 4


def _logp_diff(he: Any, gen_kw: dict) -> float | None:
    """After the timed iterations, one more (untimed) engine rollout with the engine's own ``logp_diff`` probe on its
    first :data:`LOGP_ROWS` rows (:mod:`..hybrid.probe`: mean |engine - training| log-prob of the sampled tokens; fp32
    noise for a copy in the training dtype, the rounding of another ``--inference-dtype``). None where it cannot run."""
    rows, he.logp_probe_rows = he.logp_probe_rows, LOGP_ROWS
    try:
        with he.inference():
            he.generate(**gen_kw)
        diff = he.stats.last.logp_diff
    except Exception:  # noqa: BLE001 - the timed figures stand; the row says the check did not run
        from ..log import logger

        logger.warning("bench --hybrid: the logp_diff check failed; its row reports none", exc_info=True)
        return None
    finally:
        he.logp_probe_rows = rows
    return None if diff is None else round(diff, 6)


def _runs_text(row: dict) -> str:
    """Every measured iteration of ``row``: generate wall / CPU seconds (refresh ms), at the load it started."""
    parts = []
    for r in row.get("runs", []):
        refresh = f", refresh {r['refresh_ms']:.0f} ms" if r.get("refresh_ms") is not None else ""
        if r.get("refresh_cpu_ms") is not None:
            refresh += f" ({r['refresh_cpu_ms']:.0f} ms CPU)"
        parts.append(f"{r['generate_ms'] / 1e3:.2f}/{r['generate_cpu_ms'] / 1e3:.2f} s{refresh} @{r['load']}")
    return f"{row['peer']} gen wall/CPU " + "; ".join(parts)


def _decode_state(he: Any) -> Any:
    from ..generation.api import GEN_ATTR

    state = getattr(he.module, GEN_ATTR, None)
    return getattr(getattr(state, "step", None), "compiled", None)


def _wait_for_compile(he: Any, timeout_s: float = 1800.0) -> None:
    """Wait (bounded) for a background compile of the engine's CPU decode step started by the warm-up."""
    compiled = _decode_state(he)
    if compiled is not None and not compiled.wait(timeout_s):
        from ..log import logger

        logger.warning("bench --hybrid: the CPU decode step still compiles after %.0f s; timing goes on", timeout_s)


def _decode_step(he: Any, ids: torch.Tensor) -> str:
    """``compiled`` when the engine's decode steps ran the compiled CPU step at this batch, else ``eager``."""
    compiled = _decode_state(he)
    if compiled is None or not compiled.compile_s or not compiled.applies(ids):
        return "eager"
    return "compiled"


def run_hybrid_bench(
    preset: str = "tiny",
    batch: int = 8,
    prompt_len: int = 256,
    new_tokens: int = 128,
    device: str | torch.device | None = None,
    dtype: str = "fp16",
    iterations: int = 3,
    lora_rank: int = 16,
    seed: int = 0,
    modes: tuple[str, ...] = ("full", "lora"),
    inference_dtype: str | None = None,
    num_generations: int | None = None,
) -> list[dict]:
    """Run each training setup of ``modes`` (``full``, ``lora``) for ``iterations`` measured iterations per contender
    (after one warm-up); two rows per setup: the HF peer (``hf`` or ``peft``), then ``hybrid``.

    Row keys: ``peer``, ``mode``, ``name``, ``preset``, ``batch``, ``prompt_len``, ``new_tokens``, ``generate_ms``,
    ``refresh_ms`` (hybrid), ``train_ms``, ``e2e_ms`` (medians), ``tokens_per_s`` (generated tokens over generate
    time), ``peak_mem_mib`` (CUDA only), ``failed``, ``error``, ``note``; hybrid rows add ``injected``,
    ``inference_copy_mib``, ``speedup`` (peer generate / engine generate + refresh) and ``e2e_speedup`` (when both
    ran), ``inference_dtype`` (the engine's copy: ``inference_dtype``, default ``dtype``), ``logp_diff`` (see
    :func:`_logp_diff`), ``prompt_tokens`` and ``prefill_tokens_computed``; every row has ``num_generations`` (rows
    per distinct prompt: the GRPO shape when > 1 or on a real preset, see the module doc). A contender that raises
    gets ``failed=True``, its error and no figures; the other one still runs.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows: list[dict] = []
    for mode in modes:
        if mode not in ("full", "lora"):
            raise ValueError(f"unknown hybrid bench mode {mode!r}; use 'full' and/or 'lora'")
        try:
            rows += _bench_mode(mode, preset, batch, prompt_len, new_tokens, dev, dtype, iterations, lora_rank, seed,
                                inference_dtype, num_generations)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the setup failed (model, peft): both rows failed, the other setup runs
            from .report import error_text

            peer = "peft" if mode == "lora" else "hf"
            error = f"setup: {error_text(e)}"
            no_times = {"generate_ms": [], "train_ms": [], "e2e_ms": []}  # the row's keys, no figures
            rows += [
                _row(p, mode, preset, batch, prompt_len, new_tokens, no_times, dev, error) for p in (peer, "hybrid")
            ]
    return rows
