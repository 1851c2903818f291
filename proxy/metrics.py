"""Prometheus metrics, one registry per app, low-cardinality labels only."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from storage.writer import WriterObserver

# Seconds. Overhead is sub-millisecond when all is well; durations reach minutes for
# long generations.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300)
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
OTHER = "other"


class Metrics(WriterObserver):
    def __init__(self, max_models: int = 16):
        self.registry = r = CollectorRegistry()
        self.max_models = max_models
        self._models: set[str] = set()
        self._children: dict[tuple, object] = {}
        self.requests = Counter("tracetap_requests_total", "Requests answered, by route and status",
                                ["route", "code"], registry=r)
        self.duration = Histogram("tracetap_request_duration_seconds",
                                  "End-to-end request duration as the client sees it",
                                  ["route", "stream"], buckets=DURATION_BUCKETS, registry=r)
        self.upstream = Histogram("tracetap_upstream_duration_seconds",
                                  "Time from sending upstream to the last upstream byte",
                                  ["route"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram("tracetap_time_to_first_token_seconds",
                              "Streams: request start to the first content byte relayed",
                              ["route"], buckets=DURATION_BUCKETS, registry=r)
        self.overhead = Histogram("tracetap_overhead_seconds",
                                  "Proxy's own time: end-to-end minus upstream",
                                  ["route", "stream"], buckets=OVERHEAD_BUCKETS, registry=r)
        self.tokens = Counter("tracetap_tokens_total", "Tokens seen, by type and model",
                              ["type", "model"], registry=r)
        self.inflight = Gauge("tracetap_inflight_requests", "Requests being proxied now",
                              registry=r)
        self.queue_depth = Gauge("tracetap_capture_queue_depth",
                                 "Captured records not yet committed to the database", registry=r)
        self.journal_bytes = Gauge("tracetap_journal_bytes", "Bytes in the on-disk journal",
                                   registry=r)
        self.records_total = Counter("tracetap_records_total",
                                     "Call records by outcome: written, spilled, replayed, dropped",
                                     ["outcome"], registry=r)
        self.db_write_seconds = Histogram("tracetap_db_write_duration_seconds",
                                  "Time to commit one batch of records", buckets=DB_BUCKETS,
                                  registry=r)
        self.db_batch = Histogram("tracetap_db_batch_size", "Records per committed batch",
                                  buckets=BATCH_BUCKETS, registry=r)
        self.logprobs_missing = Counter("tracetap_logprobs_missing_total",
                                        "Choices stored without usable logprobs", registry=r)
        self.token_ids_missing = Counter("tracetap_token_ids_missing_total",
                                         "Prompts and completions stored without token ids "
                                         "(left out of trajectories), by reason", ["reason"],
                                         registry=r)
        self.history_repairs = Counter("tracetap_history_repairs_total",
                                       "Resent assistant turns replaced by the model's own "
                                       "(--repair-history), by what the harness changed",
                                       ["cause"], registry=r)
        # Agent traffic the proxy refused (the agent is untrusted: count every attempt).
        self.refused = Counter("tracetap_agent_refused_total",
                               "Agent requests refused and never forwarded, by reason",
                               ["reason"], registry=r)
        self.budget_exceeded = Counter("tracetap_episode_budget_exceeded_total",
                                       "Model calls refused because the episode spent a "
                                       "budget, by limit", ["limit"], registry=r)
        for outcome in ("written", "spilled", "replayed", "dropped"):
            self.records_total.labels(outcome)

    def model(self, name: str | None) -> str:
        """A bounded label: the first ``max_models`` names, then everything is "other"."""
        if not name:
            return OTHER
        if name in self._models:
            return name
        if len(self._models) < self.max_models:
            self._models.add(name)
            return name
        return OTHER

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once: labels are few and fixed, and
        prometheus_client's own lookup takes a lock and revalidates on every call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def repaired(self, cause: str) -> None:
        self.child(self.history_repairs, cause).inc()

    def ids_missing(self, reason: str) -> None:
        self.child(self.token_ids_missing, reason).inc()

    # WriterObserver
    def records(self, outcome: str, count: int) -> None:
        self.records_total.labels(outcome).inc(count)

    def db_write(self, seconds: float, count: int) -> None:
        self.db_write_seconds.observe(seconds)
        self.db_batch.observe(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
