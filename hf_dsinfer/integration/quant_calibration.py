"""Calibrated weight quantization (GPTQ): the ``quant.weight.calibration`` setting, its text and the statistics.

Round-to-nearest int4 costs a real model a lot of quality (SmolLM2-135M: +23-58% perplexity, docs/quantization.md).
GPTQ uses the layer inputs seen on a little calibration text: for each quantized linear, ``H = X^T X / n`` over its
inputs ``X [n, K]``, and :func:`hf_dsinfer.kernels.quant_format.gptq_codes` rounds the weight so that ``X @ W^T``
changes least. The model must be loaded in float once for that forward pass, so a calibrated load quantizes after the
weights are read (not tensor by tensor while they load) and needs the float model's memory for a moment.

Setting (our own key; DeepSpeed's schema has none; the option names follow transformers' ``GPTQConfig``)::

    quant={"enabled": True, "weight": {"num_bits": 4, "calibration": {
        "method": "gptq",          # the only method
        "dataset": None,           # None: built-in text; a path to a UTF-8 text file; or a list of strings
        "num_samples": 32,         # sequences of ...
        "seq_len": 256,            # ... tokens each, cut from the tokenized text (fewer if the text is shorter)
        "damp_percent": 0.01}}}    # GPTQ's dampening: this fraction of the mean diagonal is added to H
    # shorthand: "calibration": "gptq" (or True) for all the defaults

The built-in text is the license texts every Debian/Ubuntu machine ships in ``/usr/share/common-licenses``
(Apache-2.0, MPL-2.0, LGPL-2.1, GFDL-1.3, Artistic; never GPL-3, the evaluation text of docs/quantization.md), or
CPython's own license file elsewhere. Text close to what the model will see calibrates best: pass your own.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..log import logger

if TYPE_CHECKING:
    import torch
    from torch import nn

CALIBRATION_DEFAULTS: dict[str, Any] = {
    "method": "gptq",
    "dataset": None,
    "num_samples": 32,
    "seq_len": 256,
    "damp_percent": 0.01,
}
_METHODS = ("gptq",)
_LICENSES = Path("/usr/share/common-licenses")
#: The built-in calibration text: these files of Debian's base-files (GPL-3, the evaluation text, is left out).
CALIBRATION_LICENSES = ("Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic")


def parse_calibration(value: Any) -> dict[str, Any] | None:
    """The normalized ``quant.weight.calibration`` (a JSON-serializable dict), or None (round to nearest)."""
    if value in (None, False):
        return None
    if value is True:
        value = {}
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"quant.weight.calibration must be a dict such as {{'method': 'gptq', 'dataset': 'my_text.txt'}} (or "
            f"'gptq'), got {value!r}."
        )
    for key in value:
        if key not in CALIBRATION_DEFAULTS:
            close = difflib.get_close_matches(str(key), CALIBRATION_DEFAULTS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"Unknown quant.weight.calibration key {key!r}.{hint} Valid keys: {', '.join(CALIBRATION_DEFAULTS)}."
            )
    out = {**CALIBRATION_DEFAULTS, **value}
    if out["method"] not in _METHODS:
        raise ValueError(
            f"quant.weight.calibration.method must be one of {', '.join(_METHODS)}, got {out['method']!r}."
        )
    for key in ("num_samples", "seq_len"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"quant.weight.calibration.{key} must be an integer >= 1, got {v!r}.")
    damp = out["damp_percent"]
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp < 1:
        raise ValueError(f"quant.weight.calibration.damp_percent must be a number in (0, 1), got {damp!r}.")
    dataset = out["dataset"]
    if isinstance(dataset, os.PathLike):
        dataset = out["dataset"] = str(dataset)
    if isinstance(dataset, str):
        if not Path(dataset).expanduser().is_file():
            raise ValueError(
                f"quant.weight.calibration.dataset={dataset!r} is not a file; give the path of a UTF-8 text file, a "
                "list of strings, or None for the built-in text."
            )
    elif dataset is not None and not (
        isinstance(dataset, (list, tuple)) and dataset and all(isinstance(t, str) for t in dataset)
    ):
        raise ValueError(
            "quant.weight.calibration.dataset must be None (built-in text), the path of a text file or a non-empty "
            f"list of strings, got {type(dataset).__name__}."
        )
    if isinstance(dataset, tuple):
        out["dataset"] = list(dataset)
    return out


def default_calibration_text() -> str:
    """The built-in calibration text (see the module docstring)."""
    parts = [(_LICENSES / n).read_text(encoding="utf-8") for n in CALIBRATION_LICENSES if (_LICENSES / n).is_file()]
    if parts:
        return "\n\n".join(parts)
    fallback = Path(os.__file__).parent / "LICENSE.txt"
    if fallback.is_file():
        return fallback.read_text(encoding="utf-8")
    raise FileNotFoundError(
        f"no built-in calibration text here (neither {_LICENSES} nor {fallback}); set "
        "quant.weight.calibration.dataset to a text file or a list of strings."
    )


def calibration_ids(model: nn.Module, calibration: Mapping[str, Any]) -> list[torch.Tensor]:
    """The calibration sequences ``[1, seq_len]`` (token ids on the model's device), tokenized with the model's own
    tokenizer (``AutoTokenizer.from_pretrained(model.name_or_path)``)."""
    import torch
    from transformers import AutoTokenizer

    dataset = calibration["dataset"]
    if dataset is None:
        texts = [default_calibration_text()]
    elif isinstance(dataset, str):
        texts = [Path(dataset).expanduser().read_text(encoding="utf-8")]
    else:
        texts = list(dataset)
    source = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "name_or_path", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"quant.weight.calibration tokenizes its text with the model's tokenizer, and none loads from "
            f"{source!r} ({type(e).__name__}); load the model from a folder that holds its tokenizer."
        ) from e
    n, length = calibration["num_samples"], calibration["seq_len"]
    seqs: list[torch.Tensor] = []
    for text in texts:  # each text cut into consecutive windows; a list of short strings gives one each
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        seqs += [ids[i : i + length] for i in range(0, max(len(ids) - 1, 1), length) if len(ids[i : i + length]) > 1]
    if not seqs:
        raise ValueError("quant.weight.calibration.dataset tokenized to nothing; give longer text.")
    device = next(model.parameters()).device
    return [s[None].to(device) for s in seqs[:n]]


def _stacked(batches: list[torch.Tensor], rows: int = 8) -> list[torch.Tensor]:
    """``batches`` (``[1, T]`` each) stacked into ``[<= rows, T]`` batches of equal length: fewer, larger forwards
    (no padding, so every token's activations are what a single sequence gives)."""
    import torch

    by_len: dict[int, list[torch.Tensor]] = {}
    for ids in batches:
        by_len.setdefault(ids.shape[1], []).append(ids)
    return [torch.cat(same[i : i + rows]) for same in by_len.values() for i in range(0, len(same), rows)]


def collect_hessians(
    model: nn.Module, targets: list[tuple[str, nn.Module]], batches: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``{name: H [K, K]}`` (fp32, ``X^T X / n`` over the inputs of each target linear on ``batches``).

    Linears fed the very same input tensor (q/k/v, gate/up) share one matrix, so the memory is one ``K x K`` per
    distinct input, not per linear.
    """
    import torch

    sums: dict[str, torch.Tensor] = {}  # owner name -> running X^T X
    counts: dict[str, int] = {}
    owner: dict[str, str] = {}  # target name -> the name whose matrix it shares
    # id of an input tensor in this forward -> (the tensor, kept alive so its id is not reused; the first target that
    # read it)
    seen: dict[int, tuple[torch.Tensor, str]] = {}

    def hook(name: str):
        def fn(module: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            first = seen.setdefault(id(x), (x, name))[1]
            owner.setdefault(name, first)
            if first != name:
                return  # the same input as an earlier linear: its sum is that one's
            x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [tokens, K]
            sums[name] = sums.get(name, 0) + x2.t() @ x2
            counts[name] = counts.get(name, 0) + x2.shape[0]

        return fn

    handles = [module.register_forward_hook(hook(name)) for name, module in targets]
    try:
        with torch.no_grad():
            for ids in _stacked(batches):
                seen.clear()
                model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    missing = [name for name, _ in targets if name not in owner]
    if missing:
        logger.warning("quant calibration: %d linear(s) saw no input (e.g. %s); they are rounded to nearest",
                       len(missing), missing[0])  # fmt: skip
    means = {first: sums[first] / counts[first] for first in set(owner.values())}
    return {name: means[first] for name, first in owner.items()}


def damp_of(calibration: Mapping[str, Any] | None) -> float:
    """GPTQ's dampening of a normalized calibration setting (unused without one)."""
    return calibration["damp_percent"] if calibration is not None else CALIBRATION_DEFAULTS["damp_percent"]


def refuse_calibration(calibration: Mapping[str, Any] | None, where: str) -> None:
    """Raise, naming the key, when ``calibration`` is set for a path that cannot calibrate (``where``)."""
    if calibration is not None:
        raise ValueError(
            f"quant.weight.calibration (GPTQ) is not supported {where}: it needs the whole float model in one process "
            "for its calibration pass. Remove quant.weight.calibration (round to nearest) or quantize at "
            "tensor_parallel.tp_size=1 in a plain from_pretrained / init_inference."
        )


def calibrate(
    model: nn.Module, targets: list[tuple[str, nn.Module, Any]], calibration: Mapping[str, Any] | None
) -> dict[str, torch.Tensor]:
    """``{name: H}`` for ``targets`` (``(name, module, reduce)``, as ``quantize_model_`` lists them) with a
    calibration setting: one forward pass over the calibration text. Empty without one. Row-parallel targets (a
    ``reduce``) are refused: their input features are split over ranks."""
    if calibration is None or not targets:
        return {}
    if any(reduce is not None for _, _, reduce in targets):
        refuse_calibration(calibration, "with tensor parallelism")
    import time

    start = time.perf_counter()
    batches = calibration_ids(model, calibration)
    hessians = collect_hessians(model, [(n, m) for n, m, _ in targets], batches)
    logger.info("quant calibration: %d sequences of up to %d tokens in %.1f s; quantizing %d linears with GPTQ",
                len(batches), calibration["seq_len"], time.perf_counter() - start, len(targets))  # fmt: skip
    return hessians
