"""The fleet's metrics for Prometheus (`supervisor watch --metrics-port P`), on a private registry so
nothing of the supervisor process itself leaks in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from .classify import CLASSES, WindowReport
from .fleet import FleetSnapshot
from .pilotstate import Phase, PilotState

__all__ = ["FleetMetrics"]

PREFIX = "batchfleet_"


class FleetMetrics:
    """Names follow Prometheus's conventions (`promtool check metrics`): base units spelled out
    (`_seconds`, `_per_second`), ratios as `_ratio`, counters as `_total`. The fleet's figures are
    `batchfleet.fleetview`'s, the same as `producer status` and `supervisor watch` show."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        g = lambda name, doc, labels=(): Gauge(PREFIX + name, doc, labels, registry=self.registry)  # noqa: E731
        self.fleet_tps = g("fleet_tokens_per_second",
                           "Completion tokens per wall-clock second of the live serving workers")
        self.live = g("fleet_live_workers", "Workers whose status record is live (the newest of each queue)")
        self.backlog = g("backlog_prompts", "Prompts waiting in Redis", ("queue",))
        self.eta = g("eta_seconds", "Estimated seconds until every pending prompt is done (-1: unknown)")
        self.in_flight = g("gpu_in_flight_prompts", "Prompts in flight", ("worker", "gpu"))
        self.capacity = g("gpu_max_running_requests", "The server's effective max running requests",
                          ("worker", "gpu"))
        self.gpu_tps = g("gpu_tokens_per_second", "Completion tokens per wall-clock second the worker measures",
                         ("worker", "gpu"))
        self.kv = g("gpu_full_kv_usage_ratio", "Full-attention KV pool usage", ("worker", "gpu"))
        self.mamba = g("gpu_mamba_usage_ratio", "Mamba state slot usage", ("worker", "gpu"))
        self.generation = g("gpu_control_generation", "Control generation the server runs", ("worker", "gpu"))
        self.cls = g("gpu_class", "1 for the server's class in the last window", ("worker", "gpu", "cls"))
        self.phase = g("autopilot_phase", "1 for the autopilot's phase", ("phase",))
        self.hit = g("prefix_cache_hit_ratio", "Of the prompt tokens the servers prefilled, the share their radix "
                     "caches gave (since the run began)", ("queue",))
        self.predicted = g("prefix_plan_predicted_hit_ratio", "The prefix plan's prediction of that share, per queue",
                           ("queue",))
        self.saved = g("prefill_tokens_saved", "Prompt tokens the servers did not prefill: their radix caches had "
                       "them (since the run began)")
        self.events = Counter(PREFIX + "events", "Supervisor and restart events seen, by kind", ("kind",),
                              registry=self.registry)
        self._last_event_ts = 0.0

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def update(self, snap: FleetSnapshot, report: WindowReport | None, state: PilotState) -> None:
        self.fleet_tps.set(snap.tokens_per_s)
        self.live.set(len(snap.live))
        for q, n in snap.backlog.items():
            self.backlog.labels(q).set(n)
        eta = snap.eta().seconds
        self.eta.set(-1 if eta is None else eta)
        for w in snap.workers:
            lab = (w.worker, str(w.gpu))
            self.in_flight.labels(*lab).set(w.in_flight)
            self.capacity.labels(*lab).set(w.effective_max)
            self.gpu_tps.labels(*lab).set(snap.tokens_per_s_of(w))
            self.kv.labels(*lab).set(w.metrics.full_kv_usage or 0)
            self.mamba.labels(*lab).set(w.metrics.mamba_usage or 0)
            self.generation.labels(*lab).set(w.generation)
        if report is not None:
            for v in report.servers:
                for c in CLASSES:
                    self.cls.labels(v.worker, str(v.gpu), str(c)).set(1 if v.cls == c else 0)
        for p in Phase:
            self.phase.labels(str(p)).set(1 if state.phase == p else 0)
        self.saved.set(snap.saved_tokens)
        for q in {w.queue for w in snap.workers} | set(snap.backlog):
            if (hit := snap.hit_rate(q)) is not None:
                self.hit.labels(q).set(hit)
            if (predicted := snap.predicted_hit(q)) is not None:
                self.predicted.labels(q).set(predicted)
        for e in snap.events:
            if e.ts > self._last_event_ts:
                self.events.labels(e.kind).inc()
        if snap.events:
            self._last_event_ts = max(self._last_event_ts, *(e.ts for e in snap.events))
