"""The server's life, seen from the worker: start it, watch it, restart it when it dies or hangs or
when the supervisor asks for another spec; report each step in the worker's state.

    START ──ready──▶ SERVE ──died/hung──▶ DIED (kill; strikes for the prompts inside) ──▶ START
      │                └──another spec asked──▶ RESPEC (drain, hand back the rest, stop, GPU free) ──▶ START
      └──could not start──▶ BACKOFF (state "down", reason and log tail published) ──▶ START

Each phase (`ServerPhase`) is a method in a dispatch table that returns the next phase. The keeper
pauses and resumes the dispatcher around the server's life, and tells it when a request's trouble
turned out harmless (`server_checked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum

import redis

from batchfleet import sglang
from batchfleet.backoff import backoff_s
from batchfleet.config import Config
from batchfleet.errors import ConfigError, JobRefused, ServerDied, ServerStartError
from batchfleet.records import ENDPOINTS, EventKind, Prompt, WorkerState

from .dispatcher import Dispatcher
from .events import EventLog
from .gpu import wait_gpu_free
from .server import SGLangServer
from .slots import surplus_cap
from .spec import SpecFollower

__all__ = ["ServerKeeper", "ServerPhase"]

log = logging.getLogger("batchfleet.worker")


class ServerPhase(StrEnum):
    """A step of the server's life, as the keeper runs it (the worker's published state is
    `WorkerState`)."""

    START = "start"
    SERVE = "serve"
    DIED = "died"
    RESPEC = "respec"
    BACKOFF = "backoff"


class ServerKeeper:
    def __init__(self, config: Config, server: SGLangServer, dispatcher: Dispatcher, spec: SpecFollower,
                 events: EventLog, *, gpu: int, publish: Callable[[], Awaitable[None]]) -> None:
        self.config = config
        self.server = server
        self.dispatcher = dispatcher
        self.spec = spec
        self.events = events
        self.gpu = gpu
        self.publish = publish
        self.state = WorkerState.STARTING
        self.message = ""
        self.http: sglang.SGLangClient | None = None
        self.deaths = 0  # server deaths (exits and hangs) while serving
        self._failures = 0  # start failures in a row
        self._death: ServerDied | None = None
        self._restarting: dict | None = None  # set between a spec-driven stop and the next start
        self._phases: dict[ServerPhase, Callable[[], Awaitable[ServerPhase]]] = {
            ServerPhase.START: self._start, ServerPhase.SERVE: self._serve, ServerPhase.DIED: self._died,
            ServerPhase.RESPEC: self._respec, ServerPhase.BACKOFF: self._backoff,
        }

    async def run(self) -> None:
        phase = ServerPhase.START
        while True:
            phase = await self._phases[phase]()

    def serving(self) -> bool:
        return self.state is WorkerState.SERVING and self.server.running

    async def generate(self, prompt: Prompt) -> dict:
        """The dispatcher's backend: one request to this worker's own server, on an endpoint of the
        allow-list only (a relative path: nothing can send the server's key elsewhere)."""
        assert self.http is not None
        if prompt.url not in ENDPOINTS:
            raise JobRefused(f"refusing to send a request to {prompt.url[:100]!r}")
        return await sglang.complete(self.http, prompt.url, prompt.body)

    async def close(self) -> None:
        self.state, self.message = WorkerState.DOWN, self.message or "stopped"
        await self.server.stop()
        if self.http is not None:
            await self.http.aclose()
            self.http = None

    # --- phases ----------------------------------------------------------------------------------
    async def _start(self) -> ServerPhase:
        self.state = WorkerState.STARTING
        spec = await self.spec.desired()
        try:
            capacity = await self.server.start(spec)
        except ServerStartError as exc:
            self._failures += 1
            self.state, self.message = WorkerState.DOWN, str(exc)
            log.error("gpu%d: %s", self.gpu, exc)
            await self.publish()
            return ServerPhase.BACKOFF
        except ConfigError as exc:
            self.state, self.message = WorkerState.DOWN, f"configuration error: {exc}"
            log.error("gpu%d: %s", self.gpu, self.message)
            await self.publish()
            raise
        self._failures = 0
        await self._open_http(capacity)
        await self.dispatcher.set_capacity(capacity, max_in_flight=self.config.max_in_flight)
        self.dispatcher.resume()
        # The event first: whoever sees the status serve the new generation finds its "restarted" event.
        if self._restarting is not None:
            await self.events.emit(EventKind.RESTARTED, f"gpu{self.gpu} now serves {spec.describe()} (generation "
                                   f"{spec.generation}) with {capacity} slots", **self._restarting, capacity=capacity,
                                   generation=spec.generation, strategy=spec.strategy, queue=self.spec.queue,
                                   downtime_s=round(time.monotonic() - self._restarting["since"], 2))
            self._restarting = None
        self.state, self.message = WorkerState.SERVING, ""
        await self.publish()
        return ServerPhase.SERVE

    async def _backoff(self) -> ServerPhase:
        await asyncio.sleep(backoff_s(self._failures, base_s=5.0, max_s=300.0))
        return ServerPhase.START

    async def _serve(self) -> ServerPhase:
        try:
            await self._watch()
        except ServerDied as exc:
            self._death = exc
            return ServerPhase.DIED
        return ServerPhase.RESPEC

    async def _died(self) -> ServerPhase:
        """The server exited, or hung and is killed now. Stop claiming at once; the prompts that were
        inside it get a strike (see `ledger`); restart."""
        exc = self._death
        assert exc is not None
        self.deaths += 1
        reason = str(exc).splitlines()[0]
        log.error("gpu%d: %s; restarting it", self.gpu, reason)
        self.state, self.message = WorkerState.RESTARTING, reason
        self.dispatcher.pause()
        self.server.kill()  # a hung server must not finish anything now; a dead one is already gone
        await self.publish()
        tail = exc.log_tail or self.server.log_tail()
        with contextlib.suppress(redis.RedisError, OSError):  # said by the ledger; the leases lapse, they rerun
            await self.dispatcher.server_lost(reason=reason, log_tail=tail)
        return ServerPhase.START

    async def _respec(self) -> ServerPhase:
        """Drain (in-flight prompts finish up to the deadline, the rest go back to their queue), stop
        the server, and wait until its GPU memory is free, so the next start sees a clean GPU."""
        old = self.server.spec
        since = time.monotonic()
        self.state, self.message = WorkerState.RESTARTING, "draining for a new server configuration"
        self.dispatcher.pause()
        await self.publish()
        handed = await self.dispatcher.drain(self.config.shutdown_grace_s)
        await self.server.stop()
        gpu_note = await wait_gpu_free(self.server.gpus)
        self._restarting = {"since": since, "handed_back": handed, "previous": old.describe(),
                            "previous_generation": old.generation, "gpu": gpu_note}
        log.info("gpu%d: restarting for generation %s: %d prompt(s) handed back; %s", self.gpu,
                 (await self.spec.desired()).generation, handed, gpu_note)
        return ServerPhase.START

    # --- watching --------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Return when the supervisor asks for another server spec; raise ServerDied when the process
        exited or generation is stuck."""
        misses = 0
        last_health = time.monotonic()
        finished_then = self._finished()
        while True:
            if await self.dispatcher.until_trouble(1.0):  # a request broke without an answer: has the process exited?
                await self._settle_exit()
                if self.server.running:
                    self.dispatcher.server_checked()  # alive: claims go on (a hang is judged below)
            if not self.server.running:
                self.server.check_alive()
            desired = await self.spec.desired()
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
                if await self._probe_unless_respecified():
                    return
                misses = 0
            except ServerDied as exc:
                if not self.server.running:
                    raise
                misses += 1  # a busy server may miss once; twice in a row is a hang
                log.warning("gpu%d: health check failed (%d in a row): %s", self.gpu, misses, exc)
                if misses >= 2:
                    raise

    async def _probe_unless_respecified(self) -> bool:
        """The health probe (raises ServerDied), while still following the supervisor: on a full
        server with long generations the probe waits for a free slot, many seconds; a new spec asked
        meanwhile cancels it (True) instead of waiting behind it."""
        probe = asyncio.ensure_future(
            self.server.check_health(self.http, timeout_s=max(20.0, 2 * self.config.health_interval_s)))
        try:
            while True:
                done, _ = await asyncio.wait({probe}, timeout=1.0)
                if done:
                    probe.result()
                    return False
                if (await self.spec.desired()).generation != self.server.spec.generation:
                    return True
        finally:
            if not probe.done():
                probe.cancel()
                await asyncio.wait({probe}, timeout=5)

    async def _settle_exit(self) -> None:
        """A dying process resets its connections a moment before the kernel reports its exit: look
        again for up to a second before judging it alive."""
        for _ in range(20):
            if not self.server.running:
                return
            await asyncio.sleep(0.05)

    def _finished(self) -> int:
        return self.dispatcher.done + self.dispatcher.failed

    async def _open_http(self, capacity: int) -> None:
        if self.http is not None:
            await self.http.aclose()
        # Capacity + the largest surplus (dispatcher.set_capacity), and a few more for health checks
        # and metrics scrapes.
        extra = surplus_cap(capacity, self.config.surplus)
        self.http = sglang.make_client(self.server.url, api_key=self.config.server_api_key,
                                       timeout_s=self.config.request_timeout_s,
                                       max_connections=capacity + extra + 4)
