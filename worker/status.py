"""The worker's status record: what it publishes every few seconds for the supervisor and
`producer status` (nothing else reads a server's port, so workers can live on other hosts)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

import redis
import redis.asyncio as aioredis

from batchfleet import keys, sglang
from batchfleet.keys import Keys
from batchfleet.records import ServerMetrics, WorkerStatus

from .gpu import nvidia_smi
from .meter import PrefillCounter, ThroughputMeter
from .redislink import LINK, every

__all__ = ["StatusPublisher", "StatusReporter", "gpu_model", "probe_gpu_model"]

log = logging.getLogger("batchfleet.worker.status")


class StatusPublisher:
    def __init__(self, client: aioredis.Redis, keyspace: Keys, *, snapshot: Callable[[], WorkerStatus]) -> None:
        self.r = client
        self.k = keyspace
        self.snapshot = snapshot

    async def publish(self, status: WorkerStatus | None = None, *, prefill: tuple[int, int] = (0, 0)) -> WorkerStatus:
        """The status record; with it, `prefill` (prompt tokens the server prefilled, of them cached since
        the last publish) added to the run's stats (`prompt_tokens`, `cached_tokens`, and per queue)."""
        status = status or self.snapshot()
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.set(self.k.status(status.worker), status.to_json(), ex=keys.STATUS_TTL_S)
            pipe.sadd(self.k.workers, status.worker)
            for name, n in zip((keys.PROMPT_TOKENS, keys.CACHED_TOKENS), prefill, strict=True):
                if n > 0:
                    pipe.hincrby(self.k.stats, name, n)
                    pipe.hincrby(self.k.stats, f"{name}:{status.queue}", n)
            await pipe.execute()
        return status

    async def forget(self, worker: str) -> None:
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.delete(self.k.status(worker))
            pipe.srem(self.k.workers, worker)
            await pipe.execute()


class StatusReporter:
    """Every `interval_s`: scrape the server's gauges, feed the throughput meter, publish the status
    record, and beat RQ's worker heartbeat (so `rq info` keeps listing this worker)."""

    def __init__(self, publisher: StatusPublisher, meter: ThroughputMeter, *, interval_s: float,
                 http: Callable[[], sglang.SGLangClient | None], server_running: Callable[[], bool],
                 rq_heartbeat: Callable[[], object], gpu: int | None = None,
                 on_published: Callable[[WorkerStatus], None] | None = None) -> None:
        self.publisher = publisher
        self.gpu = gpu
        self.on_published = on_published  # e.g. the spec follower keeps the server's kind (the fleet's memory)
        self.meter = meter
        self.interval_s = interval_s
        self.http = http
        self.server_running = server_running
        self.rq_heartbeat = rq_heartbeat
        self.metrics = ServerMetrics()
        self.prefill = PrefillCounter()

    async def publish_now(self) -> None:
        """Publish the status record now; a Redis outage must not stop the server's life cycle."""
        try:
            await self.publisher.publish()
        except (redis.RedisError, OSError) as exc:
            LINK.lost("publishing the status record", exc)

    async def run(self) -> NoReturn:
        if self.gpu is not None:
            await asyncio.to_thread(probe_gpu_model, self.gpu)  # once: the fleet's memory is keyed by it
        await every(self.interval_s, "publishing the status record", self._beat)

    async def _beat(self) -> None:
        client = self.http()
        if client is not None and self.server_running():
            self.metrics = await scrape_metrics(client)
            self.meter.note_counter(self.metrics.generation_tokens_total)
            self.prefill.note(self.metrics.prompt_tokens_total, self.metrics.cached_tokens_total)
        prompt, cached = self.prefill.pending
        status = await self.publisher.publish(prefill=(prompt, cached))
        self.prefill.taken(prompt, cached)
        if self.on_published is not None:
            self.on_published(status)
        await asyncio.to_thread(self.rq_heartbeat)


async def scrape_metrics(client: sglang.SGLangClient) -> ServerMetrics:
    """The server's own gauges from /metrics (empty when metrics are off or the server is busy)."""
    try:
        status, body = await client.get("/metrics", timeout_s=5.0)
    except (ConnectionError, TimeoutError):
        return ServerMetrics()
    if status != 200:
        return ServerMetrics()
    return replace(sglang.parse_metrics(body.decode("utf-8", errors="replace")), ts=time.time())


HOST = socket.gethostname()
_GPU_QUERY = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
_gpu_models: dict[int, tuple[str, int]] = {}


def probe_gpu_model(index: int) -> tuple[str, int] | None:
    """(name, total MiB) of one GPU as nvidia-smi names it (the driver's tool, or the simulator's
    stand-in), asked once and kept; None when none answers."""
    if index in _gpu_models:
        return _gpu_models[index]
    out = nvidia_smi(_GPU_QUERY)
    if out is None:
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0] == str(index):
            try:
                _gpu_models[index] = (fields[1], int(float(fields[2])))
            except ValueError:
                return None
            return _gpu_models[index]
    return None


def gpu_model(index: int | None) -> dict[str, object]:
    """The status record's GPU fields (`gpu_name`, `gpu_memory_mib`) from what was probed, if anything."""
    found = _gpu_models.get(index) if index is not None else None
    return {"gpu_name": found[0], "gpu_memory_mib": found[1]} if found else {}
