"""Prometheus metrics of the OpenAI server (``GET /metrics``).

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ...) with the ``memra:``
prefix, so dashboards built for vLLM need only the prefix changed:

Per request, observed by the server (histograms in seconds):

* ``memra:time_to_first_token_seconds``: arrival at the server to the first generated token;
* ``memra:time_per_output_token_seconds``: per completion, (finish - first token) /
  (output tokens - 1): the mean decode time per token after the first (TPOT);
* ``memra:inter_token_latency_seconds``: gap between successive token-bearing engine
  events of a completion (ITL, what a streaming client sees);
* ``memra:e2e_request_latency_seconds``: arrival to the last completion's end;
* ``memra:request_finished_total{finished_reason}``: completions by outcome
  (``stop``, ``length``, ``abort`` (client left or engine aborted), ``error``).

From the engine's :meth:`AsyncLLMEngine.stats` at scrape time (a custom collector, so
they are always current and never drift from the engine's own bookkeeping):

* gauges ``memra:num_requests_running``, ``memra:num_requests_waiting``,
  ``memra:kv_cache_blocks_used``, ``memra:kv_cache_blocks_total``,
  ``memra:kv_cache_usage_perc`` (fraction in [0, 1], as vLLM's);
* counters ``memra:prefix_cache_queries_total`` / ``memra:prefix_cache_hits_total``
  (prompt tokens looked up / found), ``memra:prompt_tokens_total`` (received),
  ``memra:prompt_tokens_computed_total`` (actually prefilled),
  ``memra:generation_tokens_total``, ``memra:num_preemptions_total``.

Each :class:`ServerMetrics` has its own ``CollectorRegistry`` (never the global one), so
several apps can live in one process (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "RequestTracker", "FINISHED_REASONS", "CONTENT_TYPE"]

#: ``Content-Type`` of the Prometheus text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FINISHED_REASONS = ("stop", "length", "abort", "error")

# Buckets as vLLM's, covering CPU (slow) to GPU (fast) latencies.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Reads ``stats()`` (an object with EngineStats' fields) at every scrape."""

    def __init__(self, stats: Callable[[], Any], model_name: str):
        self._stats = stats
        self._labels = {"model_name": model_name}

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        names = list(self._labels)
        values = list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        total = s.kv_blocks_total
        yield gauge("memra:num_requests_running", "Requests being stepped by the engine.", s.num_running)
        yield gauge("memra:num_requests_waiting", "Requests queued for their first (or next, if preempted) "
                    "schedule.", s.num_waiting)
        yield gauge("memra:kv_cache_blocks_used", "KV-cache blocks in use.", s.kv_blocks_used)
        yield gauge("memra:kv_cache_blocks_total", "KV-cache blocks in the pool.", total)
        yield gauge("memra:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    s.kv_blocks_used / total if total else 0.0)
        yield counter("memra:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("memra:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("memra:prompt_tokens", "Prompt tokens received.", s.num_prompt_tokens)
        yield counter("memra:prompt_tokens_computed", "Prompt tokens prefilled (not served by the prefix "
                      "cache; recomputed after preemption counted again).", s.num_prompt_tokens_computed)
        yield counter("memra:generation_tokens", "Tokens generated.", s.num_generation_tokens)
        yield counter("memra:num_preemptions", "Requests preempted (KV blocks taken back).", s.num_preemptions)
        drafted, accepted = getattr(s, "spec_draft_tokens", ()), getattr(s, "spec_accepted_tokens", ())
        if drafted:  # speculative decoding on
            yield counter("memra:spec_decode_num_draft_tokens", "Draft tokens verified.", sum(drafted))
            yield counter("memra:spec_decode_num_accepted_tokens", "Draft tokens accepted.", sum(accepted))
            c = CounterMetricFamily("memra:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                    "draft position (0 = first); with ..._draft_tokens_per_pos the acceptance rate.",
                                    labels=names + ["position"])
            d = CounterMetricFamily("memra:spec_decode_num_draft_tokens_per_pos", "Draft tokens verified, by draft "
                                    "position.", labels=names + ["position"])
            for j, (n_d, n_a) in enumerate(zip(drafted, accepted)):
                c.add_metric(values + [str(j)], n_a)
                d.add_metric(values + [str(j)], n_d)
            yield c
            yield d


class ServerMetrics:
    """The server's Prometheus registry: request histograms + engine gauges/counters.

    Args:
        stats: zero-argument callable returning the engine's ``EngineStats``.
        model_name: value of the ``model_name`` label on every metric.
    """

    def __init__(self, stats: Callable[[], Any], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self._model = model_name
        self.ttft = Histogram("memra:time_to_first_token_seconds", "Time to first token (server arrival to the "
                              "first generated token).", labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("memra:time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per completion.", labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.itl = Histogram("memra:inter_token_latency_seconds", "Gap between successive token-bearing "
                             "events of a completion.", labels, buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("memra:e2e_request_latency_seconds", "Arrival to finish of a request.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("memra:request_finished", "Completions finished, by finished_reason "
                                "(stop, length, abort, error).", labels + ["finished_reason"],
                                registry=self.registry)
        for reason in FINISHED_REASONS:  # export zeros so rates work from the first scrape
            self.finished.labels(model_name, reason)
        self.registry.register(_EngineStatsCollector(stats, model_name))

    def tracker(self, n: int, arrival: float | None = None) -> RequestTracker:
        """A :class:`RequestTracker` for one engine request with ``n`` completions."""
        return RequestTracker(self, n, time.monotonic() if arrival is None else arrival)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class RequestTracker:
    """Times one engine request (``n`` completions) from its events.

    Call :meth:`on_event` with each ``RequestEvent`` as it arrives and :meth:`close` once
    at the end (``error=True`` if it ended by an exception); completions not finished by
    then count as ``abort`` (or ``error``). Idempotent close.
    """

    def __init__(self, metrics: ServerMetrics, n: int, arrival: float):
        self._m = metrics
        self._arrival = arrival
        self._first: float | None = None
        self._last = [None] * n  # time of each completion's latest token
        self._first_of = [None] * n
        self._tokens = [0] * n
        self._done = [False] * n
        self._closed = False

    def on_event(self, event: Any, now: float | None = None) -> None:
        """Record one engine event (``RequestEvent``) received at ``now`` (monotonic s)."""
        now = time.monotonic() if now is None else now
        m, label = self._m, self._m._model
        for d in event.deltas:
            i = d.index
            if i >= len(self._done) or self._done[i]:
                continue
            if d.token_ids:
                if self._first is None:
                    self._first = now
                    m.ttft.labels(label).observe(now - self._arrival)
                if self._last[i] is not None:
                    m.itl.labels(label).observe(now - self._last[i])
                if self._first_of[i] is None:
                    self._first_of[i] = now
                self._last[i] = now
                self._tokens[i] += len(d.token_ids)
            if d.finish_reason is not None:
                self._finish(i, d.finish_reason, now)

    def _finish(self, i: int, reason: str, now: float) -> None:
        m, label = self._m, self._m._model
        self._done[i] = True
        if reason not in FINISHED_REASONS:
            reason = "stop"
        m.finished.labels(label, reason).inc()
        if self._tokens[i] > 1 and self._first_of[i] is not None:
            m.tpot.labels(label).observe((self._last[i] - self._first_of[i]) / (self._tokens[i] - 1))

    def close(self, error: bool = False) -> None:
        """End the request: unfinished completions count as ``abort`` (``error`` if ``error``)."""
        if self._closed:
            return
        self._closed = True
        now = time.monotonic()
        for i, done in enumerate(self._done):
            if not done:
                self._finish(i, "error" if error else "abort", now)
        self._m.e2e.labels(self._m._model).observe(now - self._arrival)
