"""One GPU's worker, assembled: its server, the dispatcher that keeps the server full, the ledger,
the status record, lease upkeep, health checks, restarts and a clean stop.

    start server ──ready──▶ serving ──server died/hung──▶ restarting (kill) ──▶ start server ...
          │                    └──supervisor asks for another ServerSpec──▶ restarting (drain,
          │                       hand back the rest, stop, GPU free again) ──▶ start server ...
          └ start failed: state "down", reason and log tail published; retried with backoff
    SIGTERM/SIGINT: stop claiming, finish in-flight up to the grace period, hand back the rest,
    stop the server, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
from collections import deque
from collections.abc import Callable

import httpx
import redis
import redis.asyncio as aioredis

from batchfleet import keys, sglang
from batchfleet.config import Config
from batchfleet.errors import ConfigError, ServerDied, ServerStartError
from batchfleet.keys import RQ_QUEUE_PREFIX, RQ_QUEUES, Keys
from batchfleet.marker import MarkerWatch
from batchfleet.records import Event, Prompt, RecordError, ServerMetrics, ServerSpec, WorkerStatus

from .dispatcher import Dispatcher
from .gpu import wait_gpu_free
from .ledger import Ledger
from .server import SGLangServer
from .status import HOST, StatusPublisher, scrape_metrics

__all__ = ["GPUService"]

log = logging.getLogger("batchfleet.worker")


class GPUService:
    def __init__(self, config: Config, client: aioredis.Redis, *, worker: str, queue: str, gpu: int,
                 rq_heartbeat: Callable[[], object] = lambda: None) -> None:
        self.config = config
        self.r = client
        self.k = Keys(config.run)
        self.worker = worker
        self.queue = queue
        self.gpu = gpu
        self.rq_heartbeat = rq_heartbeat
        self.server = SGLangServer(config, gpu=gpu, port=config.port_for(gpu))
        self.ledger = Ledger(client, self.k, worker=worker, lease_ttl_s=config.lease_ttl_s)
        self.state = "starting"
        self.message = ""
        self.metrics = ServerMetrics()
        self._steal_order: list[str] = [queue]
        self._http: httpx.AsyncClient | None = None
        self.dispatcher = Dispatcher(self.ledger, self._generate, config=config, worker=worker,
                                     queues=lambda: self._steal_order, server_ok=self._server_ok)
        self.publisher = StatusPublisher(client, self.k, snapshot=self.snapshot)
        self.stop_requested = asyncio.Event()
        self._restarting: dict | None = None  # set between a spec-driven stop and the next start
        self._refused_spec: bytes | None = None  # the last spec refused from Redis (said once)
        self._generated: deque[tuple[float, float]] = deque()  # (monotonic s, generation_tokens_total)
        self._marker = MarkerWatch(self.k, log)  # says so when Redis loses the run's data

    # --- entry point ----------------------------------------------------------------------------
    async def run(self, *, burst: bool = False) -> int:
        """Serve until stopped (or, in burst mode, until the queues are empty). Returns an exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        background = [asyncio.create_task(c) for c in (self.ledger.run_flusher(), self._upkeep(), self._status_loop())]
        serving = asyncio.create_task(self._keep_serving())
        claiming = asyncio.create_task(self.dispatcher.run(burst=burst))
        stop = asyncio.create_task(self.stop_requested.wait())
        code = 0
        try:
            done, _ = await asyncio.wait({serving, claiming, stop}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and t.exception() is not None:
                    log.error("worker stopping on an unexpected error", exc_info=t.exception())
                    code = 1
        finally:
            handed = await self.dispatcher.drain(self.config.shutdown_grace_s)
            for t in (serving, claiming, stop):
                t.cancel()
            await asyncio.wait([serving, claiming, stop], timeout=10)
            self.state = "down"
            self.message = f"stopped ({handed} prompt(s) handed back)"
            await self.server.stop()
            self.ledger.close()
            flusher, others = background[0], background[1:]
            for t in others:
                t.cancel()
            # Bounded waits: redis-py may swallow a cancellation that lands inside a command.
            await asyncio.wait([flusher], timeout=10)
            await asyncio.wait(others, timeout=5)
            await self.ledger.flush()
            await self.publisher.forget(self.worker)
            if self._http is not None:
                await self._http.aclose()
            log.info("worker %s stopped: %d done, %d failed, %d handed back", self.worker,
                     self.dispatcher.done, self.dispatcher.failed, self.dispatcher.handed_back)
        return code

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stop_requested.is_set():
            return
        log.info("%s: stop taking work; finishing in-flight prompts for up to %.0f s",
                 signal.Signals(sig).name, self.config.shutdown_grace_s)
        self.dispatcher.accepting.clear()
        self.stop_requested.set()

    # --- the server's life ------------------------------------------------------------------------
    async def _keep_serving(self) -> None:
        failures = 0
        while True:
            self.state = "starting"
            spec = await self._desired_spec()
            try:
                capacity = await self.server.start(spec)
            except ServerStartError as exc:
                failures += 1
                self.state, self.message = "down", str(exc)
                log.error("gpu%d: %s", self.gpu, exc)
                await self._publish()
                await asyncio.sleep(min(300.0, 5.0 * 2 ** (failures - 1)))
                continue
            except ConfigError as exc:
                self.state, self.message = "down", f"configuration error: {exc}"
                log.error("gpu%d: %s", self.gpu, self.message)
                await self._publish()
                raise
            failures = 0
            await self._open_http(capacity)
            limit = min(capacity, self.config.max_in_flight or capacity)
            await self.dispatcher.slots.resize(limit)
            self.state, self.message = "serving", ""
            self.dispatcher.accepting.set()
            await self._publish()
            if self._restarting is not None:
                await self._event("restarted", f"gpu{self.gpu} now serves {spec.describe()} (generation "
                                  f"{spec.generation}) with {capacity} slots", **self._restarting, capacity=capacity,
                                  generation=spec.generation, strategy=spec.strategy,
                                  downtime_s=round(time.monotonic() - self._restarting["since"], 2))
                self._restarting = None
            try:
                await self._watch_server()
                await self._restart_for_new_spec()
            except ServerDied as exc:
                log.error("gpu%d: %s; restarting it", self.gpu, exc)
                self.state, self.message = "restarting", str(exc).splitlines()[0]
                self.dispatcher.accepting.clear()
                self.server.kill()  # in-flight requests now fail and are handed back untouched
                await self._publish()

    async def _watch_server(self) -> None:
        """Return when the supervisor asks for another server spec; raise ServerDied when the process
        exited or generation is stuck."""
        misses = 0
        last_health = time.monotonic()
        finished_then = self._finished()
        while True:
            await asyncio.sleep(1.0)
            if not self.server.running:
                self.server.check_alive()
            desired = await self._desired_spec()
            if desired.generation != self.server.spec.generation:
                return
            if time.monotonic() - last_health < self.config.health_interval_s:
                continue
            last_health = time.monotonic()
            if self._finished() > finished_then:
                finished_then, misses = self._finished(), 0  # prompts are finishing: it generates
                continue
            try:
                # Nothing finished lately: idle, or stuck. Ask for a real generation.
                await self.server.check_health(self._http, timeout_s=max(20.0, 2 * self.config.health_interval_s))
                misses = 0
            except ServerDied as exc:
                if not self.server.running:
                    raise
                misses += 1  # a busy server may miss once; twice in a row is a hang
                log.warning("gpu%d: health check failed (%d in a row): %s", self.gpu, misses, exc)
                if misses >= 2:
                    raise

    def _finished(self) -> int:
        return self.dispatcher.done + self.dispatcher.failed

    async def _restart_for_new_spec(self) -> None:
        """Drain (in-flight prompts finish up to the deadline, the rest go back to their queue), stop
        the server, and wait until its GPU memory is free, so the next start sees a clean GPU."""
        old = self.server.spec
        since = time.monotonic()
        self.state, self.message = "restarting", "draining for a new server configuration"
        self.dispatcher.accepting.clear()
        await self._publish()
        handed = await self.dispatcher.drain(self.config.shutdown_grace_s)
        await self.server.stop()
        gpu_note = await wait_gpu_free(self.gpu)
        self._restarting = {"since": since, "handed_back": handed, "previous": old.describe(),
                            "previous_generation": old.generation, "gpu": gpu_note}
        log.info("gpu%d: restarting for generation %s: %d prompt(s) handed back; %s", self.gpu,
                 (await self._desired_spec()).generation, handed, gpu_note)

    async def _desired_spec(self) -> ServerSpec:
        """What the supervisor asks of this worker's server; the configuration when it asks nothing."""
        try:
            mine, fleet = await self.r.hmget(self.k.control, Keys.control_worker(self.worker), Keys.CONTROL_FLEET)
        except (redis.RedisError, OSError) as exc:
            # Redis away: keep serving what runs now (or the configuration at first start).
            log.warning("cannot read the desired server spec (%s); keeping the current one", exc)
            return self.server.spec if self.server.running else self._configured_spec()
        for field, raw in (("override", mine), ("fleet", fleet)):
            if not raw:
                continue
            try:
                return ServerSpec.from_json(raw)
            except RecordError as exc:
                # Data, not an instruction: refuse it (once per value), keep what runs now.
                if raw != self._refused_spec:
                    self._refused_spec = raw
                    await self._event("spec_refused", f"gpu{self.gpu}: refused the {field} server spec in "
                                      f"Redis: {exc}; keeping {self.server.spec.describe()}", reason=str(exc))
                return self.server.spec if self.server.running else self._configured_spec()
        return self._configured_spec()

    def _configured_spec(self) -> ServerSpec:
        return ServerSpec(strategy=self.config.strategy, mem_fraction_static=self.config.mem_fraction_static,
                          max_running_requests=self.config.max_running_requests)

    async def _event(self, kind: str, message: str, **data: object) -> None:
        data.pop("since", None)
        event = Event(kind=kind, message=message, source=self.worker, data=data)
        log.info("%s: %s", kind, message)
        try:
            await self.r.xadd(self.k.events, {"e": event.to_json()}, maxlen=keys.EVENTS_MAXLEN, approximate=True)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not record the %s event in Redis: %s", kind, exc)

    async def _publish(self) -> None:
        """Publish the status record now; a Redis outage must not stop the server's life cycle."""
        try:
            await self.publisher.publish()
        except (redis.RedisError, OSError) as exc:
            log.warning("could not publish status: %s", exc)

    async def _open_http(self, capacity: int) -> None:
        if self._http is not None:
            await self._http.aclose()
        # A few connections beyond capacity for health checks and metrics scrapes.
        self._http = sglang.make_client(self.server.url, api_key=self.config.server_api_key,
                                        timeout_s=self.config.request_timeout_s, max_connections=capacity + 4)

    def _server_ok(self) -> bool:
        return self.state == "serving" and self.server.running

    async def _generate(self, prompt: Prompt) -> dict:
        assert self._http is not None
        return await sglang.complete(self._http, prompt.url, prompt.body)

    # --- upkeep: leases, recovery of dead workers' prompts, work stealing order ----------------------
    async def _upkeep(self) -> None:
        period = max(0.5, self.config.lease_ttl_s / 3)
        pattern = re.compile(self.config.queue_pattern)
        while True:
            try:
                await self.ledger.renew()
                recovered = await self.ledger.recover_lapsed()
                if recovered:
                    log.warning("recovered %d prompt(s) from a worker that stopped renewing its leases",
                                len(recovered))
                self._steal_order = await self._queue_order(pattern)
                await self._marker.check(self.r, busy=bool(self.ledger.held) or self._finished() > 0)
            except (redis.RedisError, OSError) as exc:  # Redis hiccup: leases have slack for a missed beat
                log.warning("lease upkeep failed: %s", exc)
            except Exception:
                log.exception("lease upkeep failed")
            await asyncio.sleep(period)

    async def _queue_order(self, pattern: re.Pattern[str]) -> list[str]:
        """Own queue first, then the other GPUs' queues, longest backlog first (work stealing)."""
        names = [m.decode()[len(RQ_QUEUE_PREFIX):] for m in await self.r.smembers(RQ_QUEUES)]
        others = [q for q in names if q != self.queue and pattern.fullmatch(q)]
        if not others:
            return [self.queue]
        async with self.r.pipeline(transaction=False) as pipe:
            for q in others:
                pipe.llen(Keys.queue(q))
            lengths = await pipe.execute()
        ranked = [q for n, q in sorted(zip(lengths, others, strict=True), reverse=True) if n > 0]
        return [self.queue, *ranked]

    # --- status ------------------------------------------------------------------------------------
    async def _status_loop(self) -> None:
        while True:
            try:
                if self._http is not None and self.server.running:
                    self.metrics = await scrape_metrics(self._http)
                    self._note_generated(self.metrics.generation_tokens_total)
                await self.publisher.publish()
                await asyncio.to_thread(self.rq_heartbeat)
            except (redis.RedisError, OSError) as exc:
                log.warning("status publish failed: %s", exc)
            except Exception:
                log.exception("status publish failed")
            await asyncio.sleep(self.config.status_interval_s)

    def _note_generated(self, total: float | None) -> None:
        """Keep ~10 s of the server's generation_tokens_total counter: its slope is the tokens/s the
        GPU produces, smooth and known before the first prompt finishes."""
        now = time.monotonic()
        if total is None or (self._generated and total < self._generated[-1][1]):
            self._generated.clear()  # no counter, or a new server process: start over
        if total is not None:
            self._generated.append((now, total))
        while len(self._generated) > 2 and self._generated[0][0] < now - 10.0:
            self._generated.popleft()

    def tokens_per_s(self) -> float:
        if len(self._generated) >= 2:
            (t0, n0), (t1, n1) = self._generated[0], self._generated[-1]
            if t1 > t0:
                return (n1 - n0) / (t1 - t0)
        return self.dispatcher.tokens_per_s()  # servers without the counter: completions over time

    def snapshot(self) -> WorkerStatus:
        return WorkerStatus(
            worker=self.worker, host=HOST, queue=self.queue, gpu=self.gpu, state=self.state,
            server_url=self.server.url, strategy=self.server.spec.strategy, server_flags=self.server.flags,
            generation=self.server.spec.generation, effective_max=self.server.capacity,
            in_flight=self.dispatcher.in_flight, done=self.dispatcher.done, failed=self.dispatcher.failed,
            tokens_per_s=round(self.tokens_per_s(), 1), metrics=self.metrics, message=self.message)

