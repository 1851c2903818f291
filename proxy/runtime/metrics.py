"""Prometheus metrics, one registry per app, low-cardinality labels only.

With ``serve --workers N`` each worker writes its values to prometheus_client's
multiprocess directory and any worker's /metrics reads them all: counters, histograms and
summaries are summed over the workers (those of a worker that was restarted included);
each gauge says how it combines in its ``multiprocess_mode`` (``livesum``: summed over
the running workers; ``livemax``/``livemin``; ``min``; ``liveall``: one series per pid).

The families that grade episodes (OUTCOMES: rewards, integrity verdicts) are rendered
only for the admin (``GET /tracetap/metrics``): ``/metrics`` is open, and an agent that
scraped it around its own finish would read its reward (the sum moves by exactly it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    generate_latest,
    multiprocess,
)

from tracetap.storage.writer import WriterObserver

if TYPE_CHECKING:
    from tracetap.proxy.apis import Reassembly
    from tracetap.proxy.runtime.state import ProxyState

# Seconds. Overhead is sub-millisecond when all is well; durations reach minutes for
# long generations.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                    60, 120, 300)
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
OTHER = "other"
# What an agent must not read about its own episode (module doc): family names.
OUTCOMES = frozenset({"tracetap_episode_reward", "tracetap_episodes_integrity",
                      "tracetap_episode_integrity_causes"})


class CallOutcome(msgspec.Struct, frozen=True):
    """What the metrics read of one finished model call (the driver fills it in, after
    the reply): values, never the call itself."""

    route: str
    stream: bool
    http_status: int  # 0 when no status was sent (the client left first)
    client_gone: bool
    elapsed: float
    upstream_latency: float | None
    overhead: float
    ttft: float | None
    dropped: dict[str, int]  # translation's left-out fields, by name
    fields_dropped: dict[str, int]  # request fields kept from the engine, by name
    capture: Reassembly
# Refusals counted in tracetap_agent_refused_total{reason}, by their error code.
_COUNTED_REFUSALS = frozenset({"episode_credential_required", "forbidden", "invalid_api_key",
                               "episode_finished", "overlay_header"})


class Metrics(WriterObserver):
    def __init__(self, max_models: int = 16, multiprocess_dir: str | None = None):
        self.registry = r = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
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
                              multiprocess_mode="livesum", registry=r)
        self.queue_depth = Gauge("tracetap_capture_queue_depth",
                                 "Captured records not yet committed to the database",
                                 multiprocess_mode="livesum", registry=r)
        self.journal_bytes = Gauge("tracetap_journal_bytes", "Bytes in the on-disk journal",
                                   multiprocess_mode="livesum", registry=r)
        self.records_total = Counter("tracetap_records_total",
                                     "Call records by outcome: written, spilled, replayed, "
                                     "dropped, quarantined (refused by the database, kept in "
                                     "the dead-letter file), altered (stored with values "
                                     "replaced)",
                                     ["outcome"], registry=r)
        self.db_write_seconds = Histogram("tracetap_db_write_duration_seconds",
                                  "Time to commit one batch of records", buckets=DB_BUCKETS,
                                  registry=r)
        self.db_batch = Histogram("tracetap_db_batch_size", "Records per committed batch",
                                  buckets=BATCH_BUCKETS, registry=r)
        self.logprobs_missing = Counter("tracetap_logprobs_missing_total",
                                        "Choices stored without usable logprobs", registry=r)
        self.history_repairs = Counter("tracetap_history_repairs_total",
                                       "Resent assistant turns replaced by the model's own "
                                       "(--repair-history), by what the harness changed",
                                       ["cause"], registry=r)
        self.overlay_events = Counter("tracetap_overlay_events_total",
                                      "What overlay hooks did (docs/overlays.md), by overlay, "
                                      "hook and action", ["overlay", "hook", "action"],
                                      registry=r)
        # Agent traffic the proxy refused (the agent is untrusted: count every attempt).
        self.refused = Counter("tracetap_agent_refused_total",
                               "Agent requests refused and never forwarded, by reason",
                               ["reason"], registry=r)
        self.translation_dropped = Counter(
            "tracetap_translation_dropped_total",
            "Request fields and blocks translation to chat left out, by client API and field "
            "(a fixed set of names; others count as 'other')", ["api", "field"], registry=r)
        self.request_fields_dropped = Counter(
            "tracetap_request_fields_dropped_total",
            "Request fields kept from the engine (engine controls, anything off the API's "
            "allowlist), by route and field (a fixed set of names; others count as 'other')",
            ["route", "field"], registry=r)
        self.sync_cuts = Counter("tracetap_weight_sync_cuts_total",
                                 "Streams a pause in abort mode cut, by outcome: continued; "
                                 "abort_refused (the engine's abort failed: finished on the "
                                 "old weights, as in a drain); ended_without_ids (the abort "
                                 "ended it without its ids: stored as upstream_error)",
                                 ["outcome"], registry=r)
        self.unknown_events = Counter("tracetap_unknown_stream_events_total",
                                      "Stream events of a type capture does not know, relayed "
                                      "untouched", ["route"], registry=r)
        self.budget_exceeded = Counter("tracetap_episode_budget_exceeded_total",
                                       "Model calls refused because the episode spent a "
                                       "budget, by limit", ["limit"], registry=r)
        self.internal_errors = Counter("tracetap_internal_errors_total",
                                       "Requests the proxy failed on itself (a 500 in the "
                                       "client's error shape; tracebacks are rate-limited)",
                                       registry=r)
        for outcome in ("written", "spilled", "replayed", "dropped", "quarantined", "altered"):
            self.records_total.labels(outcome)
        self._operations(r)

    def _operations(self, r: CollectorRegistry) -> None:
        """What the shipped alert rules and dashboard read (deploy/prometheus, deploy/grafana)."""
        self.choices = Counter("tracetap_choices_total", "Choices captured from upstream replies",
                               registry=r)
        # Counted by the writer's resolver once it tried the engine's tokenizer
        # (proxy.tokens.resolve).
        self.token_ids_missing = Counter("tracetap_token_ids_missing_total",
                                         "Choices with content stored without token ids (prompt "
                                         "or completion; left out of trajectories), by reason",
                                         ["reason"], registry=r)
        self.ids_waiting = Gauge("tracetap_token_ids_waiting_records",
                                 "Journaled records waiting for their engine to be idle before "
                                 "its tokenizer is asked (it would cut a stream); part of the "
                                 "capture queue", multiprocess_mode="livesum", registry=r)
        self.db_write_errors = Counter("tracetap_db_write_errors_total",
                                       "Batch writes the database refused (each retry counts)",
                                       registry=r)
        self.db_writes_ok = Gauge("tracetap_db_writes_ok",
                                  "1 while the writer's last database write succeeded",
                                  multiprocess_mode="livemin", registry=r)
        self.intents_late = Gauge("tracetap_intents_late_calls",
                                  "Calls answered before their intent reached the database "
                                  "(storage.intents), since start",
                                  multiprocess_mode="livesum", registry=r)
        self.journal_recovered_bytes = Gauge(
            "tracetap_journal_recovered_bytes",
            "Journal bytes a previous process left on disk, found at this start",
            multiprocess_mode="livesum", registry=r)
        self.start_time = Gauge("tracetap_start_time_seconds",
                                "When this proxy started, in Unix seconds",
                                multiprocess_mode="min", registry=r)
        self.upstream_healthy = Gauge("tracetap_upstream_healthy",
                                      "1 while an upstream is in service, 0 while it is taken out",
                                      ["upstream"], multiprocess_mode="livemin", registry=r)
        self.paused = Gauge("tracetap_paused", "1 while model calls are held for a weight sync",
                            multiprocess_mode="livemax", registry=r)
        self.pause_start = Gauge("tracetap_pause_start_time_seconds",
                                 "When the current pause began, in Unix seconds; 0 when running",
                                 multiprocess_mode="livemax", registry=r)
        self.pause_timeout = Gauge("tracetap_pause_timeout_seconds",
                                   "How long a held call waits before it is refused",
                                   multiprocess_mode="livemax", registry=r)
        self.episodes_finished = Counter("tracetap_episodes_finished_total",
                                         "Episodes finished through the admin API", registry=r)
        self.episodes_integrity = Counter(
            "tracetap_episodes_integrity_total", "Finished episodes by the integrity verdict "
            "their stored calls gave at the finish (clean, infra)", ["integrity"], registry=r)
        self.integrity_causes = Counter(
            "tracetap_episode_integrity_causes_total", "Finished episodes whose stored calls "
            "showed this infrastructure cause at the finish", ["cause"], registry=r)
        self.episode_reward = Summary("tracetap_episode_reward",
                                      "Rewards of finished episodes (sum and count: the mean)",
                                      registry=r)
        self.start_time.set(time.time())
        self._paused = False

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

    def count_refusal(self, code: str) -> None:
        """An agent's attempt on someone else's episode, by the refusal's error code
        (the agent is untrusted: those are counted); other codes are not refusals."""
        if code in _COUNTED_REFUSALS:
            self.child(self.refused, code).inc()

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

    def db_error(self) -> None:
        self.db_write_errors.inc()

    def observe_call(self, call: CallOutcome) -> None:
        """One model call's metrics (bookkeeping: scheduled to run after the reply)."""
        child = self.child
        route = call.route
        stream = "true" if call.stream else "false"
        gone = call.client_gone or not call.http_status
        child(self.requests, route, "499" if gone else str(call.http_status)).inc()
        child(self.duration, route, stream).observe(call.elapsed)
        if call.upstream_latency is not None:
            child(self.upstream, route).observe(call.upstream_latency)
            child(self.overhead, route, stream).observe(max(0.0, call.overhead))
        if call.stream and call.ttft is not None:
            child(self.ttft, route).observe(call.ttft)
        for field, n in call.dropped.items():
            child(self.translation_dropped, route, field).inc(n)
        for field, n in call.fields_dropped.items():
            child(self.request_fields_dropped, route, field).inc(n)
        capture = call.capture
        if capture.logprobs_missing:
            self.logprobs_missing.inc(capture.logprobs_missing)
        self.captured(capture, route)
        prompt_tokens, completion_tokens = capture.tokens()
        if prompt_tokens or completion_tokens:
            model = self.model(capture.model)
            if prompt_tokens:
                child(self.tokens, "prompt", model).inc(prompt_tokens)
            if completion_tokens:
                child(self.tokens, "completion", model).inc(completion_tokens)

    def captured(self, capture: Reassembly, route: str) -> None:
        """One call's choices, once stored (those without token ids are counted later, by
        the writer's resolver: ids_missing)."""
        if capture.unknown_events:
            self.unknown_events.labels(route).inc(capture.unknown_events)
        if capture.choice_count:
            self.choices.inc(capture.choice_count)

    def set_paused(self, paused: bool) -> None:
        if not paused:
            self.pause_start.set(0)
        elif not self._paused:  # a second pause does not restart the clock
            self.pause_start.set(time.time())
        self._paused = paused
        self.paused.set(paused)

    def episode_finished(self, reward: float | None) -> None:
        self.episodes_finished.inc()
        if reward is not None:
            self.episode_reward.observe(reward)

    def episode_integrity(self, verdict) -> None:
        """A finished episode's storage.integrity.Verdict."""
        self.child(self.episodes_integrity, verdict.integrity).inc()
        for cause in verdict.causes:
            self.child(self.integrity_causes, cause).inc()

    def refresh(self, state: ProxyState) -> None:
        """Gauges that mirror the proxy's state, read when scraped."""
        writer = state.writer
        self.queue_depth.set(writer.pending)
        self.ids_waiting.set(writer.held)
        self.journal_bytes.set(writer.journal.bytes)
        self.journal_recovered_bytes.set(writer.journal.recovered_bytes)
        self.db_writes_ok.set(writer.db_healthy)
        self.intents_late.set(state.intents.late)
        self.pause_timeout.set(state.settings.pause_timeout)
        for target in state.pool.targets:
            self.child(self.upstream_healthy, target.base_url).set(target.healthy)

    def render(self, outcomes: bool = False) -> bytes:
        """The text exposition; the OUTCOMES families only with ``outcomes`` (the admin's)."""
        registry = self.registry
        if self.multiprocess_dir is not None:
            # Every worker's values, read from the files they write (a fresh registry each
            # scrape, as prometheus_client's multiprocess mode asks).
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry if outcomes else _WithoutOutcomes(registry))


class _WithoutOutcomes:
    """A registry's families but the OUTCOMES (what generate_latest reads: ``collect``)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            if family.name.removesuffix("_total") not in OUTCOMES:
                yield family


__all__ = ["CONTENT_TYPE", "OUTCOMES", "Metrics"]
