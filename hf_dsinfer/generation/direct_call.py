"""A compiled decode step called without dynamo's per-call guard walk, inside one decoding loop.

Every call of a ``torch.compile``-d function first walks its guards: a check per parameter, buffer, packed weight
and Python attribute the trace read (SmolLM2-135M's int4 step: 851 tensor checks among some 8,000 others), then
runs the transformed bytecode that gathers the graph's inputs and calls the compiled graph. Measured on SmolLM2's
int4 decode step (one row, one thread, this 2-core EPYC): 1.1-1.5 ms of a 13 ms step in the guard walk, which reads
a tree the step's weights have just pushed out of the CPU caches.

Within one decoding loop (one ``generate`` call, greedy, sampled or speculative: the loop owns the model from its
first step to its last) nothing those object guards check can change: the same modules, the same weights (updated
in place at most), the same packed copies, the same cache tensors. So after a step of a batch bucket has run
through the guarded call, the loop's later steps of that bucket call the cache entry dynamo has just run (its
transformed bytecode, which still reads every input afresh) directly, checking only what does change from step to
step: the ambient state (grad mode, threads, default device, torch function modes) and the symbolic shape guards on
the attended length (a length the entry does not cover, e.g. the whole cache, goes through the guarded call). vLLM
dispatches its compiled models to the transformed bytecode for the same reason.

The next loop starts with a guarded call again, so anything changed between ``generate`` calls (weights replaced,
adapters, settings) is seen by dynamo as before. ``HF_DSINFER_CPU_GUARDS=every`` guards every step. Where the
installed torch lacks a probed internal (``_debug_get_cache_entry_list``, a guard manager's leaf and epilogue
guards), every step is guarded.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

import torch

#: ``first`` (default): guard the first step of each bucket in a decoding loop, call the rest directly (see the
#: module docstring); ``every``: dynamo's guards on every step.
GUARDS_ENV = "HF_DSINFER_CPU_GUARDS"
_MODES = ("first", "every")


def guards_mode() -> str:
    """:data:`GUARDS_ENV`'s value, checked (a bad one names the variable and the choices)."""
    mode = os.environ.get(GUARDS_ENV, "first").strip().lower() or "first"
    if mode not in _MODES:
        raise ValueError(f"{GUARDS_ENV}={mode!r}: use 'first' (the default) or 'every'")
    return mode


class DirectCall:
    """One dynamo cache entry of a compiled step, called without the object guards (see the module docstring).

    ``guards``: the entry's ambient (root leaf) and epilogue (symbolic shape, identity) guards, each called with the
    frame's locals as a dict; ``shape``: the ``input_ids`` shape the entry was taken for.
    """

    def __init__(self, fn: Callable[..., Any], names: tuple[str, ...], guards: list, shape: torch.Size) -> None:
        self.fn = fn
        self.names = names
        self.guards = guards
        self.shape = shape

    def __call__(self, *args: Any) -> Any | None:
        """The compiled step's output for ``args`` (the traced function's arguments), or None where a guard fails
        (the caller then makes the guarded call)."""
        if args[1].shape != self.shape:
            return None
        frame = dict(zip(self.names, args))
        try:
            if not all(guard(frame) for guard in self.guards):
                return None
        except Exception:  # noqa: BLE001 - a guard that cannot be evaluated is a failed one
            return None
        return self.fn(*args)


def capture(compiled: Any, args: tuple) -> DirectCall | None:
    """The :class:`DirectCall` of the cache entry ``compiled`` (a ``torch.compile`` wrapper of a bound method) has
    just run for ``args`` (the traced function's arguments, ``self`` first), or None where it cannot be taken."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        func = compiled._torchdynamo_orig_callable.__func__
        code = func.__code__
        entries = _debug_get_cache_entry_list(code)
        if not entries:
            return None
        entry = entries[0]  # the most recently used entry: dynamo moves a hit to the front
        names = code.co_varnames[: code.co_argcount]
        frame = dict(zip(names, args))
        manager = entry.guard_manager
        if not manager.check(frame):  # not the entry that ran (the full check includes the subset kept below)
            return None
        root = manager.root
        guards = [*root.get_leaf_guards(), *root.get_epilogue_lambda_guards()]
        fn = types.FunctionType(entry.code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    except Exception:  # noqa: BLE001 - a torch without these internals: guarded calls, as before
        return None
    return DirectCall(fn, names, guards, args[1].shape)
