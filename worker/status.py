"""The worker's status record: what it publishes every few seconds for the supervisor and
`producer status` (nothing else reads a server's port, so workers can live on other hosts)."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace

import httpx
import redis.asyncio as aioredis

from batchfleet import keys, sglang
from batchfleet.keys import Keys
from batchfleet.records import ServerMetrics, WorkerStatus

__all__ = ["StatusPublisher"]

log = logging.getLogger("batchfleet.worker.status")


class StatusPublisher:
    def __init__(self, client: aioredis.Redis, keyspace: Keys, *, snapshot: Callable[[], WorkerStatus]) -> None:
        self.r = client
        self.k = keyspace
        self.snapshot = snapshot

    async def publish(self, status: WorkerStatus | None = None) -> WorkerStatus:
        status = status or self.snapshot()
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.set(self.k.status(status.worker), status.to_json(), ex=keys.STATUS_TTL_S)
            pipe.sadd(self.k.workers, status.worker)
            await pipe.execute()
        return status

    async def forget(self, worker: str) -> None:
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.delete(self.k.status(worker))
            pipe.srem(self.k.workers, worker)
            await pipe.execute()


async def scrape_metrics(client: httpx.AsyncClient) -> ServerMetrics:
    """The server's own gauges from /metrics (empty when metrics are off or the server is busy)."""
    try:
        resp = await client.get("/metrics", timeout=5.0)
    except httpx.HTTPError:
        return ServerMetrics()
    if resp.status_code != 200:
        return ServerMetrics()
    return replace(sglang.parse_metrics(resp.text), ts=time.time())


HOST = socket.gethostname()
