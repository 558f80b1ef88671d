"""Spec following: which `ServerSpec` the supervisor asks of this worker's server.

The control hash is data written by another process (maybe another version, maybe a forger): a
spec that does not decode or is not on `ServerSpec`'s allow-list is refused with one `spec_refused`
event per value, and the worker keeps what it runs (or its configuration at first start).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from batchfleet.config import Config
from batchfleet.keys import Keys
from batchfleet.records import EventKind, RecordError, ServerSpec

from .events import EventLog
from .redislink import LINK

__all__ = ["SpecFollower"]

log = logging.getLogger("batchfleet.worker")


class SpecFollower:
    def __init__(self, config: Config, client: aioredis.Redis, keyspace: Keys, *, worker: str, queue: str, gpu: int,
                 events: EventLog, current: Callable[[], ServerSpec | None]) -> None:
        self.config = config
        self.r = client
        self.k = keyspace
        self.worker = worker
        self.queue = queue
        self.gpu = gpu
        self.events = events
        self.current = current  # the spec the running server serves, None while none runs
        self._refused: bytes | None = None  # the last spec refused from Redis (said once)

    async def desired(self) -> ServerSpec:
        """What the supervisor asks of this worker's server; the configuration when it asks nothing."""
        try:
            mine, legacy, fleet = await self.r.hmget(self.k.control, Keys.control_queue(self.queue),
                                                     Keys.control_worker(self.worker), Keys.CONTROL_FLEET)
        except (redis.RedisError, OSError) as exc:
            # Redis away: keep serving what runs now (or the configuration at first start).
            LINK.lost("reading the desired server spec (keeping the current one)", exc)
            return self._kept()
        for field, raw in (("override", mine), ("override", legacy), ("fleet", fleet)):
            if not raw:
                continue
            try:
                return ServerSpec.from_json(raw)
            except RecordError as exc:
                # Data, not an instruction: refuse it (once per value), keep what runs now.
                kept = self._kept()
                if raw != self._refused:
                    self._refused = raw
                    await self.events.emit(EventKind.SPEC_REFUSED, f"gpu{self.gpu}: refused the {field} server spec in "
                                           f"Redis: {exc}; keeping {kept.describe()}", reason=str(exc))
                return kept
        return self.configured()

    def _kept(self) -> ServerSpec:
        current = self.current()
        return current if current is not None else self.configured()

    def configured(self) -> ServerSpec:
        return ServerSpec(strategy=self.config.strategy, mem_fraction_static=self.config.mem_fraction_static,
                          max_running_requests=self.config.max_running_requests)
