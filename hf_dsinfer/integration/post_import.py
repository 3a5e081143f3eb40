"""Run a callback when a module finishes importing (a post-import hook), so ``import hf_dsinfer`` stays light.

hf_dsinfer patches two transformers modules: ``transformers.quantizers.auto`` (the ``dsinfer`` quantization method)
and ``transformers.modeling_utils`` (the ``inference_config=`` keyword of ``from_pretrained``). Importing them costs
several CPU-seconds (torch._dynamo, torch.distributed, sympy, scipy, ...), more than torch and transformers together.
Every way a model reaches hf_dsinfer (``from_pretrained``, ``pipeline``, a saved model whose config.json names the
``dsinfer`` method, ``init_inference``) imports those modules first, so registering the moment they are imported is
as correct as registering eagerly and costs nothing to a program that never loads a model (``hf-dsinfer --help``).

This module imports nothing heavy (no torch, no transformers): it must stay cheap to import.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

Callback = Callable[[ModuleType], None]

_FINDER_FLAG = "_hf_dsinfer_post_import"


class _PostImportFinder(MetaPathFinder):
    """A meta-path finder that locates nothing itself: it asks the finders after it for the spec of a watched module
    and wraps that spec's loader so the callbacks run right after the module body has executed."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._lock = threading.Lock()
        setattr(self, _FINDER_FLAG, True)

    def add(self, name: str, callback: Callback) -> None:
        with self._lock:
            self.pending.setdefault(name, []).append(callback)

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:  # noqa: ANN001 (importlib's API)
        if fullname not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or getattr(finder, _FINDER_FLAG, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # a namespace package or an unusual loader: left alone (callbacks never fire)
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            self._fire(fullname, module)

        # The loader object belongs to this one spec (importlib builds one per module file), so patching the
        # instance keeps its type (and get_source, resource readers, ...) intact.
        loader.exec_module = exec_module
        return spec

    def _fire(self, name: str, module: ModuleType) -> None:
        with self._lock:
            callbacks = self.pending.pop(name, [])
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        for callback in callbacks:
            _run(callback, module)


def _run(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a failing registration must not break `import transformers...` for the user
        from ..log import logger

        logger.warning(
            "hf_dsinfer could not register with %s; inference_config= and the dsinfer quantization method may be "
            "unavailable. Please report this with the traceback below.",
            module.__name__,
            exc_info=True,
        )


def _finder() -> _PostImportFinder:
    for finder in sys.meta_path:
        if getattr(finder, _FINDER_FLAG, False):
            return finder  # type: ignore[return-value]
    finder = _PostImportFinder()
    sys.meta_path.insert(0, finder)
    return finder


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` has been imported: now if it already is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _run(callback, module)
        return
    _finder().add(name, callback)
