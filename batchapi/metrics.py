"""serve's Prometheus metrics (`GET /metrics`, with a key like every endpoint): one series per tenant,
on a private registry. The label set is bounded: the tenants serve knows from its keys (the tenants
file's and one per plain key) and "default"; never a name read from Redis or a request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from .fleet import BatchRow, TenantRow
from .tenants import DEFAULT_TENANT

__all__ = ["ServeMetrics"]

PREFIX = "batchfleet_serve_"


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def g(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ("tenant",), registry=self.registry)

        self.weight = g("tenant_weight", "The tenant's weight in the fair share (the tenants file)")
        self.share = g("tenant_output_share_ratio", "The tenant's part of the fleet's output tokens over the last "
                       "minute")
        self.tps = g("tenant_output_tokens_per_second", "The tenant's output tokens per second over the last minute")
        self.queued = g("tenant_queued_requests", "Requests of the tenant's unfinished batches without a result")
        self.done = g("tenant_done_requests", "Requests of the tenant's batches with a result (completed or failed)")
        self.late = g("tenant_late_batches", "The tenant's running batches estimated to finish after their deadline")
        self.gauges = (self.weight, self.share, self.tps, self.queued, self.done, self.late)
        self.labels: set[str] = set()

    def update(self, known: set[str], tenants: list[TenantRow], batches: list[BatchRow]) -> None:
        """The figures of the tenants in `known` (and "default"); a tenant no longer known loses its series."""
        allowed = known | {DEFAULT_TENANT}
        late: dict[str, int] = {}
        for b in batches:
            late[b.tenant] = late.get(b.tenant, 0) + b.late
        for name in self.labels - allowed:
            for gauge in self.gauges:
                gauge.remove(name)
        self.labels &= allowed
        for t in tenants:
            if t.name not in allowed:
                continue
            self.labels.add(t.name)
            for gauge, value in zip(self.gauges, (t.weight, t.share, t.tokens_per_s, t.queued, t.done,
                                                  late.get(t.name, 0)), strict=True):
                gauge.labels(t.name).set(value)

    def text(self) -> bytes:
        return generate_latest(self.registry)
