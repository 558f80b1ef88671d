"""Taking prompts back from their tasks, all at once: when the server dies (`server_lost`: a strike
for each prompt that was inside it), when the run or a batch is cancelled (`cancel`,
`drop_cancelled`: dropped, nothing published), when another worker took a lapsed lease over
(`drop_lost`), and when the worker drains (`drain`: in-flight prompts finish for a while, the surplus
and the rest go back to their queues).

If the server dies, no task hands its prompt back on its own: a task whose request broke says so
(TROUBLE) and waits. The keeper confirms the death and calls `server_lost`, which collects every task
at once and, in one atomic Redis call, gives a strike to each prompt that was INSIDE the server (its
request was sent and not answered) and puts the others back untouched (see `ledger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import redis

from batchfleet.errors import ErrorCode

from .flight import Board, Flight, FlightState, Tally
from .ledger import MAX_STRIKES, DeathOutcome, Ledger
from .mode import ModeGate
from .outcomes import Outcomes
from .redislink import LINK
from .server_side import Server
from .slots import InFlightLimit

__all__ = ["Takeback", "cancel_and_wait"]

log = logging.getLogger("batchfleet.worker.dispatcher")

_COLLECTED, _COLLECTED_INSIDE, _LOST = FlightState.COLLECTED, FlightState.COLLECTED_INSIDE, FlightState.LOST


@dataclass(eq=False)
class Takeback:
    """Takes prompts back from the dispatcher's tasks (module doc)."""

    board: Board
    gate: ModeGate
    limit: InFlightLimit
    ledger: Ledger
    outcomes: Outcomes
    tally: Tally
    server: Server

    # hand backs of prompts whose task ended without ending them (`orphaned`), until written
    _orphans: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def collect(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        """Cancel these prompts' tasks and wait until each has ended, its hand back (if any) written."""
        await cancel_and_wait(tasks, finishing=self.board.settled)
        if self._orphans:  # tasks cancelled before their first step: their hand backs are written here
            await asyncio.wait(set(self._orphans))

    def orphaned(self, flight: Flight) -> None:
        """Its task ended and nobody ended the prompt: a task cancelled before its first step never runs
        its coroutine (so neither its own hand back nor its slot's release), or it crashed. Hand it
        back now: its lease would otherwise be renewed for as long as the worker lives, for a prompt
        nobody runs."""
        task = asyncio.ensure_future(self.outcomes.hand_back(flight))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    # --- the server died ----------------------------------------------------------------------------
    async def server_lost(self, *, reason: str, log_tail: str) -> DeathOutcome:
        """The server died (or hung and was killed): stop claiming, take every prompt back from its
        task, and in one atomic call give a strike to each that was inside the server, the rest back
        untouched. A prompt alone in the server at its MAX_STRIKES-th death is quarantined."""
        self.gate.pause()
        flights = list(self.board.tasks.items())
        for _, flight in flights:
            flight.state = flight.state.collected()
        await self.collect([t for t, _ in flights])
        open_flights = [f for _, f in flights if f.state is _COLLECTED or f.state is _COLLECTED_INSIDE]
        inside = [f for f in open_flights if f.state is _COLLECTED_INSIDE]
        outside = [f.claim for f in open_flights if f.state is _COLLECTED]
        alone = inside[0] if len(inside) == 1 else None
        entries = [(f.claim, self.outcomes.quarantine(f, reason, log_tail) if f is alone else None) for f in inside]
        exc_string = f"{ErrorCode.SERVER_CRASH}: {reason}"
        outcome = await self.ledger.after_server_death(entries, outside, exc_string=exc_string)
        tally = self.tally
        tally.struck += outcome.struck
        tally.handed_back += outcome.handed_back
        if outcome.quarantined:
            tally.quarantined += len(outcome.quarantined)
            tally.failed += len(outcome.quarantined)
            for jid in outcome.quarantined:
                cid = alone.prompt.cid if alone is not None and alone.prompt is not None else jid
                log.error("prompt %s quarantined: its server died %d times with it inside, the last time alone",
                          cid, MAX_STRIKES)
        log.warning("server lost with %d prompt(s) in hand: %d struck (inside it), %d handed back, %d quarantined",
                    len(open_flights), outcome.struck, outcome.handed_back, len(outcome.quarantined))
        return outcome

    # --- cancelled, or lost to another worker -------------------------------------------------------
    async def cancel(self) -> int:
        """The run was cancelled: claim nothing more of it; drop every in-flight prompt. Returns how many."""
        self.gate.cancel()
        return await self.drop(self.board.open())

    async def drop_cancelled(self, jids: Collection[str]) -> int:
        """These prompts were cancelled (`Keys.drop`: a batch, or the whole run): drop those in flight
        here. Returns how many."""
        return await self.drop([(t, f) for t, f in self.board.tasks.items()
                                if f.claim.jid in jids and f.state.held_by_task])

    async def drop(self, flights: list[tuple[asyncio.Task[None], Flight]]) -> int:
        """Stop these prompts now: their tasks are cancelled (their connections close), the server is
        told to abort their requests (by rid: SGLang notices a closed connection only seconds later),
        their leases are released and nothing is published for them."""
        for _, flight in flights:
            flight.state = flight.state.lost()
        dropped = [f for _, f in flights if f.state is _LOST]
        inside = [r for f in dropped if f.rid and f.attempts for r in _sent_rids(f)]
        collecting = asyncio.ensure_future(self.collect([t for t, f in flights if f.state is _LOST]))
        client = self.server.client
        if inside and client is not None and self.server.serving():
            try:
                await client.abort(inside)
            except Exception as exc:  # the closed connections abort them too, later
                log.warning("could not abort %d request(s) in the server (%s)", len(inside), exc)
        await collecting
        with contextlib.suppress(redis.RedisError, OSError):  # the producer removed their leases already
            await self.ledger.drop([f.claim for f in dropped])
        self.tally.dropped += len(dropped)
        return len(dropped)

    def drop_lost(self, jids: list[str]) -> None:
        """These jobs' leases lapsed and other workers requeued them: stop running them here (their
        results would be refused anyway)."""
        lost = set(jids)
        for task, flight in list(self.board.tasks.items()):
            if flight.claim.jid in lost and flight.state.held_by_task:
                flight.state = flight.state.lost()
                task.cancel()

    # --- the worker drains --------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> int:
        """Stop claiming; let in-flight prompts finish for up to `timeout_s`; hand back the rest.
        Returns how many were handed back."""
        self.gate.begin_drain()
        before = self.tally.handed_back
        try:
            await self._hand_back_surplus()
            pending = list(self.board.tasks)
            if pending:
                _, still = await asyncio.wait(pending, timeout=timeout_s)
                await self.collect(still)
            try:
                await self.ledger.flush()
            except (redis.RedisError, OSError) as exc:  # the outcomes are kept: the flusher (or the exit) writes them
                LINK.lost("writing outcomes at a drain", exc)
        finally:
            self.gate.end_drain()
        handed = self.tally.handed_back - before
        if handed:
            log.info("handed back %d in-flight prompt(s)", handed)
        return handed

    async def _hand_back_surplus(self) -> None:
        """At a drain, the prompts beyond the server's capacity are (most likely) still waiting in its
        queue: hand them back now, untouched, rather than let them start and stretch the drain. Those
        sent last go first (prompts not inside the server at all before any)."""
        capacity = self.limit.capacity
        extra = len(self.board) - capacity
        if not capacity or self.limit.slots.capacity <= capacity or extra <= 0:
            return
        open_ = self.board.open()
        open_.sort(key=lambda tf: tf[1].sent_at if tf[1].state.inside else float("inf"), reverse=True)
        youngest = [t for t, _ in open_[:extra]]
        if youngest:
            await self.collect(youngest)
            log.info("handed back %d surplus prompt(s) waiting in the server", len(youngest))


async def cancel_and_wait(tasks: Iterable[asyncio.Task[None]], *, again_s: float = 1.0,
                          finishing: Callable[[asyncio.Task[None]], bool] = lambda task: False,
                          finishing_s: float = 30.0) -> None:
    """Cancel these tasks and wait until each has ended. A cancellation can be swallowed (a library
    that turns it into an error of its own: asyncio.wait_for on Python 3.11, redis-py), and the task
    then goes on, maybe waiting for the very server its collector is about to restart: whatever is
    still running after `again_s` is cancelled again, until it ends.

    A task that is `finishing` took its cancellation and is writing its last word to Redis (a hand
    back, under `asyncio.shield`): cancelling it again would only detach that write, and the caller
    would count and log too early. It is left alone for `finishing_s` (more than a Redis command's
    socket timeout), then cancelled again like the rest."""
    pending = {t for t in tasks if not t.done()}
    for task in pending:
        task.cancel()
    waited = 0.0
    while pending:
        _, pending = await asyncio.wait(pending, timeout=again_s)
        waited += again_s
        for task in pending:
            if finishing(task) and waited < finishing_s:
                continue
            log.warning("%s survived its cancellation; cancelling it again", task.get_name())
            task.cancel()


def _sent_rids(flight: Flight) -> list[str]:
    """The request ids its latest request carried: one, or one per input of an embedding batch."""
    sent = flight.prompt.body.get("rid") if flight.prompt is not None else None
    return [str(r) for r in sent] if isinstance(sent, list) else [flight.rid]
