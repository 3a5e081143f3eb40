"""``GET /metrics`` of ``hf-dsinfer serve``: Prometheus metrics with vLLM's names under the ``hf_dsinfer:`` prefix.

Three sources, so that a scrape never waits on the engine:

* gauges (running / waiting requests, KV-cache usage) are read from the engine when Prometheus scrapes;
* counters (prompt and generated tokens, prefix-cache queries and hits, preemptions) are the engine's own
  :class:`~hf_dsinfer.serving.engine.ServingStats`, also read at scrape time (they count since the engine was built);
* histograms (TTFT, inter-token latency, end-to-end latency, queue time, tokens per request) and the finished-request
  counter are fed by :attr:`ServingEngine.finish_listeners`, once per request when it finishes, from the handle's
  timestamps (``created_time``, ``scheduled_time``, ``first_token_time``, ``timestamps``, ``finished_time``).

Each :class:`ServerMetrics` has its own ``CollectorRegistry`` (not prometheus_client's global one), so a process may
build several servers (tests do). Bucket boundaries are vLLM's, so its Grafana dashboards read these histograms as
they read vLLM's once the prefix is changed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

__all__ = ["FINISHED_REASONS", "METRICS_INSTALL_HINT", "ServerMetrics"]

METRICS_INSTALL_HINT = 'pip install -e ".[serve]" (prometheus-client)'

PREFIX = "hf_dsinfer:"
#: ``finished_reason`` label values (vLLM's): an engine handle's "cancelled" is vLLM's "abort", unless the HTTP layer
#: cancelled it at a stop string (``handle.stop_reason`` set to the string first): that is "stop".
FINISHED_REASONS = ("stop", "length", "abort", "error")
_REASON_LABEL = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip

#: ServingStats fields exported as counters when the engine has them (speculative decoding: None unless it speculates).
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}


def _one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return [float(v) for v in out]
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Gauges and engine counters, computed at each scrape (a custom prometheus_client collector)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self) -> list:
        return []  # unchecked collector: its families are created at collect time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.metrics
        label = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> Any:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        running, waiting = m.request_counts()
        yield gauge("num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_cache_usage())
        stats = m.engine.stats
        yield counter("prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", stats.generated_tokens)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prompt_tokens)  # fmt: skip
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_hit_tokens)  # fmt: skip
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions)
        if m.rejections is not None:  # the server's gate: requests refused before reaching the engine
            family = CounterMetricFamily(PREFIX + "admission_rejections", "Requests refused at admission, by reason.",
                                         labels=["model_name", "reason"])  # fmt: skip
            for reason, count in m.rejections.items():
                family.add_metric([m.model_name, reason], count)
            yield family
        for name, doc in SPEC_DECODE_COUNTERS.items():
            value = getattr(stats, name, None)
            if value is not None:  # only an engine that speculates reports these
                yield counter(name, doc, value)


class ServerMetrics:
    """The Prometheus metrics of one server over ``engine`` (``registry``: its own ``CollectorRegistry``).

    Args:
        engine: the :class:`~hf_dsinfer.serving.ServingEngine`; a finish listener is added to it.
        model_name: the ``model_name`` label (the served model name).
        max_model_len: the context length (upper bucket of the tokens-per-request histograms).
    """

    def __init__(self, engine: Any, model_name: str, max_model_len: int):
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError as e:
            raise ImportError(f"hf-dsinfer serve's /metrics needs prometheus_client: {METRICS_INSTALL_HINT}") from e
        self.engine, self.model_name = engine, model_name
        #: the server gate's refusal counts by reason (``Gate.rejected``, set by the server once its gate is built)
        self.rejections: dict[str, int] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(self))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.queue = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS)  # fmt: skip
        token_buckets = _one_two_five(max(1, int(max_model_len)))
        self.prompt_len = histogram("request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.gen_len = histogram("request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=self.registry)  # fmt: skip
        self.success = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._finished = 0  # requests finished since this object was built (any reason)
        self._submitted0 = engine.stats.requests_submitted  # requests submitted before: taken as finished
        engine.finish_listeners.append(self.on_finish)

    # -- the engine's side (stepping thread) ---------------------------------------------------------------------

    def on_finish(self, handle: Any) -> None:
        """Finish listener: record one request's latencies, token counts and finish reason."""
        self._finished += 1
        reason = _REASON_LABEL.get(handle.finish_reason or "", "error")
        if reason == "abort" and isinstance(getattr(handle, "stop_reason", None), str):
            reason = "stop"  # the HTTP layer cut the text at a stop string, then cancelled the engine request
        self.success[reason].inc()
        end = handle.finished_time if handle.finished_time is not None else time.perf_counter()
        self.e2e.observe(max(0.0, end - handle.created_time))
        if handle.scheduled_time is not None:
            self.queue.observe(max(0.0, handle.scheduled_time - handle.created_time))
        if handle.first_token_time is not None:
            self.ttft.observe(max(0.0, handle.first_token_time - handle.created_time))
        stamps = handle.timestamps
        for before, after in zip(stamps, stamps[1:]):
            self.itl.observe(max(0.0, after - before))
        if handle.scheduled_time is not None:  # admitted: its prompt was processed
            self.prompt_len.observe(len(handle.prompt_ids))
            self.gen_len.observe(len(handle.tokens))

    # -- read at scrape time -------------------------------------------------------------------------------------

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) engine requests: waiting counts every unfinished request not in a running batch."""
        running = len(self.engine.scheduler.running)
        unfinished = self.engine.stats.requests_submitted - self._submitted0 - self._finished
        return running, max(0, unfinished - running)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (blocks kept only for prefix reuse count as free, as vLLM's)."""
        blocks = self.engine.runner.blocks
        return 1.0 - blocks.num_available / blocks.num_blocks

    def render(self) -> tuple[bytes, str]:
        """The text exposition: (body, content type)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
