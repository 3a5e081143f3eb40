"""The bench commands' reports: the markdown table, failed and noisy rows, the greedy-token verdict, the plot, files.

Shared by ``hf-dsinfer bench`` (hf_dsinfer/bench/decode.py), ``bench --hybrid`` and ``bench --encoder``. A contender
that raised is a row with ``failed=True`` and its ``error``: it is reported as failed, never left out or counted as
agreeing, and a failed hf_dsinfer contender makes the command exit 1 (:func:`exit_code`).
"""

from __future__ import annotations

import json
import os
from typing import Any

NOISY_SPREAD = 1.3  # max/min decode tokens/s over the repeats above which a row is flagged as noisy


def loadavg_text() -> str | None:
    """The 1, 5 and 15-minute load averages as ``/proc/loadavg`` writes them ("0.52 0.61 0.70"), or None."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def error_text(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 160 characters): what a failed row shows."""
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def is_ours(peer: str) -> bool:
    """Whether contender ``peer`` is hf_dsinfer's (``dsinfer``, ``dsinfer-int8``, ...): its failure fails the bench."""
    return peer.startswith("dsinfer")


def failed_rows(report: dict) -> list[dict]:
    """The rows whose contender raised (no figures)."""
    return [r for r in report["rows"] if r.get("failed")]


