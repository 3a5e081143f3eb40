"""The CPU decode step compiled with ``torch.compile``: the CPU counterpart of the CUDA-graph runner.

A decode step of a small model on CPU spends a third of its time in hundreds of tiny ops (views, casts, norms,
rotary, the KV store) and in Python between them. :class:`CompiledCPUDecode` hands the whole step (embedding, every
layer, final norm, LM head) to inductor's CPU backend, which fuses the elementwise work into generated C++ loops and
leaves the GEMMs to oneDNN/MKL, so one call per step replaces the op-by-op dispatch.

Shapes are kept stable so that one compiled graph serves every step of every ``generate`` call of a batch bucket:

* the batch is padded to a bucket by a :class:`~.graph_runner.GraphRunner` (static input buffers, exactly as on
  CUDA), so each bucket is compiled once and cached across calls;
* the only length that changes per step, the number of cache slots attention reads, enters as the length of a
  slice of a fixed ``arange`` marked dynamic (``torch._dynamo.mark_dynamic``), so it never triggers a recompile;
* nothing inside reads a tensor on the host (the attention layers take their sync-free branch, see
  ``StepContext.attend_len``).

Weights are not frozen: the compiled graph reads the model's parameters on every call, so in-place weight updates
(the Hybrid Engine's refresh) are seen by the next step. In buckets of 4 rows and more the linears and the LM head
call :mod:`~hf_dsinfer.modules.cpu_packed`'s op from the graph: oneDNN over a prepacked copy of each weight, which the
op re-packs when the weight changed (``HF_DSINFER_CPU_PACKED=0`` keeps ``F.linear``).

Compiling a bucket takes tens of seconds to minutes on a small CPU (tracing every layer, then C++ compilation; a
warning says so when it starts). By default it runs in a background thread while the steps of that bucket run eagerly,
and the compiled graph is swapped in between two steps once it is ready (:meth:`CompiledCPUDecode.wait` waits for it,
e.g. before timing). The background thread only compiles: the compiled code is called once there in a *dry run* that
raises before the graph executes (:func:`_inductor_with_dry_run`), so it never touches the KV cache the eager steps
are writing. The compile thread runs at the lowest CPU priority (:data:`.compile_priority.COMPILE_NICE`, inherited by
the C++ compiler processes it starts), so the eager steps get the cores first. ``HF_DSINFER_CPU_COMPILE=sync``
compiles in the calling thread instead (the step waits).

If compiling fails the step falls back to eager torch for good, with one warning. ``InferenceConfig.cpu_compile=False``
(or ``HF_DSINFER_CPU_COMPILE=0``) keeps the eager path, which is also the reference the compiled one is tested against.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from hf_dsinfer.kernels.backend import get_backend
from hf_dsinfer.kernels.quant_cpu import lower_materialize

from ..log import logger
from ..modules import cpu_packed
from .compile_gate import GATE
from .compile_priority import compile_nice, leave_a_core, lower_priority
from .direct_call import DirectCall, capture, guards_mode
from .graph_runner import GraphRunner, StaticInput
from .thread_governor import ThreadGovernor, pinned_threads, team_threads

if TYPE_CHECKING:
    from .decode import DecodeStep

#: Process-wide switch: ``HF_DSINFER_CPU_COMPILE=0`` keeps every CPU decode step eager, whatever ``cpu_compile`` says
#: (read on every step, like ``HF_DSINFER_BACKEND``; the test suite sets it, compiling costs seconds per model);
#: ``sync`` compiles in the calling thread (the step waits) instead of in the background.
ENV_VAR = "HF_DSINFER_CPU_COMPILE"
_OFF = ("0", "false", "off", "no")
#: What the compile notice says about the wait (measured on SmolLM2-135M, 30 layers, on a 2-core machine: docs).
COMPILE_TIME = "tens of seconds to a few minutes the first time, less when torch's compile cache holds it"
#: ``cpu_compile="auto"``: a bucket starts compiling once its eager decode steps have taken this many seconds. The
#: ski-rental rule: keep paying the eager step until it has cost about what a compile costs (a warm compile of
#: SmolLM2 on 2 cores; docs/generation.md), so a short run never compiles and a long one pays at most about twice the
#: best choice made in hindsight.
AUTO_AFTER_S = 30.0

_DRY_RUN = threading.local()  # .on: the compiled code called by a background compile must not run (see below)
#: Background compiles still running. Interpreter shutdown ends daemon threads wherever they are: one inside Dynamo's
#: tracing (C++ calling back into Python) would abort the process when it next asks for the GIL, as a gloo thread did in
#: the TP example. So the process waits for them at exit (:func:`_join_background_compiles`), with one line saying why.
_BACKGROUND: set[threading.Thread] = set()
EXIT_WAIT_S = 600.0  # at most this long: a compile that is still running then is left to the interpreter


#: The eager steps run on one thread fewer (:func:`.compile_priority.leave_a_core`) while a background compile runs at
#: this nice value or below. 19: always. At nice 19 the compile yields its core to a step's second thread, but Python's
#: interpreter lock it holds while tracing still delays that step; with one thread fewer or not, loaded runs (SmolLM2, 2
#: cores, load 6-7, one run each) were as fast (0.82x and 1.08x the HF eager call beside each, medians): a quiet machine
#: decides (``hf-dsinfer bench --compile-pending --pending-variants default,nice-all-threads``). Since the compile is
#: parked during steps (:data:`PARK_COMPILE`), all threads would be free while it traces; tried (one thread fewer only
#: while it waits for the C++ compiler): steps of up to 1.3 s per token at a load of 2-3 from other jobs (an OpenMP team
#: of two on two busy cores), so the steps keep one thread fewer throughout.
LEAVE_A_CORE_AT_NICE = 19

#: Park a background compile's Python while a decode step runs, lending it a slice after each step
#: (:mod:`.compile_gate`). False only for ``hf-dsinfer bench --compile-pending``'s ``unparked`` variant.
PARK_COMPILE = True


def _join_background_compiles() -> None:
    running = [t for t in list(_BACKGROUND) if t.is_alive()]
    if not running:
        return
    logger.warning("hf_dsinfer: waiting for %d background compile(s) of the CPU decode step to finish before exiting "
                   "(set HF_DSINFER_CPU_COMPILE=0 or cpu_compile=False to never compile)", len(running))  # fmt: skip
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_join_background_compiles)


class CompileOnly(Exception):  # noqa: N818 - not an error: the signal of a dry run
    """Raised instead of running the graph when compiled code is called only to compile it (a dry run)."""


#: inductor settings of the compiled step. ``cpp.threads=1``: the generated C++ loops (norms, rotary, attention, the
#: decode GEMVs) run on one thread instead of opening an OpenMP parallel region of torch's thread count each. Every
#: region ends in a barrier, so with other processes on the cores a step of hundreds of regions stalled for whole
#: scheduler time slices: 0.4-0.8 tok/s against HF eager's 0.9-1.6 in the same run, and 2.0-2.9 with one-thread loops
#: (docs/generation.md has the runs). A second variant with a team of torch's thread count (``cpp.threads=N``) is
#: compiled after it, and a :class:`~.thread_governor.ThreadGovernor` picks between the two per step. Part of the
#: compile cache's key.
INDUCTOR_OPTIONS = {"cpp.threads": 1}


def inductor_options() -> dict[str, int]:
    """:data:`INDUCTOR_OPTIONS`, after checking :data:`~.thread_governor.COMPILE_THREADS_ENV` (a bad value is the
    caller's error, raised in the caller's thread before anything compiles)."""
    pinned_threads()
    return dict(INDUCTOR_OPTIONS)


def _inductor_with_dry_run(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> object:
    """torch.compile's backend: inductor's ``compile_fx`` (with ``options``, :data:`INDUCTOR_OPTIONS` by default), and
    a wrapper that raises :class:`CompileOnly` instead of running the graph while this thread is in a dry run. Dynamo
    has cached the guarded code by then, so the next call with the same guards runs the compiled graph without
    compiling."""
    from torch._inductor.compile_fx import compile_fx

    compiled = compile_fx(gm, example_inputs, config_patches=dict(options or INDUCTOR_OPTIONS))

    def run(*args: object) -> object:
        if getattr(_DRY_RUN, "on", False):
            raise CompileOnly
        return compiled(*args)

    if getattr(compiled, "_boxed_call", False):  # inductor's calling convention (one list argument), kept as is
        run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _has_collectives(runtime) -> bool:
    """True when a fused linear all-reduces (tensor parallelism): such steps stay eager."""
    return any(getattr(m, "reduce", None) is not None for m in runtime.layers.modules())


def _traced_step(
    step: DecodeStep, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """What gets compiled: the eager step attending ``slots.shape[0]`` cache slots (a dynamic size)."""
    return step.eager(input_ids, positions, attend_len=slots.shape[0])


class CompiledCPUDecode:
    """Runs a :class:`~.decode.DecodeStep` on CPU as one ``torch.compile``-d graph per batch bucket.

    Args:
        step: the eager decode step; its :meth:`~.decode.DecodeStep.eager` is what gets compiled.
        buckets: batch buckets (a batch above the largest one runs eagerly).
        tokens: new tokens per row: 1 for decode; ``1 + k`` for a speculative verification (logits of every token).
        auto: start a bucket's compile only after its eager steps took :data:`AUTO_AFTER_S` seconds
            (``cpu_compile="auto"``); otherwise on its first step. ``HF_DSINFER_CPU_COMPILE=sync`` compiles on the
            first step either way.
    """

    def __init__(self, step: DecodeStep, buckets: list[int], tokens: int = 1, auto: bool = False):
        self.step = step
        self.auto = auto
        self._eager_s: dict[int, float] = {}  # bucket -> seconds its eager steps took before its compile (auto)
        self.buckets = list(buckets)
        self.tokens = tokens
        self.runner: GraphRunner | None = None
        self.failed = _has_collectives(step.runtime)
        self._compiled = None  # the torch.compile wrapper (:meth:`_make_compiled`)
        self._make_lock = threading.Lock()
        self.compile_options = dict(INDUCTOR_OPTIONS)  # inductor settings of this step's compiles
        self._slots: torch.Tensor | None = None  # [S] arange: its slices carry the attended length as a shape
        self.compile_s: dict[int, float] = {}  # bucket -> seconds its compile took (present: it runs compiled)
        self.eager_while_compiling = 0  # steps run eagerly because their bucket was still compiling
        self._pending: dict[int, threading.Thread] = {}  # bucket -> its background compile
        self._nice = 0  # the nice value of the last background compile started
        self.governors: dict[int, ThreadGovernor] = {}  # bucket -> the thread count its compiled steps run on
        self._teams: dict[int, object] = {}  # team size -> the torch.compile wrapper of loops on that many threads
        self.team_compile_s: dict[tuple[int, int], float] = {}  # (bucket, team) -> seconds its compile took
        self._team_failed = False  # a team variant failed to compile: one-thread loops only from then on
        self._team_pending: dict[tuple[int, int], threading.Thread] = {}  # background team compiles
        self._variant = 1  # the variant the runner's next call runs (1, or a team size)
        # Inside loop(): (bucket, variant, packed switch) -> its entry called without the object guards (None: that
        # key stays guarded this loop); None outside a loop (every call guarded).
        self._direct: dict[tuple, DirectCall | None] | None = None
        self.direct_steps = 0  # steps run through a DirectCall (tests and benchmarks read it)

    def applies(self, input_ids: torch.Tensor) -> bool:
        """Whether this call runs compiled: CPU, torch kernels, not switched off, compiling has not failed."""
        return (
            not self.failed
            and input_ids.device.type == "cpu"
            and get_backend() != "triton"
            and os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF
        )

    @property
    def pending(self) -> bool:
        """Whether a background compile (of a bucket, or of a bucket's team variant) is running."""
        return any(t.is_alive() for t in [*self._pending.values(), *self._team_pending.values()])

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compiles started so far; returns False if one is still running at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in [*self._pending.values(), *self._team_pending.values()]:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.pending

    def _slots_for(self, length: int) -> torch.Tensor:
        """``[length]`` slice of a fixed arange, its length marked dynamic (the attended cache slots)."""
        cache = self.step.cache
        if self._slots is None or self._slots.shape[0] != cache.max_tokens:
            self._slots = torch.arange(cache.max_tokens)
        slots = self._slots[:length]
        # maybe_: a length equal to the whole cache may still specialize (a full-buffer slice is contiguous).
        torch._dynamo.maybe_mark_dynamic(slots, 0)
        return slots

    def _bucketed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The runner's step: ``input_ids``/``positions [bucket, tokens]`` (views of its static buffers)."""
        length = self.step.cache.padded_len + self.tokens  # no row holds more after this step (rows stored compactly)
        slots = self._slots_for(length)
        bucket = input_ids.shape[0]
        self.step.start_offsets(bucket, input_ids.device)  # allocate outside the graph (no guard on a first call)
        if bucket in self.compile_s:
            compiled = self._teams[self._variant] if self._variant > 1 else self._compiled
            if self._direct is None:
                return compiled(input_ids, positions, slots)
            key = (bucket, self._variant, cpu_packed.enabled())
            direct = self._direct.get(key)
            if direct is not None:
                out = direct(self.step, input_ids, positions, slots)
                if out is not None:
                    self.direct_steps += 1
                    return out
            out = compiled(input_ids, positions, slots)
            if key not in self._direct:
                self._direct[key] = capture(compiled, (self.step, input_ids, positions, slots))
            return out
        self._notice(bucket, background=False)
        t0 = time.perf_counter()
        self._make_compiled()
        with warnings.catch_warnings():
            _quiet_lru_cache_warning()
            out = self._compiled(input_ids, positions, slots)
        self._done(bucket, time.perf_counter() - t0)
        return out

    @property
    def _what(self) -> str:
        return "decode step" if self.tokens == 1 else f"verification step of {self.tokens} tokens"

    def _notice(self, bucket: int, background: bool) -> None:
        """The one line a user sees when a compile starts (warning level: transformers' default verbosity shows it)."""
        how = " in the background; decoding runs eagerly meanwhile" if background else "; this step waits for it"
        logger.warning(
            "hf_dsinfer: compiling the CPU %s for batch %d with torch.compile%s (%s; it makes decoding faster and "
            "is reused by later calls). inference_config={'cpu_compile': False} skips it.",
            self._what, bucket, how, COMPILE_TIME,
        )  # fmt: skip

    def _done(self, bucket: int, seconds: float) -> None:
        self.compile_s[bucket] = seconds  # published last: the next step of this bucket runs compiled
        logger.info("hf_dsinfer: compiled the CPU %s for batch %d in %.1f s", self._what, bucket, seconds)

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """The scope of one decoding loop: after the first guarded step of each bucket, its later steps call the
        compiled entry without dynamo's object guards (:mod:`.direct_call`; ``HF_DSINFER_CPU_GUARDS=every`` turns
        this off). Nested scopes share the outermost one."""
        if self._direct is not None or guards_mode() == "every":
            yield
            return
        self._direct = {}
        try:
            yield
        finally:
            self._direct = None

    def _ensure_runner(self) -> GraphRunner:
        if self.runner is None:
            self.compile_options = inductor_options()  # read here, in the caller's thread (its torch thread count)
            cpu_packed.prepare(self.step.model)  # slots for the packed GEMMs the graph may call (buckets >= 4)
            row = (self.tokens,)
            inputs = {"input_ids": StaticInput(row, torch.long, 0), "positions": StaticInput(row, torch.long, 0)}
            name = "decode" if self.tokens == 1 else f"verify{self.tokens}"
            self.runner = GraphRunner(self._bucketed, inputs, self.buckets, "cpu", use_graphs=False, name=name)
        return self.runner

    def _make_compiled(self) -> None:
        """Create the ``torch.compile`` wrapper (once). Its first creation imports dynamo and inductor (0.2-0.3 s on
        the 2-core machine): a background compile does it in its own thread, parked like the rest of its Python."""
        with self._make_lock:
            if self._compiled is not None:
                return
            # A private copy of the traced function per model: dynamo caches compiled variants (and counts them
            # against its recompile limit) per code object, so models must not share one.
            # The decode GEMVs' activation barriers (120 in SmolLM2's step) become buffers of the generated code
            # instead of calls back into Python (kernels/quant_cpu.lower_materialize).
            lower_materialize()
            self._compiled = self._wrapper(self.compile_options)

    def _wrapper(self, options: dict) -> object:
        """A ``torch.compile`` wrapper of the step with these inductor settings, on its own copy of the function
        (dynamo caches compiled variants per code object)."""
        traced = types.FunctionType(_traced_step.__code__.replace(), _traced_step.__globals__, "decode_step")
        backend = functools.partial(_inductor_with_dry_run, options=options)
        return torch.compile(types.MethodType(traced, self.step), backend=backend, fullgraph=True, dynamic=False)

    @staticmethod
    def _dry_compile(compiled: object, args: tuple) -> None:
        """Compile ``compiled`` for ``args`` in this thread without running the graph (the backend raises
        :class:`CompileOnly` before it would); a compiler error propagates."""
        was = getattr(_DRY_RUN, "on", False)
        _DRY_RUN.on = True
        try:
            with warnings.catch_warnings():
                _quiet_lru_cache_warning()
                compiled(*args)
        except CompileOnly:
            return
        finally:
            _DRY_RUN.on = was
        raise RuntimeError("the compiled step ran during a dry run")  # the backend must have raised CompileOnly

    def _in_background(self, work: Callable[[], None], name: str, nice: int) -> threading.Thread:
        """Run ``work`` in a daemon thread at nice ``nice``, parked while decode steps run, under the caller's grad
        mode (per thread and guarded: compile under the caller's); started and returned."""
        grad = torch.is_grad_enabled()

        def run() -> None:
            lower_priority(nice)
            try:
                parked = GATE.compiling() if PARK_COMPILE else contextlib.nullcontext()
                with parked, torch.set_grad_enabled(grad):
                    work()
            finally:
                _BACKGROUND.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        _BACKGROUND.add(thread)
        thread.start()
        return thread

    def _compile_team(self, bucket: int, team: int, args: tuple) -> None:
        """Compile ``bucket``'s variant with loops on ``team`` threads by a dry run in this thread (after its one-thread
        variant); a failure leaves every bucket on one-thread loops, with one warning."""
        if self._team_failed or (bucket, team) in self.team_compile_s:
            return
        t0 = time.perf_counter()
        try:
            with self._make_lock:
                if team not in self._teams:
                    self._teams[team] = self._wrapper({**self.compile_options, "cpp.threads": team})
            self._dry_compile(self._teams[team], args)
        except Exception as e:  # noqa: BLE001 - the one-thread variant computes the same step
            self._team_failed = True
            logger.warning("hf_dsinfer: compiling the %d-thread variant of the CPU %s failed (%s: %s); its steps run "
                           "on one thread", team, self._what, type(e).__name__,
                           str(e).splitlines()[0][:200] if str(e) else "")  # fmt: skip
            return
        self.team_compile_s[(bucket, team)] = time.perf_counter() - t0  # published last: the variant can run
        logger.info("hf_dsinfer: compiled the %d-thread variant of the CPU %s for batch %d in %.1f s", team,
                    self._what, bucket, self.team_compile_s[(bucket, team)])  # fmt: skip

    def _dry_args(self, bucket: int) -> tuple:
        """The arguments a compiled call of ``bucket`` gets: views of the runner's static buffers (metadata only) and
        an attended length of at least 2 (0 and 1 would specialize)."""
        views = self._ensure_runner()._views(bucket)
        length = min(max(self.step.cache.padded_len + self.tokens, 2), self.step.cache.max_tokens)
        self.step.start_offsets(bucket, views["input_ids"].device)  # allocated here, not under the eager steps
        return views["input_ids"], views["positions"], self._slots_for(length)

    def _team_for(self, bucket: int) -> int | None:
        """The team size a step of ``bucket`` may run on now (None: one-thread loops only). A team variant not yet
        compiled is compiled here (synchronous compiles) or started in the background."""
        team = team_threads()
        key = (bucket, team)
        if team <= 1 or self._team_failed:
            return None
        if key in self.team_compile_s:
            return team
        if os.environ.get(ENV_VAR, "1").strip().lower() == "sync":
            self._compile_team(bucket, team, self._dry_args(bucket))
            return team if key in self.team_compile_s else None
        if key not in self._team_pending and not self.pending:  # one background compile at a time
            args = self._dry_args(bucket)
            self._team_pending[key] = self._in_background(lambda: self._compile_team(bucket, team, args),
                                                          f"hf_dsinfer-compile-{bucket}x{team}", compile_nice())
        return None

    def _start_background(self, bucket: int) -> None:
        """Compile ``bucket`` in a daemon thread (once); the caller runs this step eagerly."""
        if bucket in self._pending:
            return
        args = self._dry_args(bucket)
        nice = self._nice = compile_nice()  # read here: a bad value is the caller's error, not a failed compile
        self._notice(bucket, background=True)
        self._pending[bucket] = self._in_background(lambda: self._compile_base(bucket, args),
                                                    f"hf_dsinfer-compile-{bucket}", nice)

    def _compile_base(self, bucket: int, args: tuple) -> None:
        """The background compile of ``bucket``'s one-thread variant; a failure sends every step to eager torch."""
        t0 = time.perf_counter()
        try:
            self._make_compiled()
            self._dry_compile(self._compiled, args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: the eager step computes the same
            self._fail(e)
            return
        self._done(bucket, time.perf_counter() - t0)

    def _eager_until_it_pays(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``cpu_compile="auto"``: an eager step, timed; the bucket's compile starts once they add up to
        :data:`AUTO_AFTER_S`."""
        t0 = time.perf_counter()
        out = self.step.eager(input_ids, positions)
        spent = self._eager_s[bucket] = self._eager_s.get(bucket, 0.0) + time.perf_counter() - t0
        if spent >= AUTO_AFTER_S:
            self._start_background(bucket)
        return out

    def _fail(self, e: BaseException) -> None:
        self.failed = True
        logger.warning(
            "hf_dsinfer: compiling the CPU %s failed (%s: %s); running it with eager torch instead "
            "(set cpu_compile=False in the inference config to skip the attempt).",
            self._what,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]``, ``positions [B, T]`` (``T = tokens``) -> fp32 logits ``[B, V]`` (decode) or
        ``[B, T, V]`` (verification); eager above the largest bucket and while the bucket compiles in the
        background. While any background compile runs, the step runs with it parked (:mod:`.compile_gate`)."""
        with GATE.step():
            return self._step(input_ids, positions)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        runner = self._ensure_runner()
        cpu_packed.sync()  # HF_DSINFER_CPU_PACKED -> the switch the graph reads (a change recompiles the bucket)
        batch = input_ids.shape[0]
        bucket = runner.bucket_for(batch)
        if bucket is None or bucket > self.step.cache.allocated_rows:
            return self.step.eager(input_ids, positions)
        if bucket not in self.compile_s:
            if os.environ.get(ENV_VAR, "1").strip().lower() != "sync":
                if self.auto and bucket not in self._pending:
                    return self._eager_until_it_pays(bucket, input_ids, positions)
                self._start_background(bucket)
                self.eager_while_compiling += 1
                with leave_a_core() if self._nice <= LEAVE_A_CORE_AT_NICE else contextlib.nullcontext():
                    return self.step.eager(input_ids, positions)
            if bucket in self._pending:  # switched to sync while a background compile runs: wait for it
                self._pending[bucket].join()
                if self.failed:
                    return self.step.eager(input_ids, positions)
        try:
            team = self._team_for(bucket) if bucket in self.compile_s else None
            with self.governors.setdefault(bucket, ThreadGovernor()).step(team) as self._variant:
                return runner(input_ids=input_ids, positions=positions)
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager torch computes the same step
            if bucket in self.compile_s:
                raise  # a bucket that already ran compiled: a real error, not a compiler failure
            self._fail(e)
            return self.step.eager(input_ids, positions)


def _quiet_lru_cache_warning() -> None:
    # The kernels' backend switch is an lru_cache of a pure function of the environment variable (checked outside
    # the graph by applies()), so dynamo tracing through the cache is exact.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
