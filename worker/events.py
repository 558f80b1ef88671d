"""Events a worker records for the supervisor and the audit trail (`Keys.events`, capped)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from batchfleet import keys
from batchfleet.keys import Keys
from batchfleet.records import Event, EventKind

from .redislink import LINK

__all__ = ["EventLog"]

log = logging.getLogger("batchfleet.worker")


class EventLog:
    def __init__(self, client: aioredis.Redis, keyspace: Keys, *, source: str, clock: Callable[[], float],
                 scrub: Callable[[str], str] = str) -> None:
        self.r = client
        self.k = keyspace
        self.source = source
        self.clock = clock
        self.scrub = scrub  # an event's text may quote an error: never a secret in it

    async def emit(self, kind: EventKind, message: str, **data: object) -> None:
        """Log it, and record it in Redis when Redis answers (an outage costs the record, not the worker)."""
        data.pop("since", None)
        message = self.scrub(message)
        data = {k: self.scrub(v) if isinstance(v, str) else v for k, v in data.items()}
        event = Event(kind=kind, message=message, source=self.source, data=data, ts=self.clock())
        log.info("%s: %s", kind, message)
        try:
            await self.r.xadd(self.k.events, {"e": event.to_json()}, maxlen=keys.EVENTS_MAXLEN, approximate=True)
        except (redis.RedisError, OSError) as exc:
            LINK.lost(f"recording the {kind} event", exc)
