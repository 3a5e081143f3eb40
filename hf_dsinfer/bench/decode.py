"""``hf-dsinfer bench``: HF eager, HF static cache + torch.compile and hf_dsinfer generate, side by side.

Models come from shape presets with random weights built directly on the device (parameters on the meta device,
then materialized with a seeded random init; no download), one fresh model per contender so that no contender sees
another's changes. Each contender runs ``generate`` once to warm up, then ``repeats`` times (default 3) once for one
token (time to first token) and once for ``new_tokens`` tokens; the difference is the decode time. EOS is disabled so
every run generates exactly ``new_tokens`` tokens. Rows report the median and the spread (min / max decode tokens/s
over the repeats); a spread above ``NOISY_SPREAD`` is flagged, because the comparison is then mostly noise.

Achieved GB/s is what one decode step must read (the weights, less the input embedding table of which it gathers a
few rows, plus the KV cache at the mean context length) over the step time, and is compared with the device's copy
bandwidth measured in the same run (a large memcpy on CPU too).
"""

from __future__ import annotations

import functools
import platform
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..log import logger
from .report import error_text

_COMMON = dict(bos_token_id=1, eos_token_id=None, pad_token_id=0)
# name -> (model_type, config overrides)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024)),
    # no kernel-injection policy: hf_dsinfer runs it on the generic path (HF's modules, static-cache attention)
    "smollm3-tiny": ("smollm3", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024)),
    # SmolLM2-135M-Instruct's shape (hf_dsinfer.real_model has its trained weights): decode speed does not depend on
    # the weight values, so its random-weight twin times what the real model would
    "smollm2": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                              rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "small": ("llama", dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)),
    # mixture of experts (mixtral: 8 experts, top-2); random weights
    "moe-tiny": ("mixtral", dict(hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2048, max_position_embeddings=1024,
                                 num_local_experts=8, num_experts_per_tok=2)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                     max_position_embeddings=32768, rope_theta=1000000.0, num_local_experts=8,
                                     num_experts_per_tok=2)),
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                max_position_embeddings=4096)),
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, rope_theta=500000.0)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=32768, sliding_window=4096)),
    "qwen2-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)),
    "opt-1.3b": ("opt", dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24, num_attention_heads=32,
                             vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048)),
}  # fmt: skip
PEERS = ("eager", "compile", "dsinfer")
PEER_TITLES = {"eager": "HF eager", "compile": "HF static+compile", "dsinfer": "hf_dsinfer"}
# ``--quant int8,int4``: weight-only quantized hf_dsinfer contenders, run after the others in the same process
QUANT_PEERS = {"int8": {"num_bits": 8}, "int4": {"num_bits": 4},
               # GPTQ needs the model's tokenizer for its calibration text: a real preset (smollm2-real)
               "int4-gptq": {"num_bits": 4, "q_type": "asymmetric", "calibration": "gptq"}}  # fmt: skip
PEER_TITLES.update({f"dsinfer-{q}": f"hf_dsinfer {q}" for q in QUANT_PEERS})
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_REPEATS = 3


@dataclass
class BenchArgs:
    """One benchmark run's settings (the CLI's options)."""

    preset: str = "tiny"
    batch_sizes: tuple[int, ...] = (1, 4)
    prompt_len: int = 32
    new_tokens: int = 32
    dtype: str = "fp32"
    peers: tuple[str, ...] = PEERS
    repeats: int = DEFAULT_REPEATS
    device: str | None = None
    seed: int = 0


# -- models ---------------------------------------------------------------------------------------------------------


def _smollm2_real() -> str:
    from ..real_model import smollm2_path

    return smollm2_path()


#: Presets with trained weights: name -> a function giving the HF folder (converted once, cached).
REAL_PRESETS: dict[str, Callable[[], str]] = {"smollm2-real": _smollm2_real}


def preset_config(name: str):
    """The transformers config of preset ``name`` (EOS disabled so runs have a fixed length)."""
    from transformers import AutoConfig

    if name in REAL_PRESETS:
        return AutoConfig.from_pretrained(REAL_PRESETS[name]())  # runs still have a fixed length: min_new_tokens
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join([*PRESETS, *REAL_PRESETS])}")
    model_type, overrides = PRESETS[name]
    return AutoConfig.for_model(model_type, **{**_COMMON, **overrides})


