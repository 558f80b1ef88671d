"""One GPU's worker, assembled. Each concern is a small class; the service only wires them and owns
the process's start and stop:

- `ServerKeeper` (keeper.py): the server's life: start, watch, restart on death, hang or new spec;
- `SpecFollower` (spec.py): which server spec the supervisor asks for (bad specs refused);
- `Dispatcher` (dispatcher.py): keeps the server exactly full; `Ledger` (ledger.py): Redis bookkeeping;
- `LeaseKeeper` (leases.py): lease renewal and recovery of dead workers' prompts;
- `DropWatch` (drops.py): cancelled prompts (`Keys.drop`, `Keys.signals`) dropped in flight at once;
- `StealOrder` (steal.py): which queues to take from, own queue first;
- `StatusReporter`, `StatusPublisher` (status.py) and `ThroughputMeter` (meter.py): the status record;
- `EventLog` (events.py) and `Clock` (clock.py).

Stopping: on SIGTERM/SIGINT, or RQ's pubsub `shutdown` command, stop claiming, let in-flight prompts
finish up to the grace period, hand back the rest, stop the server, exit. A signal exits 0; the RQ
command exits EXIT_SHUTDOWN_COMMAND (75, "try again"), so a restart-on-failure policy (systemd)
starts the worker again: through Redis the command can restart a worker, never silently end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import redis.asyncio as aioredis

from batchfleet import sglang
from batchfleet.cliopts import EXIT_CONFIG, EXIT_SHUTDOWN_COMMAND
from batchfleet.config import Config
from batchfleet.connection import redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys
from batchfleet.marker import MarkerWatch
from batchfleet.records import EventKind, WorkerStatus
from batchfleet.redact import Scrubber

from .clock import Clock
from .dispatcher import Dispatcher
from .drops import DropWatch
from .eventloop import where_it_waits
from .events import EventLog
from .flags import server_shape
from .keeper import ServerKeeper
from .leases import LeaseKeeper
from .ledger import Ledger
from .meter import ThroughputMeter
from .redislink import LINK
from .server import SGLangServer
from .spec import SpecFollower
from .status import HOST, StatusPublisher, StatusReporter, gpu_model
from .steal import StealOrder

__all__ = ["GPUService"]

log = logging.getLogger("batchfleet.worker")


class GPUService:
    def __init__(self, config: Config, client: aioredis.Redis, *, worker: str, queue: str, gpu: int,
                 gpus: tuple[int, ...] = (), rq_heartbeat: Callable[[], object] = lambda: None) -> None:
        self.config = config
        self.r = client
        self.k = Keys(config.run)
        LINK.configure(redacted(config.redis_url))
        self.worker = worker
        self.queue = queue
        self.gpu = gpu
        self.clock = Clock(config.test_clock_offset_s)
        self.server = SGLangServer(config, gpu=gpu, gpus=gpus, port=config.port_for(gpu))
        self.ledger = Ledger(client, self.k, worker=worker, lease_ttl_s=config.lease_ttl_s)
        self.meter = ThroughputMeter()
        self.scrub = Scrubber.for_config(config)
        self.events = EventLog(client, self.k, source=worker, clock=self.clock, scrub=self.scrub)
        self.steal = StealOrder(client, self.k, queue=queue, pattern=config.queue_pattern,
                                period_s=max(0.5, min(config.lease_ttl_s / 3, config.status_interval_s)))
        self.dispatcher = Dispatcher(self.ledger, self, config=config, worker=worker, queues=self.steal,
                                     clock=self.clock, on_completion=self.meter.note_completion)
        self.spec = SpecFollower(config, client, self.k, worker=worker, queue=queue, gpu=gpu, events=self.events,
                                 current=lambda: self.server.spec if self.server.running else None)
        self.publisher = StatusPublisher(client, self.k, snapshot=self.snapshot)
        self.reporter = StatusReporter(self.publisher, self.meter, interval_s=config.status_interval_s,
                                       http=lambda: self.keeper.http, server_running=lambda: self.server.running,
                                       rq_heartbeat=rq_heartbeat, gpu=gpu, on_published=self.spec.note_kind)
        self.keeper = ServerKeeper(config, self.server, self.dispatcher, self.spec, self.events, gpu=gpu,
                                   publish=self.reporter.publish_now, retry_token=self._retry_token)
        self._marker = MarkerWatch(self.k, log)  # says so when Redis loses the run's data
        # Cancelled prompts: dropped on the producer's signal, and checked again before each lease renewal
        self.drops = DropWatch(client, self.k, held=lambda: list(self.ledger.held),
                               drop=self.dispatcher.takeback.drop_cancelled, on_check=self._check_cancel)
        self.leases = LeaseKeeper(self.ledger, on_lost=self.dispatcher.takeback.drop_lost,
                                  check_drops=self.drops.check, check_marker=self._check_marker)
        self._acked = False  # this worker acknowledged the run's cancel flag
        self.stop_requested = asyncio.Event()
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._said: list[asyncio.Task[None]] = []

    # --- entry point ----------------------------------------------------------------------------------
    async def run(self, *, burst: bool = False) -> int:
        """Serve until stopped (or, in burst mode, until the queues are empty). Returns an exit code."""
        loop = self._loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        flusher = asyncio.create_task(self.ledger.run_flusher())
        others = [asyncio.create_task(c) for c in (self.leases.run(), self.steal.run(), self.reporter.run(),
                                                   self.drops.run())]
        serving = asyncio.create_task(self.keeper.run())
        claiming = asyncio.create_task(self.dispatcher.run(burst=burst))
        stop = asyncio.create_task(self.stop_requested.wait())
        code = 0
        config_error: ConfigError | None = None
        try:
            done, _ = await asyncio.wait({serving, claiming, stop}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = None if t is stop else t.exception()
                if isinstance(exc, ConfigError):  # a person must fix it: one line, no traceback, exit 2
                    config_error, code = exc, EXIT_CONFIG
                    log.error("gpu%d: configuration error: %s; exiting %d", self.gpu, exc, code)
                elif exc is not None:
                    log.error("worker stopping on an unexpected error", exc_info=exc)
                    code = 1
        finally:
            handed = await self.dispatcher.takeback.drain(self.config.shutdown_grace_s)
            for t in (serving, claiming, stop):
                t.cancel()
            await asyncio.wait([serving, claiming, stop], timeout=10)
            for t, what in ((serving, "server keeper"), (claiming, "claim loop")):
                if not t.done():  # a cancellation swallowed somewhere: say where, for whoever reads the log
                    log.warning("gpu%d: the %s did not end within 10 s of its cancellation; it waits in %s", self.gpu,
                                what, where_it_waits(t))
            self.keeper.message = (f"configuration error: {config_error} (the worker exited {EXIT_CONFIG})"
                                   if config_error else f"stopped ({handed} prompt(s) handed back)")
            await self.keeper.close()
            if self._said:
                await asyncio.wait(self._said, timeout=5)
            self.ledger.close()
            for t in others:
                t.cancel()
            # Bounded waits: redis-py may swallow a cancellation that lands inside a command.
            await asyncio.wait([flusher], timeout=10)
            flusher.cancel()  # still retrying (Redis away): the last write is the next line's, and it says so
            await asyncio.wait(others, timeout=5)
            await asyncio.wait([flusher], timeout=5)
            await self.ledger.write_out(within_s=self.config.lease_ttl_s / 2)
            with contextlib.suppress(Exception):
                if config_error is None:
                    await self.publisher.forget(self.worker)
                else:  # the DOWN record and its reason stay until they expire: `producer status` shows them
                    await self.reporter.publish_now()
            t = self.dispatcher.tally
            log.info("worker %s stopped: %d done, %d failed, %d refused, %d handed back, %d struck, %d quarantined, "
                     "%d server death(s), %d sick restart(s)", self.worker, t.done, t.failed, t.refused, t.handed_back,
                     t.struck, t.quarantined, self.keeper.deaths, self.keeper.sick_restarts)
        return code or self.exit_code

    def _on_signal(self, sig: signal.Signals) -> None:
        self._stop(f"{signal.Signals(sig).name}", 0)

    def request_stop(self, reason: str, code: int = EXIT_SHUTDOWN_COMMAND) -> None:
        """Thread-safe (RQ's pubsub thread calls it): drain and exit with `code`."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, reason, code)

    def _stop(self, reason: str, code: int) -> None:
        if self.stop_requested.is_set():
            return
        log.info("%s: stop taking work; finishing in-flight prompts for up to %.0f s, then exit %d",
                 reason, self.config.shutdown_grace_s, code)
        if code:
            self._said.append(asyncio.create_task(self.events.emit(
                EventKind.SHUTDOWN_COMMAND, f"gpu{self.gpu}: {reason}: draining, then exiting {code} (to be restarted)",
                exit_code=code)))
        self.exit_code = code
        self.dispatcher.gate.pause()
        self.stop_requested.set()

    # --- wiring ----------------------------------------------------------------------------------------
    async def _check_cancel(self, dropped: int = 0) -> None:
        """After the drop check (`DropWatch`, which dropped `dropped` cancelled prompts in flight): if
        `producer cancel` raised the run's flag, drop the rest of the run's in-flight prompts, claim no
        more, say so in one line and acknowledge (`ack:<worker>` = prompts dropped). A flag that goes
        away (purge) lifts it."""
        gate = self.dispatcher.gate
        if await self.r.hget(self.k.cancel, "at") is None:
            if gate.cancelled:
                gate.uncancel()
                self._acked = False
                log.warning("run %s is no longer cancelled (its flag %s is gone): taking work again",
                            self.k.run, self.k.cancel)
            elif dropped:  # a part of the run (a `batchfleet serve` batch) was cancelled
                log.warning("run %s: %d cancelled prompt(s) dropped in flight", self.k.run, dropped)
            return
        first = not gate.cancelled
        dropped += await self.dispatcher.takeback.cancel()
        if first:
            log.warning("run %s cancelled: dropped %d in flight", self.k.run, dropped)
        elif dropped:
            log.warning("run %s cancelled: dropped %d more in flight", self.k.run, dropped)
        if dropped or not self._acked:
            await self.r.hincrby(self.k.cancel, Keys.CANCEL_ACK_PREFIX + self.worker, dropped)
            self._acked = True

    async def _check_marker(self) -> None:
        tally = self.dispatcher.tally
        await self._marker.check(self.r, busy=bool(self.ledger.held) or tally.done + tally.failed > 0)

    async def _retry_token(self) -> bytes | None:
        """`supervisor retry`'s token for this worker's queue (a change: a failed GPU tries again)."""
        return await self.r.hget(self.k.retry, self.queue)

    # --- the dispatcher's server (`server_side.Server`): the keeper's ---------------------------------
    @property
    def client(self) -> sglang.SGLangClient | None:
        return self.keeper.http

    def serving(self) -> bool:
        return self.keeper.serving()

    async def probe(self) -> bool:
        return await self.keeper.probe()

    @property
    def is_generation(self) -> bool | None:
        facts = self.server.facts
        return facts.is_generation if facts is not None else None

    def snapshot(self) -> WorkerStatus:
        return WorkerStatus(
            worker=self.worker, host=HOST, queue=self.queue, gpu=self.gpu, state=self.keeper.state,
            server_url=self.server.url, strategy=self.server.spec.strategy, server_flags=self.server.flags,
            generation=self.server.spec.generation, effective_max=self.server.capacity,
            slots=self.dispatcher.limit.slots.capacity, surplus=self.dispatcher.limit.surplus,
            facts=self.server.facts, in_flight=self.dispatcher.in_flight, done=self.dispatcher.tally.done,
            failed=self.dispatcher.tally.failed,
            tokens_per_s=round(self.meter.tokens_per_s(), 1), metrics=self.reporter.metrics,
            message=self.scrub(self.keeper.message), ts=self.clock(),
            shape=server_shape(self.server.flags or self.config.server_argv_extra), start_s=self.keeper.start_s,
            drain_s=self.keeper.drain_s, **gpu_model(self.gpu))
