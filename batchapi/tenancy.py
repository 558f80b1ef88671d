"""The tenants as the batch engine's thread applies them, each pass (`Tenancy.step`): the keys in force
(`use`, on SIGHUP), their weights written into the run's store for the head (`Store.shares`, by the
thread that owns the store's connection), the fleet book and the metrics recomputed, and the bytes per
prompt token the quotas estimate with."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from batchfleet.keys import Keys
from producer.api import Store

from .auth import ApiKeys
from .fleet import FleetBook, TenantRow
from .metrics import ServeMetrics
from .objects import BatchStatus
from .quota import TokenRatio
from .registry import Registry

__all__ = ["Tenancy"]


class Tenancy:
    def __init__(self, r: redis.Redis, keys: Keys, registry: Registry, api_keys: ApiKeys, *,
                 on_rows: Callable[[list[TenantRow]], None] | None = None) -> None:
        self.r = r
        self.keys = keys
        self.registry = registry
        self.api_keys = api_keys
        self._lock = threading.Lock()
        self._weights: dict[str, float] | None = api_keys.weights()  # to write into the store
        self.book = FleetBook(r, keys, registry, on_rows=on_rows)
        self.metrics = ServeMetrics()
        self.ratio = TokenRatio()
        for b in registry.all_batches():  # what the batches that ended before this serve measured
            if b.status is BatchStatus.COMPLETED:
                self.ratio.add_batch(b, registry.files.get(b.input_file_id))

    def use(self, api_keys: ApiKeys) -> None:
        """The keys of a tenants file read again: in force for the next request; weights at the next pass."""
        with self._lock:
            self.api_keys = api_keys
            self._weights = api_keys.weights()

    def step(self, store: Store) -> None:
        with self._lock:
            weights, self._weights = self._weights, None
        if weights is not None:
            try:
                with store.write():
                    store.shares.set_weights(weights)
            except BaseException:
                with self._lock:  # written at the next pass, unless newer ones came meanwhile
                    if self._weights is None:
                        self._weights = weights
                raise
        try:
            updated = self.book.update(self.api_keys)
        except redis.RedisError:  # the figures wait for Redis; the batches' lives do not
            return
        if updated:
            self.metrics.update(set(self.api_keys.by_name), self.book.tenants, list(self.book.batches.values()))

    def stored(self) -> None:
        """A batch's prompts are in the store: the head's next pass starts now (a high one runs within seconds)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.keys.wake, "1")
        pipe.expire(self.keys.wake, 60)
        pipe.execute()
