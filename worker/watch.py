"""Watching a server that serves: is it alive, stuck, or asked to change? (The keeper's SERVE phase.)

A request that broke without an answer (TROUBLE) makes the watch look at the process at once; a
server whose prompts keep finishing generates; an idle or silent one is asked for a real generation
(`/health_generate`) every `health_interval_s`, and two misses in a row are a hang. A new server spec
asked by the supervisor, or the breaker opening, ends the watch.
"""

from __future__ import annotations

import asyncio
import logging
import time

from batchfleet.config import Config
from batchfleet.errors import ServerDied
from batchfleet.sglang import SGLangClient

from .dispatcher import Dispatcher
from .server import SGLangServer
from .spec import SpecFollower

__all__ = ["ServerWatch"]

log = logging.getLogger("batchfleet.worker")


class ServerWatch:
    def __init__(self, config: Config, server: SGLangServer, dispatcher: Dispatcher, spec: SpecFollower, *,
                 gpu: int) -> None:
        self.config = config
        self.server = server
        self.dispatcher = dispatcher
        self.spec = spec
        self.gpu = gpu

    async def until_change(self, http: SGLangClient | None) -> None:
        """Return when the supervisor asks for another server spec or the breaker opens; raise
        ServerDied when the process exited or generation is stuck."""
        misses = 0
        last_health = time.monotonic()
        finished_then = self._finished()
        while True:
            # a request broke without an answer: has the process exited?
            if await self.dispatcher.gate.until_trouble(1.0):
                await self._settle_exit()
                if self.server.running:
                    self.dispatcher.gate.server_checked()  # alive: claims go on (a hang is judged below)
            if not self.server.running:
                self.server.check_alive()
            desired = await self.spec.desired()
            if desired.generation != self.server.spec.generation or self.dispatcher.judge.breaker.open:
                return
            if time.monotonic() - last_health < self.config.health_interval_s:
                continue
            last_health = time.monotonic()
            if self._finished() > finished_then:
                finished_then, misses = self._finished(), 0  # prompts are finishing: it generates
                continue
            try:
                # Nothing finished lately: idle, or stuck. Ask for a real generation.
                if await self._probe_unless_respecified(http):
                    return
                misses = 0
                self.dispatcher.judge.breaker.success()  # it generates: a prompt failing alone here is at fault
            except ServerDied as exc:
                if not self.server.running:
                    raise
                misses += 1  # a busy server may miss once; twice in a row is a hang
                log.warning("gpu%d: health check failed (%d in a row): %s", self.gpu, misses, exc)
                if misses >= 2:
                    raise

    async def _probe_unless_respecified(self, http: SGLangClient | None) -> bool:
        """The health probe (raises ServerDied), while still following the supervisor: on a full
        server with long generations the probe waits for a free slot, many seconds; a new spec asked
        meanwhile cancels it (True) instead of waiting behind it."""
        probe = asyncio.ensure_future(
            self.server.check_health(http, timeout_s=max(20.0, 2 * self.config.health_interval_s)))
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
        return self.dispatcher.tally.done + self.dispatcher.tally.failed
