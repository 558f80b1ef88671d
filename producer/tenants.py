"""What the head of a shared fleet knows of each tenant (`TenantBook`), and the figures it publishes for
`batchfleet serve` (`Keys.tenants`: one `TenantFigures` per tenant, `read_tenants`).

The head learns a tenant's output tokens from the results it collects (each result's input is owned
by a tenant, `Store.shares`) and tells `producer.share.FairShare`, which decides the feed. Every
`PUBLISH_S` it writes each tenant's figures: its part of the fleet's output tokens over the last minute,
its tokens/s, its load (what the feed compares), its prompts in Redis and waiting in the store.
"""

from __future__ import annotations

import time

import redis

from batchfleet.errors import RecordError
from batchfleet.keys import Keys
from batchfleet.records import TenantFigures

from .collect import CollectSummary
from .share import SHARE_SPAN_S, FairShare
from .store import Store

__all__ = ["PUBLISH_S", "TenantBook", "read_tenants"]

PUBLISH_S = 2.0


class TenantBook:
    def __init__(self, r: redis.Redis, keys: Keys, store: Store, share: FairShare) -> None:
        self.r = r
        self.keys = keys
        self.store = store
        self.share = share
        self._owner: dict[int, str] = {}
        self._next = 0.0

    def tenant_of(self, file: int) -> str:
        tenant = self._owner.get(file)
        if tenant is None:
            with self.store.read():
                tenant = self._owner[file] = self.store.shares.owner(file)[0]
        return tenant

    def observe(self, got: CollectSummary) -> None:
        """Results collected: each tenant's output tokens, for the share."""
        now = time.monotonic()
        for file, (n, tokens) in got.by_input.items():
            self.share.observed(self.tenant_of(file), tokens, n, now)

    def publish(self, *, force: bool = False) -> None:
        """Every tenant's figures to `Keys.tenants` (at most every PUBLISH_S)."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + PUBLISH_S
        with self.store.read():
            weights = self.store.shares.weights()
            waiting: dict[str, int] = {}
            for file, n in self.store.db.execute("SELECT file, COUNT(*) FROM prompts WHERE state = 0 GROUP BY file"):
                tenant = self._owner.get(file)
                if tenant is None:
                    tenant = self._owner[file] = self.store.shares.owner(file)[0]
                waiting[tenant] = waiting.get(tenant, 0) + n
        shares = self.share.shares(now)
        figures = {}
        for name in sorted({*self.share.tenants, *waiting}):
            use = self.share.tenants.get(name)
            recent = sum(n for at, n in use.recent if at >= now - SHARE_SPAN_S) if use else 0
            figures[name] = TenantFigures(
                tenant=name, weight=weights.get(name, 1.0), share=round(shares.get(name, 0.0), 4),
                tokens_per_s=round(recent / SHARE_SPAN_S, 1), load=round(self.share.load(name, weights, now), 1),
                in_redis=use.in_redis if use else 0, waiting=waiting.get(name, 0), fed=use.fed if use else 0,
                results=use.results if use else 0, output_tokens=use.tokens if use else 0).to_json()
        if figures:
            self.r.hset(self.keys.tenants, mapping=figures)


def read_tenants(r: redis.Redis, keys: Keys) -> dict[str, TenantFigures]:
    """The figures the head last published, per tenant (an unreadable field is skipped: data from Redis)."""
    out = {}
    for raw in r.hvals(keys.tenants):
        try:
            fig = TenantFigures.from_json(raw)
        except RecordError:
            continue
        out[fig.tenant] = fig
    return out