@torch.no_grad()
def build_random_model(config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A causal LM of ``config`` with random weights, built on the meta device and materialized on ``device``.

    Matrices get N(0, 0.02), 1-D ``weight`` tensors (norms) ones and biases zeros; tied parameters stay tied.
    Buffers (rotary frequencies) are computed for real at construction, so they are exact.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                t = torch.empty(p.shape, dtype=dtype, device=device)
                if name == "bias":
                    t.zero_()
                elif p.dim() == 1:
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=gen)
                done[id(p)] = nn.Parameter(t, requires_grad=False)
            module._parameters[name] = done[id(p)]
    model.tie_weights()  # from_config on meta does not tie (transformers ties at load time)
    model.to(device)  # the buffers
    return model.eval()


def decode_bytes(model: nn.Module, config, batch: int, context: float, dtype: torch.dtype) -> float:
    """Bytes one decode step reads: weights (less the gathered input embedding) plus the KV cache at ``context``."""
    from ..modules.quant_linear import QuantLinear

    quantized = [b for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers()]  # int weights, scales
    seen, total = set(), 0
    for p in list(model.parameters()) + quantized:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or head.weight is not emb.weight):
        total -= emb.weight.numel() * emb.weight.element_size()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * elem * batch * context
    return float(total + kv)


# -- measuring ------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, nbytes: int | None = None) -> float:
    """Copy bandwidth of ``device`` in GB/s (bytes read + written), best of several large tensor copies."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5 if device.type == "cuda" else 3):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def _peak_mem_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process peak


def preset_model(preset: str, config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model of ``preset``: trained weights for :data:`REAL_PRESETS` (loaded from their folder, tokenizer next
    to them, for GPTQ's calibration), else :func:`build_random_model` of ``config``."""
    if preset in REAL_PRESETS:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(REAL_PRESETS[preset](), dtype=dtype).to(device).eval()
    return build_random_model(config, device, dtype, seed)


def _prepare(peer: str, model: nn.Module, args: BenchArgs, device: torch.device) -> tuple[nn.Module, dict]:
    """The model to call ``generate`` on and the extra generate kwargs of contender ``peer``."""
    if peer == "eager":
        return model, {}
    if peer == "compile":
        from transformers import CompileConfig

        mode = "reduce-overhead" if device.type == "cuda" else "default"
        from ..hf_compat import compile_config_all_devices

        cc = compile_config_all_devices(CompileConfig(mode=mode, fullgraph=False))  # else CUDA only
        return model, dict(cache_implementation="static", compile_config=cc)
    from ..integration.engine import init_inference

    quant = QUANT_PEERS[peer.removeprefix("dsinfer-")] if peer.startswith("dsinfer-") else None
    engine = init_inference(
        model,
        quant={"enabled": True, "weight": quant} if quant else None,
        dtype=args.dtype,
        replace_with_kernel_inject=True,
        enable_cuda_graph=device.type == "cuda",
        max_out_tokens=args.prompt_len + args.new_tokens,
        max_batch_size=max(args.batch_sizes),
        keep_module_on_host=device.type != "cuda",
    )
    return engine.module, {}


