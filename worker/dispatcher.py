"""Keep one server's slots busy: claim jobs as slots free up and run each as an asyncio task.

The claim loop (`Dispatcher.run`) is the whole of this module; each concern is a part of its own:

- `mode.ModeGate`: what holds the loop back (paused, in trouble, draining, cancelled); only its
  methods change it (the keeper, around the server's life; the service, when it stops);
- `slots.InFlightLimit`: how many prompts it keeps in the server: the server's effective capacity +
  a small surplus that waits in the server's own queue, sized from the measured turnover;
- `flight.Board`: the prompts in hand, each its task and its `Flight`; `flight.Tally`: their figures;
- `runner.PromptRunner`: one prompt from claim to outcome (retries, the breaker's `judge.Judge`);
- `outcomes.Outcomes`: a result, a hand back or a refusal, written through the `ledger.Ledger`;
- `takeback.Takeback`: prompts taken back at once: a server death (strikes), a cancel, a drain.

Of the prompts one claim brings, each plan unit's first goes out before the units' seconds, and so on
(`leaders_first`): the later ones then find the shared prefix in the server's radix cache.

A claimed job is NORMAL (runs beside anything), a SUSPECT (one strike) or SOLO (two strikes: the
loop stops, the other prompts finish, it runs alone, then the loop resumes). Suspects run in groups,
one group per worker at a time, beside normal work: a worker takes a group (up to SUSPECT_GROUP_MAX,
half its capacity; all its free slots when the queues are dry) only when its previous group has
finished. So a death strikes the suspects of one group at most, and only they go on to run alone: a
poison prompt costs at most three deaths (the one that struck it, its group's, its own alone), and
the innocent prompts a death struck run at the fleet's pace, not one per worker.

A cancelled run (`producer cancel`) is claimed from no more: what a claim brings back anyway is
dropped. The loop does not claim while the server is down, so nothing cycles claim -> fail -> hand
back; nor while the results stream is longer than the collector can keep up with: more entries than
`max_pending_results`, or about more bytes than `max_pending_result_bytes` (its length x this worker's
mean result size: an embedding result is ~20 KB a 1024-dimension input, and Redis holds them in memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import redis

from batchfleet.backoff import backoff_s
from batchfleet.config import Config
from batchfleet.redact import Scrubber

from .breaker import Breaker
from .flight import Board, Flight, Tally
from .judge import Judge
from .ledger import MAX_STRIKES, Claim, ClaimKind, Ledger
from .mode import HELD, STOPPED, Mode, ModeGate
from .outcomes import Outcomes
from .redislink import LINK
from .runner import PromptRunner
from .server_side import Server
from .slots import InFlightLimit
from .steal import ClaimOrder
from .takeback import Takeback

__all__ = ["CLAIM_GATHER_S", "SUSPECT_GROUP_MAX", "Dispatcher", "leaders_first"]

log = logging.getLogger("batchfleet.worker.dispatcher")

# While part of the surplus still waits in the server, the claim loop gathers free slots before it
# claims, until half the surplus is used up or for at most this long: one Redis call for several
# prompts (at 1,000 prompts/s: ~20 instead of ~5; a Redis call costs the worker ~150 us of CPU).
# The refill delay it adds is measured with the rest (Turnover), so the surplus grows to cover it,
# and where finishes come faster than the surplus can grow (it is at most the capacity), half of it
# triggers the claim sooner: the server's slots never wait for the gathering.
CLAIM_GATHER_S = 0.02
# Suspects (one strike) a worker runs as one group beside normal work; when its queues are dry, a group
# fills its free slots (capacity + surplus). A death while a group runs sends its members to run alone
# (two strikes): the group's size is what such a death costs, and what the struck prompts gain in pace.
SUSPECT_GROUP_MAX = 8
# `leaders_first`: the first prompts of a block of units, about 4 prefill batches (SGLang's default
# --max-prefill-tokens is 16,384 tokens; ~4 bytes a token).
LEADERS_BLOCK_BYTES = 256 * 1024
MIB = 1024 * 1024


class Dispatcher:
    def __init__(self, ledger: Ledger, server: Server, *, config: Config, worker: str,
                 queues: Callable[[], ClaimOrder], clock: Callable[[], float],
                 on_completion: Callable[[int], None]) -> None:
        self.ledger = ledger
        self.server = server
        self.config = config
        self.queues = queues  # the queues to claim from, in order (own queue first: `steal.StealOrder`)
        self.gate = ModeGate()
        self.limit = InFlightLimit(config.surplus)
        self.board = Board()
        self.tally = Tally()
        breaker = Breaker(config.breaker_prompts)
        self.outcomes = Outcomes(ledger, self.tally, worker=worker, clock=clock, scrub=Scrubber.for_config(config),
                                 breaker=breaker, turnover=self.limit.turnover, on_completion=on_completion,
                                 on_prompt_tokens=self.limit.kv.measured)
        self.takeback = Takeback(self.board, self.gate, self.limit, ledger, self.outcomes, self.tally, server)
        self.judge = Judge(breaker, self.gate, server, self.board, self.takeback, self.outcomes, self.tally)
        self.runner = PromptRunner(config, ledger, server, self.board, self.gate, self.limit.slots, self.outcomes,
                                   self.judge)
        self._collector_said = False

    @property
    def in_flight(self) -> int:
        return len(self.board)

    # --- the claim loop -------------------------------------------------------------------------------
    async def run(self, *, burst: bool = False) -> None:
        """Claim and start jobs until cancelled (or, in burst mode, until the queues are empty)."""
        dry = 0  # claims in a row that found the queues dry
        redis_failures = 0  # claims in a row that Redis failed
        slots = self.limit.slots
        while True:
            if self.gate.mode and not await self._until_claimable(burst):
                return  # nothing of a cancelled run will come
            if self.board.solo is not None:  # a prompt runs alone: nothing else until it is done
                await asyncio.wait({self.board.solo})
                continue
            took, freed_at = await self._free_slots()
            if self.gate.mode & HELD or self._collector_behind():
                slots.release(took)
                if not self.gate.mode & HELD:
                    await self._wait_for_collector()
                continue
            try:
                claims = await self._claim(took)
            except (redis.RedisError, OSError) as exc:  # Redis away: in-flight prompts keep running
                slots.release(took)
                LINK.lost("claiming work", exc)
                redis_failures += 1
                await asyncio.sleep(backoff_s(redis_failures, base_s=0.5, max_s=10.0))
                continue
            redis_failures = 0
            LINK.ok()  # says "Redis is back" once after an outage
            if claims and self.gate.cancelled:  # the run was cancelled while the claim was on its way
                slots.release(took)
                with contextlib.suppress(redis.RedisError, OSError):
                    self.tally.dropped += await self.ledger.drop(claims)
                continue
            if len(claims) < took:
                slots.release(took - len(claims))
            self.limit.claimed([len(c.data) for c in claims])
            for claim in leaders_first(claims):
                self._start(claim)
            if claims:
                if freed_at is not None and dry == 0 and len(claims) == took:
                    self.limit.turnover.refilled(time.monotonic() - freed_at)  # a slot freed -> refilled
                dry = 0
                continue
            if burst and not self.board.tasks:
                return
            dry += 1
            await asyncio.sleep(backoff_s(dry, base_s=0.02, max_s=0.5))  # queues are dry: poll gently

    async def _free_slots(self) -> tuple[int, float | None]:
        """Wait for free slots and take them: (how many, when the first of them was freed). While the
        server still holds part of the surplus, gather free slots into one claim until half the surplus
        is used up (then at most CLAIM_GATHER_S): the server never runs dry while the worker gathers."""
        limit = self.limit
        limit.follow_turnover(time.monotonic())
        slots = limit.slots
        if limit.surplus:
            await slots.wait_one_free()
            if limit.beyond_capacity > 0:
                await slots.wait_free(limit.surplus - limit.surplus // 2, CLAIM_GATHER_S)
        took = await slots.acquire_up_to(slots.capacity)
        return took, slots.take_freed_at()

    async def _claim(self, n: int) -> list[Claim]:
        """Up to `n` jobs: a prompt that must run alone if one waits, else a group of suspects when none
        runs here (grown into free slots when the queues are dry), then the queues in order."""
        group = 0 if self.board.group else max(1, min(SUSPECT_GROUP_MAX, self.limit.capacity // 2))
        order = self.queues()
        return await self.ledger.claim(n, order.queues, keep=order.keep, suspects=group,
                                       suspects_dry=max(group, self.limit.slots.capacity), take_solo=True)

    def _start(self, claim: Claim) -> None:
        flight = Flight(claim)
        task = asyncio.create_task(self.runner.run(flight), name=f"job {claim.jid}")
        self.board.add(task, flight)
        task.add_done_callback(self._reap)
        if claim.kind is ClaimKind.SOLO:
            log.warning("prompt %s was inside %d dead servers: running it alone once the %d prompt(s) in flight "
                        "finish", claim.jid, MAX_STRIKES - 1, len(self.board) - 1)

    def _reap(self, task: asyncio.Task[None]) -> None:
        flight = self.board.tasks.get(task)
        self.board.remove(task)
        if flight is not None:
            if flight.holds_slot:  # its `finally` never ran: cancelled before its first step
                flight.holds_slot = False
                self.limit.slots.release()
            if flight.state.held_by_task:  # ended, and nobody ended its prompt
                self.takeback.orphaned(flight)
        if not task.cancelled() and task.exception() is not None:
            log.error("job task crashed", exc_info=task.exception())

    async def _until_claimable(self, burst: bool) -> bool:
        """Wait until the mode is RUNNING. False in burst mode when the run is cancelled and nothing is
        in flight."""
        gate = self.gate
        while mode := gate.mode:
            if mode & STOPPED:
                await gate.until(_not_stopped)
            elif mode & Mode.TROUBLE:
                # Without a keeper nobody looks: go on after a while if the server is said to be fine.
                if not await gate.until(_checked, 5.0) and self.server.serving():
                    gate.server_checked()
            else:  # CANCELLED
                if burst and not self.board.tasks:
                    return False
                await asyncio.sleep(0.5)
        return True

    def _collector_behind(self) -> bool:
        """Does the results stream hold more than the collector should let wait: more entries than
        `max_pending_results`, or about more bytes than `max_pending_result_bytes`?"""
        ledger, config = self.ledger, self.config
        return (ledger.results_backlog > config.max_pending_results
                or ledger.backlog_bytes > config.max_pending_result_bytes)

    async def _wait_for_collector(self) -> None:
        """The results stream is too long. Look again (not only when something is flushed, which nothing
        is while waiting) until the collector has drained it."""
        ledger = self.ledger
        if not self._collector_said:
            self._collector_said = True
            log.warning("results stream holds %d entries (~%.1f MiB of results): is `producer collect` running? "
                        "pausing until it drains", ledger.results_backlog, ledger.backlog_bytes / MIB)
        await asyncio.sleep(min(5.0, self.config.status_interval_s))
        try:
            await ledger.flush()
            backlog = await ledger.refresh_backlog()
        except (redis.RedisError, OSError) as exc:
            LINK.lost("reading the results stream's length", exc)
            return
        if not self._collector_behind():
            self._collector_said = False
            log.info("results stream down to %d entries (~%.1f MiB): taking work again", backlog,
                     ledger.backlog_bytes / MIB)


def leaders_first(claims: list[Claim]) -> list[Claim]:
    """The claims in the order their requests go out: units taken in blocks (in the claim's order, a
    block closing once its units' first prompts hold LEADERS_BLOCK_BYTES), and within a block each
    unit's first, then each unit's second, and so on. A server matches a request against its radix
    cache when it schedules its prefill, and requests prefilled in one batch do not see each other's
    prefix: sent one after the other, a unit's prompts would share the prefill batch of their first and
    all compute the shared prefix. Blocks keep a unit's later prompts close behind its first: a server
    that queues hundreds of requests (its KV pool holds fewer than it has slots for) would otherwise
    take every unit's first before any second, and evict the first prefixes before their seconds
    come. Units that continue one prefix on this queue (a template's prompts cut into units: `grp`
    `<unit>/<family>`) are one family: one leader for all of them."""
    if len(claims) < 2 or not any(c.grp for c in claims):
        return claims
    block_of: dict[bytes, int] = {}
    seen: dict[bytes, int] = {}
    block, filled = 0, 0
    rank = []
    for i, c in enumerate(claims):
        if not c.grp:
            rank.append((block, 0, i))
            continue
        b = block_of.get(c.grp)
        if b is None:
            if filled >= LEADERS_BLOCK_BYTES:
                block, filled = block + 1, 0
            b = block_of[c.grp] = block
            filled += len(c.data)
        family = c.grp.rpartition(b"/")[2]
        k = seen.get(family, 0)
        seen[family] = k + 1
        rank.append((b, k, i))
    return [claims[i] for *_, i in sorted(rank)]


def _checked(mode: Mode) -> bool:
    return not mode & Mode.TROUBLE


def _not_stopped(mode: Mode) -> bool:
    return not mode & STOPPED
