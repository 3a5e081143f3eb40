"""PNG plots of the HTTP benchmark (matplotlib, optional: ``pip install matplotlib``)."""

from __future__ import annotations

from typing import Any


def write_http_plot(report: dict[str, Any], path: str) -> None:
    """Output tokens/s and median TTFT against concurrency (top) and request rate (bottom, when swept), one line per
    server and round; failed or skipped servers are left out (the table says why)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    sweeps = [("concurrency", "concurrent requests")]
    if any(r.get("rate") for s in report["servers"] for r in s.get("runs", [])):
        sweeps.append(("rate", "request rate (requests/s, Poisson)"))
    fig, axes = plt.subplots(len(sweeps), 2, figsize=(10, 3.6 * len(sweeps)), squeeze=False)
    for row, (key, xlabel) in enumerate(sweeps):
        for server in report["servers"]:
            runs = [r for r in server.get("runs", []) if r.get(key) and (key == "rate" or not r.get("rate"))]
            if not runs:
                continue
            label = server.get("peer", server.get("url", "?")) + (f" #{server['round']}" if "round" in server else "")
            xs = [r[key] for r in runs]
            axes[row][0].plot(xs, [r["output_tokens_per_s"] for r in runs], marker="o", label=label)
            axes[row][1].plot(xs, [r["ttft_ms"]["p50"] for r in runs], marker="o", label=label)
        for col, ylabel in enumerate(("output tokens/s", "TTFT p50 (ms)")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if key == "concurrency":
                ax.set_xscale("log", base=2)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(f"{report['requests']} {report['request_set']} requests, {report['output_tokens']} output tokens, "
                 f"{report['machine']}, {report['date']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