def run_peer(peer: str, args: BenchArgs, device: torch.device, copy_gbs: float, progress=None) -> list[dict]:
    """Benchmark contender ``peer`` at every batch size; one row per batch size."""
    config = preset_config(args.preset)
    dtype = DTYPES[args.dtype]
    rows = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model = preset_model(args.preset, config, device, dtype, args.seed)
        model, extra = _prepare(peer, model, args, device)
    except Exception as e:  # noqa: BLE001 - a contender that cannot start is reported as failed, the others still run
        logger.debug("bench: %s failed to start", peer, exc_info=True)
        if progress is not None:
            progress.update(len(args.batch_sizes))
        return [_failed_row(peer, b, args, error_text(e)) for b in args.batch_sizes]
    for batch in args.batch_sizes:
        g = torch.Generator().manual_seed(args.seed + batch)
        ids = torch.randint(3, config.vocab_size, (batch, args.prompt_len), generator=g).to(device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, **extra)
        try:
            with torch.no_grad():
                # warm-up; its tokens are compared across contenders (``mark_token_agreement``)
                out = model.generate(**kw, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
                tokens = out[:, ids.shape[1] :].cpu()  # [batch, new_tokens]
                first, full = [], []
                for _ in range(args.repeats):
                    first.append(_timed(device, functools.partial(model.generate, **kw, max_new_tokens=1)))
                    full.append(
                        _timed(
                            device,
                            functools.partial(
                                model.generate, **kw, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
                            ),
                        )
                    )
        except Exception as e:  # noqa: BLE001 - reported as a failed row, the other batch sizes still run
            logger.debug("bench: %s failed at batch %d", peer, batch, exc_info=True)
            rows.append(_failed_row(peer, batch, args, error_text(e)))
        else:
            ttft, total = statistics.median(first), statistics.median(full)
            # one decode rate per repeat (full run minus the median first-token time): the median is reported, the
            # spread says how much it can be trusted
            rates = [batch * 1e3 * max(args.new_tokens - 1, 1) / max(b - ttft, 1e-3) for b in full]
            ms_tok = batch * 1e3 / statistics.median(rates)
            context = args.prompt_len + args.new_tokens / 2
            gbs = decode_bytes(model, config, batch, context, dtype) / (ms_tok / 1e3) / 1e9
            rows.append(dict(
                peer=peer, name=PEER_TITLES[peer], batch=batch, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, ttft_ms=round(ttft, 3), ms_per_token=round(ms_tok, 4),
                decode_tokens_per_s=round(batch * 1e3 / ms_tok, 2), total_ms=round(total, 3),
                peak_mem_mib=round(_peak_mem_mib(device), 1), gbs=round(gbs, 2),
                pct_copy_bw=round(100 * gbs / copy_gbs, 1), **spread_fields(rates), failed=False, error=None, note="",
                _tokens=tokens,
            ))  # fmt: skip
        if progress is not None:
            progress.update(1)
    del model
    return rows


def _failed_row(peer: str, batch: int, args: BenchArgs, error: str) -> dict:
    """The row of a contender that raised: no figures, ``failed`` set, the error in ``error`` and the note."""
    return dict(peer=peer, name=PEER_TITLES[peer], batch=batch, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, ttft_ms=None, ms_per_token=None, decode_tokens_per_s=None,
                total_ms=None, peak_mem_mib=None, gbs=None, pct_copy_bw=None, tokens_per_s_min=None,
                tokens_per_s_max=None, spread=None, failed=True, error=error, note=f"FAILED: {error}")  # fmt: skip


def spread_fields(rates: list[float]) -> dict[str, float]:
    """min / max of the per-repeat decode rates and their ratio (max / min, 1.0 = no noise)."""
    lo, hi = min(rates), max(rates)
    return dict(tokens_per_s_min=round(lo, 2), tokens_per_s_max=round(hi, 2), spread=round(hi / lo, 3))


def mark_token_agreement(rows: list[dict]) -> None:
    """Set ``tokens_match`` on every row: its greedy tokens equal HF eager's at the same batch size (None when there is
    no eager row to compare with); a mismatch is also written in the row's note. Drops the tokens themselves."""
    eager = {r["batch"]: r.get("_tokens") for r in rows if r["peer"] == "eager"}
    for r in rows:
        tokens, ref = r.pop("_tokens", None), eager.get(r["batch"])
        r["tokens_match"] = None if tokens is None or ref is None else bool(torch.equal(tokens, ref))
        if r["tokens_match"] is False:
            r["note"] = (r["note"] + "; " if r["note"] else "") + "greedy tokens differ from HF eager"


def run_bench(args: BenchArgs) -> dict:
    """Run every contender of ``args``; returns the JSON-ready report."""
    from tqdm.auto import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for peer in args.peers:
        if peer not in PEER_TITLES:
            raise ValueError(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    copy_gbs = copy_bandwidth_gbs(device)
    rows: list[dict] = []
    with tqdm(total=len(args.peers) * len(args.batch_sizes), desc=f"bench {args.preset}", unit="run") as bar:
        for peer in args.peers:
            bar.set_postfix(peer=peer)
            rows.extend(run_peer(peer, args, device, copy_gbs, bar))
    mark_token_agreement(rows)
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return dict(
        preset=args.preset, device=dev_name, dtype=args.dtype, copy_gbs=round(copy_gbs, 2),
        settings=dict(batch_sizes=list(args.batch_sizes), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      repeats=args.repeats, peers=list(args.peers)),
        versions={"torch": torch.__version__, "transformers": _transformers_version()},
        rows=rows,
    )  # fmt: skip


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# -- where a decode step's time goes ---------------------------------------------------------------------------------


@torch.no_grad()
def profile_decode(model: nn.Module, ids: torch.Tensor, new_tokens: int = 16, top: int = 12) -> dict:
    """Per-op profile of greedy decoding: ``generate`` of ``new_tokens`` tokens (EOS masked) under torch.profiler,
    after an unprofiled warm-up and an unprofiled timing (prefill = a one-token ``generate``, decode = the rest).

    Returns ``ms_per_step`` (unprofiled) and the ``top`` ops by self CPU time, each with calls and self ms per decode
    step (the whole run's figures over ``new_tokens``: the prompt's own ops are included once, so keep it short).
    """
    from torch.profiler import ProfilerActivity, profile

    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    full = functools.partial(model.generate, **kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    full()
    first = _timed(ids.device, functools.partial(model.generate, **kw, max_new_tokens=1))
    total = _timed(ids.device, full)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        full()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    all_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / new_tokens
    ops = [dict(op=e.key, calls=round(e.count / new_tokens, 1), self_ms=round(e.self_cpu_time_total / 1e3 / new_tokens,
                                                                              3)) for e in events[:top]]  # fmt: skip
    return dict(ms_per_step=round((total - first) / (new_tokens - 1), 2), profiled_ms_per_step=round(all_ms, 2),
                ops=ops)  # fmt: skip


def profile_main(ns) -> dict:
    """``bench --profile-step``: :func:`profile_decode` of SmolLM2 (``--preset smollm2-real``) in fp32, int8 and
    int4 (groups of 32, float zero), eager and compiled step, at ``--threads`` (default 1); writes
    ``profile-step.json`` / ``.md``."""
    import os as _os

    from ..integration.engine import init_inference
    from .llamacpp import FORMATS
    from .report import write_report

    if ns.preset not in REAL_PRESETS:
        raise SystemExit("--profile-step profiles the trained weights: add --preset smollm2-real")
    torch.set_num_threads(ns.threads or 1)
    config = preset_config(ns.preset)
    ids = torch.randint(3, config.vocab_size, (1, ns.prompt_len), generator=torch.Generator().manual_seed(0))
    out, lines = {}, []
    for fmt, (_, quant) in FORMATS.items():
        for compiled in (False, True):
            model = preset_model(ns.preset, config, torch.device("cpu"), torch.float32)
            model = init_inference(model, quant=quant, dtype="fp32", replace_with_kernel_inject=True, max_batch_size=1,
                                   max_out_tokens=ns.prompt_len + ns.new_tokens, keep_module_on_host=True,
                                   cpu_compile=compiled).module  # fmt: skip
            name = f"{fmt} {'compiled' if compiled else 'eager'}"
            res = profile_decode(model, ids, ns.new_tokens)
            res["load"] = round(_os.getloadavg()[0], 2)
            out[name] = res
            lines += [f"**{name}**: {res['ms_per_step']} ms per decode step unprofiled, "
                      f"{res['profiled_ms_per_step']} ms profiled (load {res['load']})", "",
                      "| op | calls / step | self ms / step |", "|---|---:|---:|"]  # fmt: skip
            lines += [f"| `{o['op'][:80]}` | {o['calls']} | {o['self_ms']:.2f} |" for o in res["ops"]] + [""]
            del model
    report = dict(mode="profile-step", preset=ns.preset, threads=torch.get_num_threads(), prompt_len=ns.prompt_len,
                  new_tokens=ns.new_tokens, versions={"torch": torch.__version__}, profiles=out)  # fmt: skip
    write_report(report, "\n".join(lines) + "\n", ns.out, "profile-step")
    return report