def noisy_rows(report: dict) -> list[dict]:
    """Rows whose decode rate varied by more than ``NOISY_SPREAD`` (max / min) over the repeats."""
    return [r for r in report["rows"] if (r.get("spread") or 0) > NOISY_SPREAD]


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def markdown_table(report: dict) -> str:
    """The report as a markdown table (one row per contender and batch size), with a header line."""
    s = report["settings"]
    lines = [
        f"**{report['preset']}** on {report['device']}, {report['dtype']}, prompt {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens; copy bandwidth {report['copy_gbs']:.1f} GB/s",
        "",
        "| contender | batch | first token ms | decode tok/s | min-max tok/s | ms/token | peak MiB | GB/s | % copy BW "
        "| speedup | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base = {r["batch"]: r["decode_tokens_per_s"] for r in report["rows"] if r["peer"] == "eager"}
    for r in report["rows"]:
        ref = base.get(r["batch"])
        speed = r["decode_tokens_per_s"] / ref if r["decode_tokens_per_s"] and ref else None
        lines.append(
            f"| {r['name']} | {r['batch']} | {_fmt(r['ttft_ms'], '.2f')} | {_fmt(r['decode_tokens_per_s'], '.1f')} "
            f"| {_spread_cell(r)} | {_fmt(r['ms_per_token'], '.3f')} | {_fmt(r['peak_mem_mib'], '.0f')} "
            f"| {_fmt(r['gbs'], '.2f')} "
            f"| {_fmt(r['pct_copy_bw'], '.1f')} | {_fmt(speed, '.2f')}{'x' if speed else ''} | {r['note']} |"
        )
    repeats = s.get("repeats", 1)
    noisy = noisy_rows(report)
    lines += ["", f"Median of {repeats} timed run(s) per row; min-max is the decode rate's spread over them."]
    failed = failed_rows(report)
    for name, group in _by_contender(failed).items():
        errors = sorted({r["error"] for r in group})
        lines.append(f"**FAILED:** {name} at batch {_batches(group)}: {'; '.join(errors)}")
    agreement = token_agreement_line(report)
    if agreement:
        lines.append(agreement)
    if noisy:
        lines.append(
            f"**Noisy:** {len(noisy)} row(s) varied by more than {NOISY_SPREAD}x (max/min); "
            f"{noise_advice(s.get('threads'), repeats)} before comparing."
        )
    return "\n".join(lines) + "\n"


def _by_contender(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["name"], []).append(r)
    return out


def _batches(rows: list[dict]) -> str:
    return ", ".join(str(r["batch"]) for r in rows)


def token_agreement_line(report: dict) -> str | None:
    """The greedy-token verdict, over the rows that ran only, naming the rows that did not (None: nothing to say).

    A row whose contender failed has no tokens: it is neither identical nor different, so it is listed as not run
    instead of being counted in "every row".
    """
    rows = report["rows"]
    failed = failed_rows(report)
    not_run = "; ".join(f"{name} at batch {_batches(g)}" for name, g in _by_contender(failed).items())
    checked = [r["tokens_match"] for r in rows if not r.get("failed") and r.get("tokens_match") is not None]
    if not checked:
        if not failed:
            return None
        return f"**Greedy tokens not compared** (no row ran next to an HF eager row); did not run: {not_run}."
    if all(checked):
        verdict = (
            "Greedy tokens identical to HF eager's in every row."
            if not failed
            else f"Greedy tokens identical to HF eager's in the {len(checked)} row(s) that ran"
        )
    else:
        verdict = f"**Greedy tokens differ from HF eager's in {checked.count(False)} row(s)** (see the notes)"
        verdict += "." if not failed else ""
    return verdict if not failed else f"{verdict}; **did not run (failed)**: {not_run}."


def noise_advice(threads: int | None, repeats: int) -> str:
    """What to change against a noisy run, given the settings it ran with (no advice to set what was set)."""
    steps = [f"more --repeats (this run: {repeats})"]
    if threads != 1:
        steps.append("--threads 1")
    steps.append("an idle machine")
    return "rerun with " + ", ".join(steps[:-1]) + " or on " + steps[-1]


def _spread_cell(row: dict) -> str:
    if row.get("tokens_per_s_min") is None:
        return "n/a"
    flag = " (noisy)" if row["spread"] > NOISY_SPREAD else ""
    return f"{row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}{flag}"


def write_plot(report: dict, path: str) -> None:
    """A PNG of decode tokens/s per batch size, one line per contender (error bars: min-max over the repeats)."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or -e '.[plot]' in a clone)"
        ) from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for peer in dict.fromkeys(r["peer"] for r in report["rows"]):
        rows = [r for r in report["rows"] if r["peer"] == peer and r["decode_tokens_per_s"]]
        failed = [r for r in report["rows"] if r["peer"] == peer and r.get("failed")]
        if rows:
            x = [r["batch"] for r in rows]
            y = [r["decode_tokens_per_s"] for r in rows]
            err = [[v - r["tokens_per_s_min"] for v, r in zip(y, rows)],
                   [r["tokens_per_s_max"] - v for v, r in zip(y, rows)]]  # fmt: skip
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=rows[0]["name"])
        if failed:  # a contender that did not run is marked (an x at 0 per failed batch), never silently left out
            ax.plot([r["batch"] for r in failed], [0] * len(failed), linestyle="none", marker="x", color="red",
                    markersize=9, label=f"{failed[0]['name']}: FAILED (batch {_batches(failed)})")  # fmt: skip
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_xticks(sorted({r["batch"] for r in report["rows"]}))
    ax.set_title(f"{report['preset']} on {report['device']}, {report['dtype']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def exit_code(report: dict) -> int:
    """The bench command's exit status: 1 when an hf_dsinfer contender failed (a bench must not pass without it)."""
    return 1 if report.get("hf_dsinfer_failed") else 0


def hybrid_table(rows: list[dict]) -> str:
    """``bench --hybrid``'s rows as a markdown table, then a ``**FAILED:**`` line per contender that raised."""
    cols = ("mode", "peer", "generate_ms", "refresh_ms", "train_ms", "e2e_ms", "tokens_per_s", "speedup",
            "e2e_speedup", "peak_mem_mib", "note")  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) else ("-" if v is None else str(v)) for v in map(row.get, cols)]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("failed")]
    if failed:
        lines.append("")
        lines += [f"**FAILED:** {r['name']} ({r['mode']}): {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], table: str, out: str, name: str) -> None:
    """Write ``<out>/<name>.json`` (the report) and ``<out>/<name>.md`` (its markdown table), and print the table."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(table)
    print(table)
    print(f"wrote {stem}.json and {stem}.md")
