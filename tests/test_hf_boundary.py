"""The transformers boundary: only ``hf_dsinfer/hf_compat.py`` touches transformers internals.

transformers renames private names in minor releases (5.24 renamed the cache keyword and changed helpers' parameters
without a shim). Every other file of the package must use transformers' public API or ``hf_compat``; this test fails
on a file that imports a private transformers name, or reads or writes an attribute whose name is private in
transformers (an attribute access, or ``getattr``/``hasattr``/``setattr`` with the name as a string).

A private transformers name is a leading-underscore identifier (not a dunder) that transformers' own code defines or
accesses as an attribute (its ``def _x`` and ``._x``), outside the per-model folders and torch's own private names.
hf_dsinfer's private names that transformers happens to use too are listed in ``SHARED_BY_DESIGN`` with the reason.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "hf_dsinfer", ROOT / "kernels"]
BOUNDARY = ROOT / "hf_dsinfer" / "hf_compat.py"

# Names transformers uses privately that hf_dsinfer also uses for its own attributes or overrides on purpose, with
# why. Any other overlap fails the test until it is renamed or listed here.
_OURS = "hf_dsinfer's own attribute of its own class (transformers uses the same generic name elsewhere)"
SHARED_BY_DESIGN: dict[str, str] = {
    "_process_model_before_weight_loading": "HfQuantizer's extension hook, overridden by DsInferQuantizer "
    "(a contract test checks transformers still calls it)",
    "_process_model_after_weight_loading": "HfQuantizer's extension hook, overridden by DsInferQuantizer",
    **{name: _OURS for name in ("_cancelled", "_capture", "_convert", "_counter", "_lock", "_loop", "_output",
                                "_reset_state", "_run", "_thread")},
}  # fmt: skip


def _torch_private_names() -> set[str]:
    """torch's own private names (``nn.Module._parameters``, ``torch._dynamo``, ...): not transformers'."""
    import pkgutil

    import torch

    names = set(dir(torch.nn.Module())) | set(dir(torch)) | {m.name for m in pkgutil.iter_modules(torch.__path__)}
    return {n for n in names if n.startswith("_")}


def _transformers_private_names() -> set[str]:
    """Leading-underscore identifiers transformers defines or reads as attributes (its models/ folders and torch's own
    private names excluded)."""
    top = Path(transformers.__file__).parent
    pattern = re.compile(r"(?:\bdef\s+|\.)(_[A-Za-z][A-Za-z0-9_]*)")
    names: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d not in ("models", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                text = Path(dirpath, name).read_text(encoding="utf-8", errors="replace")
                names.update(m for m in pattern.findall(text) if not m.startswith("__"))
    return names - _torch_private_names()


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in pkg.rglob("*.py") if p != BOUNDARY)


def _private_touches(path: Path, tree: ast.Module, private: set[str]) -> list[str]:
    found = []
    rel = path.relative_to(ROOT)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            parts = node.module.split(".")
            bad = [p for p in parts if p.startswith("_")] + [a.name for a in node.names if a.name.startswith("_")]
            if bad:
                found.append(f"{rel}:{node.lineno}: imports private {bad} from {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("transformers") and any(p.startswith("_") for p in alias.name.split(".")):
                    found.append(f"{rel}:{node.lineno}: imports private module {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in private:
            found.append(f"{rel}:{node.lineno}: touches transformers' private attribute .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.append(f"{rel}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}) touches a private name")
    return found


def test_only_the_boundary_touches_transformers_internals():
    trees = {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in _sources()}
    private = _transformers_private_names() - set(SHARED_BY_DESIGN)
    found = [line for path, tree in trees.items() for line in _private_touches(path, tree, private)]
    assert not found, (
        "Private transformers names used outside hf_dsinfer/hf_compat.py (wrap them there, behind a probed feature):\n"
        + "\n".join(found)
    )


def test_the_scan_sees_private_names():
    """The scan is not vacuous: transformers' well-known private names are in its set, and a planted use is found."""
    private = _transformers_private_names()
    assert {"_attn_implementation", "_from_config", "_sample", "_prepare_generation_config"} <= private
    tree = ast.parse("def f(model):\n    return model.config._attn_implementation, getattr(model, '_from_config')\n")
    found = _private_touches(ROOT / "hf_dsinfer" / "x.py", tree, private)
    assert len(found) == 2, found


def test_deprecations_from_hf_dsinfer_frames_are_errors():
    """pyproject's filter turns a FutureWarning attributed to an hf_dsinfer module into an error (and leaves one
    attributed to user code alone), so a deprecated transformers call of ours fails the suite on the newest release."""
    import warnings

    import pytest

    with pytest.raises(FutureWarning):
        warnings.warn_explicit("deprecated", FutureWarning, "api.py", 1, module="hf_dsinfer.generation.api")
    with pytest.warns(FutureWarning):
        warnings.warn_explicit("deprecated", FutureWarning, "user.py", 1, module="user_script")
