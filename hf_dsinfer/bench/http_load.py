"""Load on any OpenAI-compatible server over HTTP: fixed request sets, a concurrency sweep and a Poisson rate sweep.

Every request streams (``stream: true``) so that the arrival time of each chunk is seen: time to first token (TTFT:
request sent -> first chunk with text), inter-token latencies (ITL: the gaps between chunks with text), time per output
token (TPOT: ``(e2e - TTFT) / (output tokens - 1)``) and end-to-end latency (e2e). Output lengths are fixed by
``ignore_eos`` with ``max_tokens`` (vLLM's field); a server that refuses ``ignore_eos`` is asked with ``min_tokens``
instead, then with neither, and the report records which one held (``length_control``) and the lengths it got.
Output tokens are the server's own count (``stream_options.include_usage``) when it gives one, else one per chunk.

A run reports request throughput, output tokens/s, TTFT / TPOT / ITL / e2e mean, p50, p90 and p99, and goodput: the
completed requests per second that met every latency objective given (``--goodput ttft:MS tpot:MS e2el:MS``, vLLM's
benchmark's names), with the load average before and after. Every request and every run is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

try:  # httpx's API; the openai client brings httpx (older releases) or httpx2 (newer)
    import httpx
except ImportError:  # pragma: no cover - depends on what is installed
    import httpx2 as httpx  # type: ignore[no-redef]

#: What fixes the output length, in the order tried: the first a server accepts is used for the whole run.
LENGTH_CONTROLS = ("ignore_eos", "min_tokens", "none")
#: Latency objectives ``--goodput`` understands (vLLM's benchmark's names), in milliseconds.
SLO_METRICS = ("ttft", "tpot", "e2el")
#: Chat prompts of the ``chat`` request set: everyday questions, answered at a fixed length.
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a rainbow forms.",
    "Give me three tips for learning to cook.",
    "Why do cats purr?",
    "Describe a walk through a forest in autumn.",
    "What is the difference between weather and climate?",
    "Summarize the plot of a fairy tale you like.",
    "How does a bicycle stay upright?",
    "Suggest a name for a small bakery and say why.",
    "What should I pack for a weekend of hiking?",
    "Explain what a prime number is to a child.",
    "Write a short thank-you note to a neighbour.",
    "Why is the sky blue?",
    "List some uses of a paperclip.",
    "How do bees make honey?",
)


@dataclass
class RequestSpec:
    """One request of a set: a prompt (text for completions, messages for chat) and the new tokens asked for."""

    prompt: str | list[dict[str, str]]
    max_tokens: int
    prompt_tokens: int  # by the benchmark's tokenizer (chat: the user message alone, without the template)


@dataclass
class RequestResult:
    """What one request measured; times in seconds, ``start`` from the beginning of the run."""

    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    counted_by: str = "chunks"  # "usage": the server's count; "chunks": one token per chunk with text
    error: str | None = None


def word_tokens(tokenizer: Any) -> list[int]:
    """Ids of the vocabulary's whole words with a leading space (``" house"``) that encode back to themselves alone:
    joined, they make text of exactly as many tokens as words (a word-level pre-tokenizer splits at the spaces)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    words = [(i, t) for i, t in zip(ids, texts) if len(t) > 2 and t[0] == " " and t[1:].isalpha() and t[1:].isascii()]
    encoded = tokenizer([t for _, t in words], add_special_tokens=False)["input_ids"]
    return [i for (i, _), e in zip(words, encoded) if e == [i]]


