"""The server's life, seen from the worker: start it, watch it, restart it when it dies or hangs or
when the supervisor asks for another spec; report each step in the worker's state.

    START ──ready──▶ SERVE ──died/hung──▶ DIED (kill; strikes for the prompts inside) ──▶ START
      │                ├──another spec asked──▶ RESPEC (drain, hand back the rest, stop, GPU free) ──▶ START
      │                └──breaker open──▶ SICK (probe: passes ──▶ SERVE; fails ──▶ hand back, stop ──▶ START)
      ├──could not start──▶ BACKOFF (state "down", reason and log tail published) ──▶ START
      └──could not start N times in a row (or sick N restarts in a row)──▶ FAILED (state "failed", the
         reason from the server's log; no work taken) ──told (`supervisor retry`, a new spec) or after
         failed_retry_s──▶ START

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
from batchfleet.errors import ConfigError, ServerDied, ServerStartError
from batchfleet.records import EventKind, ServerFacts, WorkerState

from .dispatcher import Dispatcher
from .events import EventLog
from .gpu import wait_gpu_free
from .server import SGLangServer
from .slots import surplus_cap
from .spec import SpecFollower
from .watch import ServerWatch

__all__ = ["ServerKeeper", "ServerPhase"]

log = logging.getLogger("batchfleet.worker")

FAILED_POLL_S = 2.0  # how often a failed GPU looks for `supervisor retry` or a new spec
PROBE_PASSES_TRUSTED = 2  # a third passed probe with no prompt succeeding since the first: restart anyway
SICK_RESET_S = 300.0  # a server that served this long before it turned sick starts a new count of sick restarts


async def _no_token() -> bytes | None:
    return None


# An embedding server: the prefill forwards' worth of tokens the worker keeps in it (KvBound doubles it).
EMBED_FORWARDS = 2


def bounding_tokens(facts: ServerFacts | None) -> int | None:
    """The tokens that bound what a server runs at once (`slots.KvBound`): its KV pool; for an embedding
    server (`/model_info` is_generation false) EMBED_FORWARDS prefill forwards' budget, when smaller. An
    embedding is prefill only and finishes in the forward that admits it, a forward takes at most
    `prefill_tokens` new tokens (8192 with embed-0.6b-96gb: ~409 twenty-token documents), and the slots
    (4096 there, from the generation memory formula) and the KV pool (767K tokens) never bind: requests
    past a few forwards only wait in its queue, and cost its scheduler and the worker a connection each
    (docs/design.md, "Embedding servers")."""
    if facts is None:
        return None
    kv = facts.max_total_num_tokens
    if facts.is_generation is False and facts.prefill_tokens:
        budget = EMBED_FORWARDS * facts.prefill_tokens
        return budget if kv is None else min(kv, budget)
    return kv


class ServerPhase(StrEnum):
    """A step of the server's life, as the keeper runs it (the worker's published state is
    `WorkerState`)."""

    START = "start"
    SERVE = "serve"
    DIED = "died"
    RESPEC = "respec"
    BACKOFF = "backoff"
    SICK = "sick"
    FAILED = "failed"


class ServerKeeper:
    def __init__(self, config: Config, server: SGLangServer, dispatcher: Dispatcher, spec: SpecFollower,
                 events: EventLog, *, gpu: int, publish: Callable[[], Awaitable[None]],
                 retry_token: Callable[[], Awaitable[bytes | None]] | None = None) -> None:
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
        self.sick_restarts = 0  # restarts for a sick server (breaker open, probe failed)
        self._sick_in_a_row = 0
        self._serving_since = 0.0
        self._failed_reason = ""
        self._failed_tail = ""
        self._passes_in_a_row = 0  # sick-phase probes that passed with no prompt succeeding between
        self._done_at_pass = -1
        # `supervisor retry`'s token for this GPU (bf:<run>:retry): a change tells a failed GPU to try again
        self.retry_token = retry_token or _no_token
        self._death: ServerDied | None = None
        self._restarting: dict | None = None  # set between a spec-driven stop and the next start
        self._closed = False  # `close` was called: the worker stops, its server is not started again
        self.start_s: float | None = None  # the last start, launch to healthy (published: the restart cost)
        self.drain_s: float | None = None  # the last drain for a new spec, drain + stop (published)
        self.watch = ServerWatch(config, server, dispatcher, spec, gpu=gpu)
        self._phases: dict[ServerPhase, Callable[[], Awaitable[ServerPhase]]] = {
            ServerPhase.START: self._start, ServerPhase.SERVE: self._serve, ServerPhase.DIED: self._died,
            ServerPhase.RESPEC: self._respec, ServerPhase.BACKOFF: self._backoff,
            ServerPhase.SICK: self._sick, ServerPhase.FAILED: self._failed,
        }

    async def run(self) -> None:
        """The server's life, phase after phase, until `close`: a keeper whose task outlived its cancellation
        (redis-py may swallow one that lands inside a command) sees the server `close` stopped as no death to
        restart, and ends."""
        phase = ServerPhase.START
        while not self._closed:
            phase = await self._phases[phase]()

    def serving(self) -> bool:
        return self.state is WorkerState.SERVING and self.server.running

    async def probe(self) -> bool:
        """Does the server generate (`/health_generate`)? For the dispatcher's breaker."""
        if self.http is None or not self.serving():
            return False
        try:
            await self.server.check_health(self.http, timeout_s=20.0)
        except ServerDied:
            return False
        return True

    async def close(self) -> None:
        self._closed = True  # first: the server stopped below is no death to restart
        self.state, self.message = WorkerState.DOWN, self.message or "stopped"
        await self.server.stop()
        if self.http is not None:
            await self.http.aclose()
            self.http = None

    # --- phases ----------------------------------------------------------------------------------
    async def _start(self) -> ServerPhase:
        self.state = WorkerState.STARTING
        spec = await self.spec.desired()
        launched = time.monotonic()
        try:
            capacity = await self.server.start(spec)
        except ServerStartError as exc:
            self._failures += 1
            self.state, self.message = WorkerState.DOWN, str(exc)
            why = str(exc).splitlines()[0]
            log.error("gpu%d: server could not start (%d of %d in a row): %s (its log: %s)", self.gpu, self._failures,
                      self.config.server_start_attempts, why, self.server.log_path)
            await self.publish()
            if self._failures >= self.config.server_start_attempts:
                self._failed_reason = f"{why} ({self._failures} starts failed in a row)"
                self._failed_tail = exc.log_tail
                return ServerPhase.FAILED
            return ServerPhase.BACKOFF
        except ConfigError as exc:
            self.state, self.message = WorkerState.DOWN, f"configuration error: {exc}"
            log.error("gpu%d: %s", self.gpu, self.message)
            await self.publish()
            raise
        self._failures = 0
        self._serving_since = time.monotonic()
        self.dispatcher.judge.breaker.reset()
        self.start_s = round(time.monotonic() - launched, 2)
        await self._open_http(capacity)
        facts = self.server.facts
        self.dispatcher.limit.set_capacity(capacity, max_in_flight=self.config.max_in_flight,
                                           kv_tokens=bounding_tokens(facts))
        self.dispatcher.gate.resume()
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
            await self.watch.until_change(self.http)
        except ServerDied as exc:
            self._death = exc
            return ServerPhase.DIED
        return ServerPhase.SICK if self.dispatcher.judge.breaker.open else ServerPhase.RESPEC

    async def _sick(self) -> ServerPhase:
        """Many different prompts failed in a row here and none succeeded (the breaker opened; the
        dispatcher claims nothing and hands prompts back uncounted). Probe: a server that generates
        serves on (the failures were the prompts'); one that does not is restarted, no prompt struck.
        Sick again and again (`server_start_attempts` restarts in a row): the GPU is marked failed."""
        breaker = self.dispatcher.judge.breaker
        try:
            await self.server.check_health(self.http, timeout_s=20.0)
        except ServerDied as exc:
            probe = str(exc)
        else:
            # Its probe generates. Unless that is all it does: the breaker opening again and again with no
            # prompt succeeding between (only the probe passes) is a sick server too.
            done = self.dispatcher.tally.done
            self._passes_in_a_row = self._passes_in_a_row + 1 if done == self._done_at_pass else 1
            self._done_at_pass = done
            if self._passes_in_a_row < PROBE_PASSES_TRUSTED + 1:
                log.warning("gpu%d: %s, but /health_generate generates: the failures were the prompts'; taking work "
                            "again", self.gpu, self.dispatcher.judge.why)
                breaker.probe_ok()
                self.dispatcher.gate.resume()
                return ServerPhase.SERVE
            probe = (f"its probe passed {self._passes_in_a_row} times in a row while no prompt succeeded: only the "
                     "probe generates")
        self._passes_in_a_row = 0
        if time.monotonic() - self._serving_since > SICK_RESET_S:
            self._sick_in_a_row = 0  # it served well for a long while before this: a new episode
        self._sick_in_a_row += 1
        self.sick_restarts += 1
        reason = f"server sick: {self.dispatcher.judge.why or 'prompts failed'}; then {probe}"
        log.error("gpu%d: %s; restarting it (%d in a row)", self.gpu, reason, self._sick_in_a_row)
        self.state, self.message = WorkerState.RESTARTING, reason
        await self.publish()
        with contextlib.suppress(redis.RedisError, OSError):
            await self.events.emit(EventKind.SERVER_SICK, f"gpu{self.gpu}: {reason}; restarting it",
                                   queue=self.spec.queue, restarts_in_a_row=self._sick_in_a_row)
        # a sick server answers fast
        handed = await self.dispatcher.takeback.drain(min(10.0, self.config.shutdown_grace_s))
        self.server.kill()
        await self.server.stop()
        log.info("gpu%d: sick server stopped; %d prompt(s) handed back", self.gpu, handed)
        if self._sick_in_a_row >= self.config.server_start_attempts:
            self._failed_reason, self._failed_tail = f"{reason} ({self._sick_in_a_row} restarts in a row)", ""
            return ServerPhase.FAILED
        return ServerPhase.START

    async def _failed(self) -> ServerPhase:
        """The GPU cannot serve: say why (status record, event, log), take no work (the dispatcher stays
        paused: its queue is served by the other GPUs' workers), and start again only when told (a new
        `supervisor retry` token, or a new server spec for it) or after `failed_retry_s`."""
        self.dispatcher.gate.pause()
        reason = self._failed_reason
        self.state = WorkerState.FAILED
        self.message = f"{reason}; retrying in {self.config.failed_retry_s:.0f} s or on `supervisor retry`" + (
            f"\n--- server log (tail) ---\n{self._failed_tail}" if self._failed_tail else "")
        log.error("gpu%d: marked failed: %s; taking no work; its queue is served by the other GPUs (retry: "
                  "`supervisor retry %s`, or in %.0f s)", self.gpu, reason, self.spec.queue, self.config.failed_retry_s)
        await self.publish()
        with contextlib.suppress(redis.RedisError, OSError):
            await self.events.emit(EventKind.GPU_FAILED, f"gpu{self.gpu} failed: {reason}", queue=self.spec.queue,
                                   reason=reason)
        token = await self._token()
        generation = (await self.spec.desired()).generation
        until = time.monotonic() + self.config.failed_retry_s
        while time.monotonic() < until:
            await asyncio.sleep(FAILED_POLL_S)
            if await self._token() != token:
                log.info("gpu%d: told to try again (supervisor retry)", self.gpu)
                break
            if (await self.spec.desired()).generation != generation:
                log.info("gpu%d: a new server spec was asked: trying again", self.gpu)
                break
        else:
            log.info("gpu%d: trying again after %.0f s failed", self.gpu, self.config.failed_retry_s)
        self._failures = 0
        self._sick_in_a_row = 0
        self.state, self.message = WorkerState.STARTING, ""
        return ServerPhase.START

    async def _token(self) -> bytes | None:
        try:
            return await self.retry_token()
        except (redis.RedisError, OSError):
            return None

    async def _died(self) -> ServerPhase:
        """The server exited, or hung and is killed now. Stop claiming at once; the prompts that were
        inside it get a strike (see `ledger`); restart."""
        exc = self._death
        assert exc is not None
        self.deaths += 1
        reason = str(exc).splitlines()[0]
        log.error("gpu%d: %s; restarting it", self.gpu, reason)
        self.state, self.message = WorkerState.RESTARTING, reason
        self.dispatcher.gate.pause()
        self.server.kill()  # a hung server must not finish anything now; a dead one is already gone
        await self.publish()
        tail = exc.log_tail or self.server.log_tail()
        with contextlib.suppress(redis.RedisError, OSError):  # said by the ledger; the leases lapse, they rerun
            await self.dispatcher.takeback.server_lost(reason=f"gpu{self.gpu}: {reason}", log_tail=tail)
        return ServerPhase.START

    async def _respec(self) -> ServerPhase:
        """Drain (in-flight prompts finish up to the deadline, the rest go back to their queue), stop
        the server, and wait until its GPU memory is free, so the next start sees a clean GPU."""
        old = self.server.spec
        since = time.monotonic()
        self.state, self.message = WorkerState.RESTARTING, "draining for a new server configuration"
        self.dispatcher.gate.pause()
        await self.publish()
        handed = await self.dispatcher.takeback.drain(self.config.shutdown_grace_s)
        await self.server.stop()
        self.drain_s = round(time.monotonic() - since, 2)
        gpu_note = await wait_gpu_free(self.server.gpus)
        self._restarting = {"since": since, "handed_back": handed, "previous": old.describe(),
                            "previous_generation": old.generation, "gpu": gpu_note}
        log.info("gpu%d: restarting for generation %s: %d prompt(s) handed back; %s", self.gpu,
                 (await self.spec.desired()).generation, handed, gpu_note)
        return ServerPhase.START

    async def _open_http(self, capacity: int) -> None:
        if self.http is not None:
            await self.http.aclose()
        # Capacity + the largest surplus (`slots.InFlightLimit`), and a few more for health checks
        # and metrics scrapes.
        extra = surplus_cap(capacity, self.config.surplus)
        self.http = sglang.make_client(self.server.url, api_key=self.config.server_api_key,
                                       timeout_s=self.config.request_timeout_s,
                                       max_connections=capacity + extra + 4)
