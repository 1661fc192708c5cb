"""What the server shows operators: GET /health's JSON and GET /metrics (Prometheus text format).

Both read the scheduler's figures at the moment they are asked (slots in use, the waiting list, KV
pages free and reserved, the oldest request's age), so a stall shows from outside: requests
waiting, no slot in use and an oldest age that keeps growing. /metrics adds what the HTTP layer
sees: requests by route and status, and latency histograms per route (the whole response, and
the time to the first token or prompt score). Each `ServeMetrics` has its own registry, never
prometheus_client's global one, so several servers in one process keep apart.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

# Routes get their own label; any other path counts as "other" (a client cannot grow the label set).
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("length", "stop", "cancelled", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def route_label(path: str) -> str:
  return path if path in ROUTES else "other"


def health(load: dict[str, Any]) -> dict[str, Any]:
  """/health's body from Scheduler.load()."""
  return {"status": "ok", "slots_total": load["slots"], "slots_in_use": load["active"],
          "queue_length": load["waiting"], "pages_total": load["pages_total"], "pages_free": load["pages_free"],
          "pages_cached": load["pages_cached"],
          "pages_reserved": load["pages_reserved"], "oldest_request_age_seconds": round(load["oldest_age_s"], 3),
          **speculative(load)}


def speculative(load: dict[str, Any]) -> dict[str, Any]:
  """Speculative decoding's figures: k (0 = off), draft tokens proposed to running requests and
  accepted by the target, and their ratio (0 before any round)."""
  proposed, accepted = int(load.get("speculative_proposed", 0)), int(load.get("speculative_accepted", 0))
  return {"speculative_tokens": int(load.get("speculative_tokens", 0)), "speculative_proposed_tokens": proposed,
          "speculative_accepted_tokens": accepted,
          "speculative_acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0}


class _SchedulerCollector(Collector):
  """Gauges and counters read from the scheduler at scrape time."""

  def __init__(self, load: Callable[[], dict[str, Any]]):
    self.load = load

  def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    now = self.load()
    for name, key, text in (
        ("slots_total", "slots", "decode slots (serve_max_slots)"),
        ("slots_in_use", "active", "slots decoding a request now"),
        ("queue_length", "waiting", "requests waiting for a slot or KV pages"),
        ("kv_pages_total", "pages_total", "KV cache pages in the pool (0: the dense cache)"),
        ("kv_pages_free", "pages_free", "KV cache pages not holding any token"),
        ("kv_pages_cached", "pages_cached", "free KV cache pages still holding a cached prompt prefix (prefix caching)"),
        ("kv_pages_reserved", "pages_reserved", "KV cache pages the active requests will hold at their end"),
        ("oldest_request_age_seconds", "oldest_age_s", "age of the oldest request waiting or decoding (0: none)")):
      yield GaugeMetricFamily(f"maxtext_serve_{name}", text, value=float(now[key]))
    yield CounterMetricFamily("maxtext_serve_engine_steps", "generate steps (speculative rounds) over all slots",
                              value=float(now.get("steps", 0)))
    spec = speculative(now)
    yield GaugeMetricFamily("maxtext_serve_speculative_tokens", "draft tokens proposed per slot and round "
                            "(speculative_tokens; 0: speculative decoding off)", value=float(spec["speculative_tokens"]))
    yield CounterMetricFamily("maxtext_serve_speculative_proposed_tokens", "draft tokens proposed to running requests",
                              value=float(spec["speculative_proposed_tokens"]))
    yield CounterMetricFamily("maxtext_serve_speculative_accepted_tokens", "draft tokens the target accepted",
                              value=float(spec["speculative_accepted_tokens"]))
    yield GaugeMetricFamily("maxtext_serve_speculative_acceptance_rate", "accepted / proposed draft tokens since start "
                            "(0 before any round)", value=float(spec["speculative_acceptance_rate"]))
    finished = CounterMetricFamily("maxtext_serve_completions_finished", "completions (choices) ended, by reason",
                                   labels=["reason"])
    for reason in FINISH_REASONS:
      finished.add_metric([reason], float(now.get(reason, 0)))
    yield finished


# One HTTP-side observation, as front ends share them: ("request", route, status, seconds) or
# ("first_token", route, "", seconds).
Observation = tuple[str, str, str, float]


class ServeMetrics:
  """One server's registry: the scheduler's figures plus request counts and latencies. `share`, where
  given, also gets each observation made here (an HTTP front end sends them to the others, which
  `apply` them, so each front end's counts are the whole server's)."""

  def __init__(self, load: Callable[[], dict[str, Any]], share: Callable[[Observation], None] | None = None):
    self.load = load
    self.share = share
    self.registry = CollectorRegistry()
    self.registry.register(_SchedulerCollector(load))
    self.requests = Counter("maxtext_serve_requests", "HTTP requests answered, by route and status code",
                            ["route", "status"], registry=self.registry)
    self.latency = Histogram("maxtext_serve_request_seconds", "from a request's arrival to its response's end",
                             ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
    self.first_token = Histogram("maxtext_serve_time_to_first_token_seconds",
                                 "from a generation request's submission to its first token or prompt score",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)

  def health(self) -> dict[str, Any]:
    return health(self.load())

  def exposition(self) -> bytes:
    return generate_latest(self.registry)

  def observe_request(self, path: str, status: str, seconds: float) -> None:
    self._observe(("request", route_label(path), status, seconds))

  def observe_first_token(self, path: str, since: float) -> None:
    self._observe(("first_token", route_label(path), "", time.monotonic() - since))

  def _observe(self, observation: Observation) -> None:
    self.apply([observation])
    if self.share is not None:
      self.share(observation)

  def apply(self, observations: list[Observation]) -> None:
    """Counts observations (made here or shared by another front end)."""
    for kind, route, status, seconds in observations:
      if kind == "request":
        self.requests.labels(route, status).inc()
        self.latency.labels(route).observe(seconds)
      elif kind == "first_token":
        self.first_token.labels(route).observe(seconds)
      else:
        raise ValueError(f"unknown metrics observation {kind!r}")