def synthetic_requests(tokenizer: Any, n: int, input_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    """``n`` completion prompts of ``input_len`` tokens of random words each (seeded), asking ``output_len`` new tokens.

    The words come from :func:`word_tokens`, so a prompt holds exactly ``input_len`` tokens by this tokenizer (the
    count is measured again and recorded); the prompt sent is text, as a client sends it."""
    rng = random.Random(seed)
    pool = word_tokens(tokenizer)
    if len(pool) < 8:
        raise ValueError(f"the tokenizer has only {len(pool)} whole-word tokens: too few for random prompts")
    out = []
    for _ in range(n):
        text = tokenizer.decode([rng.choice(pool) for _ in range(input_len)])
        out.append(RequestSpec(text, output_len, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return out


def chat_requests(tokenizer: Any, n: int, output_len: int, seed: int) -> list[RequestSpec]:
    """``n`` chat requests cycling through :data:`CHAT_PROMPTS` in a seeded order, ``output_len`` new tokens each."""
    order = list(CHAT_PROMPTS)
    random.Random(seed).shuffle(order)
    specs = []
    for i in range(n):
        text = order[i % len(order)]
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 0
        specs.append(RequestSpec([{"role": "user", "content": text}], output_len, count))
    return specs


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests of a Poisson process of ``rate`` requests/s."""
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default); None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds); a clear error otherwise."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME among {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the objective must be > 0 ms")
    return slos


# -- one request ----------------------------------------------------------------------------------------------------


def request_body(spec: RequestSpec, model: str, chat: bool, control: str, usage: bool = True) -> dict[str, Any]:
    """The JSON body of ``spec``: greedy, streamed, with the output-length control ``control``."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True}
    body["messages" if chat else "prompt"] = spec.prompt
    if usage:
        body["stream_options"] = {"include_usage": True}
    if control == "ignore_eos":
        body["ignore_eos"] = True
    elif control == "min_tokens":
        body["min_tokens"] = spec.max_tokens
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send(client: Any, url: str, body: dict[str, Any], chat: bool, t0: float) -> RequestResult:
    """POST ``body`` (streamed) and time every chunk with text; errors become a failed result, never an exception."""
    start = time.perf_counter()
    result = RequestResult(ok=False, start=start - t0)
    last = None
    usage_tokens = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error in stream: {str(chunk['error'])[:300]}"
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if _chunk_text(chunk, chat):
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        result.error = f"{type(e).__name__}: {str(e)[:300]}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens, result.counted_by = (usage_tokens, "usage") if usage_tokens else (chunks, "chunks")
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "the stream ended without any text"
    return result


async def probe_length_control(client: Any, url: str, spec: RequestSpec, model: str, chat: bool) -> dict[str, Any]:
    """Find what this server accepts to fix output lengths: ``ignore_eos``, else ``min_tokens``, else nothing (each
    also without ``stream_options`` when that is what it refused). Returns the choice and the refusals met."""
    refused = []
    for control in LENGTH_CONTROLS:
        for usage in (True, False):
            r = await send(client, url, request_body(spec, model, chat, control, usage), chat, time.perf_counter())
            if r.ok:
                return {"length_control": control, "stream_usage": usage, "refused": refused,
                        "probe_output_tokens": r.output_tokens}  # fmt: skip
            refused.append({"length_control": control, "stream_usage": usage, "error": r.error})
            if r.error and not r.error.startswith("HTTP 4"):
                raise RuntimeError(f"the server at {url} failed a probe request: {r.error}")
    raise RuntimeError(f"the server at {url} refused every probe request: {refused}")


# -- a run ----------------------------------------------------------------------------------------------------------


@dataclass
class LoadSettings:
    """Where to send and how: the endpoint URL, the model id, chat or completions, and the bounds."""

    url: str  # the full endpoint: .../v1/completions or .../v1/chat/completions
    model: str
    chat: bool
    length_control: str = "ignore_eos"
    stream_usage: bool = True
    request_timeout: float = 300.0  # seconds one request may take
    max_seconds: float = 600.0  # seconds one run may take; requests still running then are cancelled (failed)
    slos: dict[str, float] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def new_client(settings: LoadSettings, connections: int) -> Any:
    """An async HTTP client with ``connections`` connections and the per-request timeout."""
    timeout = httpx.Timeout(settings.request_timeout, connect=min(30.0, settings.request_timeout))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=settings.headers, trust_env=False)


async def run_load(settings: LoadSettings, specs: list[RequestSpec], *, concurrency: int | None = None,
                   rate: float | None = None, seed: int = 0) -> list[RequestResult]:  # fmt: skip
    """Send every request of ``specs``: at most ``concurrency`` at once, or at Poisson arrivals of ``rate``/s (with
    ``concurrency`` as a cap when both are given). One result per request, in order."""
    if concurrency is None and rate is None:
        raise ValueError("run_load needs a concurrency or a request rate")
    offsets = poisson_offsets(len(specs), rate, seed) if rate else [0.0] * len(specs)
    gate = asyncio.Semaphore(concurrency or len(specs))
    results: list[RequestResult | None] = [None] * len(specs)
    async with new_client(settings, concurrency or min(len(specs), 256)) as client:
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with gate:
                body = request_body(spec, settings.model, settings.chat, settings.length_control,
                                    settings.stream_usage)  # fmt: skip
                results[i] = await send(client, settings.url, body, settings.chat, t0)

        tasks = [asyncio.create_task(one(i, s)) for i, s in enumerate(specs)]
        _, pending = await asyncio.wait(tasks, timeout=settings.max_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    limit = f"cancelled: the run's time limit ({settings.max_seconds:.0f} s) passed"
    return [r if r is not None else RequestResult(ok=False, error=limit) for r in results]


def _stats(values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values_s]
    mean = sum(ms) / len(ms) if ms else None
    return {"mean": mean, **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], specs: list[RequestSpec], duration: float,
              slos: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    """A run's figures (see the module docstring); latencies in milliseconds, rates per second of ``duration``."""
    done = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(s.prompt_tokens for s, r in zip(specs, results) if r.ok)

    def meets(r: RequestResult) -> bool:
        tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        got = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.e2e * 1e3}
        return all(got[k] <= v for k, v in slos.items())

    lengths = [r.output_tokens for r in done]
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "errors": errors[:5], "duration_s": duration,
        "request_throughput": len(done) / duration, "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + in_tokens) / duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "output_len_min": min(lengths, default=0), "output_len_max": max(lengths, default=0),
        "output_len_asked": specs[0].max_tokens if specs else 0,
        "counted_by": sorted({r.counted_by for r in done}),
        "ttft_ms": _stats([r.ttft for r in done]), "tpot_ms": _stats(tpots),
        "itl_ms": _stats([g for r in done for g in r.itl]), "e2el_ms": _stats([r.e2e for r in done]),
        "goodput": sum(meets(r) for r in done) / duration if slos else None, "slos_ms": slos,
    }  # fmt: skip


def measure(settings: LoadSettings, specs: list[RequestSpec], *, concurrency: int | None = None,
            rate: float | None = None, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """One run (:func:`run_load`) summarized, with its mode and the load average before and after."""
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = asyncio.run(run_load(settings, specs, concurrency=concurrency, rate=rate, seed=seed))
    duration = time.perf_counter() - t0
    mode = {"concurrency": concurrency, "rate": rate}
    return {**mode, **summarize(results, specs, duration, settings.slos), "load_before": load_before,
            "load_after": os.getloadavg()}  # fmt: skip
