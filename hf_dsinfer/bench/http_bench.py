"""``hf-dsinfer bench --serve-url URL`` and ``--serve-peers ours,transformers,...``: the HTTP benchmark's runs, report
and table (the load itself: :mod:`.http_load`; the servers started side by side: :mod:`.http_peers`).

One server: probe what fixes output lengths, then a concurrency sweep and a Poisson rate sweep on one fixed request
set. Side by side: for each of ``rounds`` rounds, every peer in turn is started, loaded with the same request set and
sweep, and stopped (one server alive at a time, so none takes CPU from another; alternating rounds let a change of
machine load hit every peer alike). Every run carries the load average before and after it.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import urllib.request
from typing import Any

from ..log import logger
from .http_load import LoadSettings, RequestSpec, measure, new_client, probe_length_control
from .report import error_text


def api_base(url: str) -> str:
    """``http://h:p``, ``http://h:p/v1`` or ``.../v1/chat/completions`` -> ``http://h:p/v1``."""
    url = url.rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        url = url.removesuffix(tail)
    return url if url.endswith("/v1") else url + "/v1"


def served_model(base: str, headers: dict[str, str] | None = None, timeout: float = 30.0) -> str:
    """The first model id ``GET {base}/models`` lists (what requests must name)."""
    req = urllib.request.Request(base + "/models", headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.load(r)
    ids = [m["id"] for m in data.get("data", [])]
    if not ids:
        raise RuntimeError(f"{base}/models lists no model: pass --model-name")
    return ids[0]


def bench_server(base: str, model: str, specs: list[RequestSpec], chat: bool, *, concurrencies: list[int],
                 rates: list[float], slos: dict[str, float], seed: int, request_timeout: float, max_seconds: float,
                 headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Every run of the sweep against one server; returns its section of the report."""
    url = base + ("/chat/completions" if chat else "/completions")
    settings = LoadSettings(url=url, model=model, chat=chat, request_timeout=request_timeout, max_seconds=max_seconds,
                            slos=slos, headers=headers or {})  # fmt: skip

    async def probe() -> dict[str, Any]:
        async with new_client(settings, 1) as client:
            return await probe_length_control(client, url, specs[0], model, chat)

    found = asyncio.run(probe())
    settings.length_control, settings.stream_usage = found["length_control"], found["stream_usage"]
    if found["refused"]:
        refused = ", ".join(dict.fromkeys(r["length_control"] for r in found["refused"]))
        logger.warning("bench: %s refused %s; output lengths fixed by %s", base, refused, found["length_control"])
    runs = []
    for c in concurrencies:
        runs.append(measure(settings, specs, concurrency=c, seed=seed))
        _log_run(base, runs[-1])
    for r in rates:
        runs.append(measure(settings, specs, rate=r, seed=seed))
        _log_run(base, runs[-1])
    return {"url": url, "model": model, **found, "runs": runs}


def _log_run(base: str, run: dict) -> None:
    logger.info("bench: %s %s: %d/%d done, %.1f output tok/s, TTFT p50 %s ms, load %.1f -> %.1f", base,
                _mode(run), run["completed"], run["requests"], run["output_tokens_per_s"], _ms(run["ttft_ms"]["p50"]),
                run["load_before"][0], run["load_after"][0])  # fmt: skip


def _mode(run: dict) -> str:
    if run.get("rate"):
        return f"rate {run['rate']:g}/s" + (f" (max {run['concurrency']})" if run.get("concurrency") else "")
    return f"concurrency {run['concurrency']}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def report_header(specs: list[RequestSpec], request_set: str, chat: bool, threads: int | None, seed: int) -> dict:
    """The settings and environment every HTTP report starts with."""
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {
        "mode": "http", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "request_set": request_set, "endpoint": "chat" if chat else "completions", "requests": len(specs),
        "input_tokens_mean": sum(s.prompt_tokens for s in specs) / max(1, len(specs)),
        "output_tokens": specs[0].max_tokens if specs else 0, "seed": seed, "threads": threads,
        "versions": {p: version(p) for p in ("hf-dsinfer", "torch", "transformers", "llama_cpp_python", "xllamacpp")},
    }  # fmt: skip


def run_peers(names: list[str], model: str, gguf: str | None, specs: list[RequestSpec], chat: bool, *, rounds: int,
              threads: int, max_model_len: int, ready_timeout: float, **sweep: Any) -> list[dict]:  # fmt: skip
    """``rounds`` rounds of every peer in turn (start, load, stop); one report section per peer and round."""
    from .http_peers import RunningPeer, peer_command

    sections = []
    for rnd in range(rounds):
        for name in names:
            peer = peer_command(name, model, gguf, threads, max_model_len, max(sweep["concurrencies"] or [16]))
            section: dict[str, Any] = {"peer": name, "round": rnd + 1, "command": peer.argv}
            if peer.skip_reason:
                sections.append({**section, "skipped": peer.skip_reason})
                logger.warning("bench: %s skipped: %s", name, peer.skip_reason)
                continue
            logger.info("bench: round %d, starting %s: %s", rnd + 1, name, " ".join(peer.argv))
            try:
                with RunningPeer(peer, ready_timeout) as running:
                    section["startup_s"] = running.startup_s
                    section["log"] = running.log.name
                    try:
                        section.update(bench_server(running.base_url, peer.model_id, specs, chat, **sweep))
                    except Exception as e:  # noqa: BLE001 - a failing peer is a failed section, the others run
                        section.update(failed=error_text(e), log_tail=running.log_tail())
            except Exception as e:  # noqa: BLE001 - it never became ready: reported with its log
                section["failed"] = error_text(e)
            if section.get("failed"):
                logger.error("bench: %s failed: %s", name, section["failed"])
            sections.append(section)
    return sections


def markdown(report: dict) -> str:
    """The report as a markdown table: one row per server and run, load average included."""
    head = (f"HTTP benchmark, {report['date']}, {report['machine']}: {report['requests']} {report['request_set']} "
            f"requests on {report['endpoint']}, {report['input_tokens_mean']:.0f} input tokens mean, "
            f"{report['output_tokens']} output tokens, threads {report['threads']}")  # fmt: skip
    cols = ("| server | run | done | length | out tok/s | req/s | TTFT p50/p90/p99 ms | TPOT p50/p99 ms | "
            "ITL p50/p99 ms | e2e p50/p99 ms | goodput req/s | load before -> after |")  # fmt: skip
    lines = [head, "", cols, "|" + "---|" * 12]
    for s in report["servers"]:
        name = s.get("peer", s.get("url", "?")) + (f" (round {s['round']})" if "round" in s else "")
        if "runs" not in s:
            lines.append(f"| {name} | {'skipped: ' + s['skipped'] if 'skipped' in s else 'FAILED: ' + s['failed']} |"
                         + " |" * 10)  # fmt: skip
            continue
        for r in s["runs"]:
            t, tp, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2el_ms"]
            length = f"{r['output_len_min']}-{r['output_len_max']} ({s['length_control']})"
            good = "n/a" if r["goodput"] is None else f"{r['goodput']:.2f}"
            lines.append(
                f"| {name} | {_mode(r)} | {r['completed']}/{r['requests']} | {length} | {r['output_tokens_per_s']:.1f} "
                f"| {r['request_throughput']:.2f} | {_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} "
                f"| {_ms(tp['p50'])}/{_ms(tp['p99'])} | {_ms(i['p50'])}/{_ms(i['p99'])} "
                f"| {_ms(e['p50'])}/{_ms(e['p99'])} "
                f"| {good} | {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |"
            )
    failed = [r for s in report["servers"] for r in s.get("runs", []) if r["failed"]]
    if failed:
        lines += ["", f"**Failed requests** in {len(failed)} run(s): " + "; ".join(sorted({e for r in failed
                                                                                            for e in r["errors"]}))]
    return "\n".join(lines)


def _numbers(value: str | None, kind: type, flag: str) -> list:
    try:
        out = [kind(v) for v in str(value or "").split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated numbers, got {value!r}") from None
    if any(v <= 0 for v in out):
        raise SystemExit(f"{flag} takes numbers > 0, got {value!r}")
    return out


def http_main(ns: Any) -> dict:
    """``bench --serve-url`` / ``--serve-peers``: build the request set, run the sweep(s), write the report."""
    from .http_load import chat_requests, parse_goodput, synthetic_requests
    from .report import write_report

    try:
        slos = parse_goodput(ns.goodput)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    concurrencies = _numbers(ns.concurrency, int, "--concurrency")
    rates = _numbers(ns.request_rates, float, "--request-rates")
    if not concurrencies and not rates:
        raise SystemExit("give --concurrency and/or --request-rates")
    if ns.num_prompts < 1 or ns.new_tokens < 2 or ns.prompt_len < 1:
        raise SystemExit("the HTTP benchmark needs --num-prompts >= 1, --new-tokens >= 2 and --prompt-len >= 1")
    names = [p.strip() for p in str(ns.serve_peers or "").split(",") if p.strip()]
    model = ns.model
    if model is None and (names or not ns.tokenizer):
        from ..real_model import smollm2_path

        model = smollm2_path()  # the real SmolLM2 (offline), for the peers and as the tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer or model)
    chat = (ns.endpoint or ("chat" if ns.request_set == "chat" else "completions")) == "chat"
    if ns.request_set == "chat":
        specs = chat_requests(tokenizer, ns.num_prompts, ns.new_tokens, ns.seed)
    else:
        specs = synthetic_requests(tokenizer, ns.num_prompts, ns.prompt_len, ns.new_tokens, ns.seed)
        if chat:  # the same text as a user message
            specs = [RequestSpec([{"role": "user", "content": s.prompt}], s.max_tokens, s.prompt_tokens)
                     for s in specs]  # fmt: skip
    report = report_header(specs, ns.request_set, chat, ns.threads, ns.seed)
    sweep = dict(concurrencies=concurrencies, rates=rates, slos=slos, seed=ns.seed,
                 request_timeout=ns.request_timeout, max_seconds=ns.max_seconds)  # fmt: skip
    if names:
        from ..real_model import smollm2_gguf

        gguf = ns.gguf or (str(smollm2_gguf()) if smollm2_gguf() else None)
        report["model"], report["gguf"] = model, gguf
        report["servers"] = run_peers(names, model, gguf, specs, chat, rounds=ns.rounds,
                                      threads=ns.threads or os.cpu_count() or 1, max_model_len=ns.max_model_len,
                                      ready_timeout=ns.ready_timeout, **sweep)  # fmt: skip
        report["hf_dsinfer_failed"] = any(s.get("failed") for s in report["servers"] if s["peer"].startswith("ours"))
    else:
        base = api_base(ns.serve_url)
        key = ns.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        name = ns.model_name or served_model(base, headers)
        report["servers"] = [bench_server(base, name, specs, chat, headers=headers, **sweep)]
    write_report(report, markdown(report) + "\n", ns.out, "bench-http")
    if ns.plot:
        from .plots import write_http_plot

        write_http_plot(report, ns.plot)
        print(f"wrote {ns.plot}")
    return report
