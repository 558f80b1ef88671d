"""Whose fault is a failed attempt, the prompt's or the server's (`worker.breaker` decides, this
acts on it). Many different prompts failing in a row with nothing succeeding on this server is the
server's fault: the breaker opens, the worker claims nothing (PAUSED until the keeper probes,
restarts or closes it), and the prompts that failed or wait to retry go back to their queues,
uncounted. A prompt that failed here before, with nothing succeeding since, is judged by the server's
own probe: if the server does not generate at all, that is its fault too."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from .breaker import Breaker
from .flight import Board, Flight, FlightState, Tally
from .mode import ModeGate
from .outcomes import Outcomes
from .server_side import Server
from .takeback import Takeback

__all__ = ["Judge"]

log = logging.getLogger("batchfleet.worker.dispatcher")


@dataclass(eq=False)
class Judge:
    """Acts on the breaker's verdicts for the dispatcher's parts it is given."""

    breaker: Breaker
    gate: ModeGate
    server: Server
    board: Board
    takeback: Takeback
    outcomes: Outcomes
    tally: Tally
    why: str = ""  # why the breaker last opened, in words
    _probing: asyncio.Future[bool] | None = field(default=None, init=False)
    _background: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def server_at_fault(self, flight: Flight) -> bool:
        """The server answered this attempt with an error. True when it is (or may be) the server's
        fault: the prompt was handed back, its attempt not counted."""
        breaker = self.breaker
        if breaker.failure(flight.claim.jid):
            self._opened(f"{breaker.threshold} different prompts failed in a row on this server and none succeeded")
        if not breaker.open and not breaker.counts(flight.failed_epoch):
            # It failed here before, and nothing succeeded here since: does the server generate at all?
            if await self._probe_once():
                breaker.probe_ok()  # it does: the failure is the prompt's, and counts
            elif not breaker.open:
                breaker.trip()
                self._opened("a prompt failed again and the server's own probe failed")
        if breaker.open:
            flight.uncounted += 1
            self.tally.sick_handed_back += 1
            await self.outcomes.hand_back(flight)
            return True
        flight.failed_epoch = breaker.epoch
        return False

    def _opened(self, why: str) -> None:
        """No claims, no steals (PAUSED until the keeper probes, restarts or closes the breaker); the
        prompts waiting to retry go back to their queues, uncounted."""
        self.gate.pause()
        self.why = why
        log.warning("%s: the server is at fault; taking no work and handing prompts back until it is probed", why)
        me = asyncio.current_task()
        waiting = [t for t, f in self.board.tasks.items() if f.state is FlightState.OUTSIDE and t is not me]
        task = asyncio.get_running_loop().create_task(self.takeback.collect(waiting))
        self._background.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)

    async def _probe_once(self) -> bool:
        """The server's probe, shared by the prompts that ask at once."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self.server.probe())
        try:
            return await asyncio.shield(self._probing)
        except Exception:  # a probe that cannot answer says no
            return False
