"""Keep one server's slots busy: claim jobs as slots free up, run each as an asyncio task through
the backend, and report outcomes to the ledger.

In flight = the server's effective capacity + a small surplus that waits in the server's own queue
(`set_capacity`; sized by `slots.Turnover` from the measured turnover), so a finished request's slot
is refilled at the server's next step instead of after a round trip to the worker and Redis. A drain
hands the surplus (the prompts sent last: those still queued in the server) back at once, untouched.

Outcomes follow the exception tree in `batchfleet.errors`: a reply is a success; PromptError fails
the prompt once with the server's reason; RetryableError retries with capped exponential backoff
(the slot is given back while it waits); JobRefused refuses a job that is not this run's to run (a
foreign function, a forged or malformed prompt, another run's job): RQ's failed registry, no result.

If the server itself dies, no task hands its prompt back on its own: a task whose request broke
says so (mode TROUBLE), and waits. The server's keeper confirms the death and calls `server_lost`,
which collects every task at once and gives a strike to each prompt that was INSIDE the server
(its request was sent and not answered), atomically in Redis (see `ledger`). The claim loop does
not claim while the server is down, so nothing cycles claim -> fail -> hand back.

A cancelled run (`producer cancel`; the lease keeper sees its flag) is claimed from no more: its
in-flight prompts are dropped (`cancel`: requests cancelled, leases released, nothing published).
A trimmed failed job (its prompt only in the store) that `rq requeue` brought back is handed to the
head, which feeds the prompt again.

The dispatcher's `Mode` says what holds the claim loop back, and only its own methods change it:
`pause`/`resume` (the keeper, around the server's life; the service, when it stops), `drain`,
`cancel`/`uncancel` (the run's flag), `server_checked` (the keeper, after TROUBLE). Each claimed
prompt's `FlightState` says where its request is and who ends it.

A claimed job is NORMAL (runs beside anything), a SUSPECT (one strike) or SOLO (two strikes: the
claim loop stops, the other prompts finish, it runs alone, then the loop resumes). Suspects run in
groups, one group per worker at a time, beside normal work: a worker takes a group (up to
SUSPECT_GROUP_MAX, half its capacity; all its free slots when the queues are dry) only when its
previous group has finished. So a death strikes the suspects of one group at most, and only they go
on to run alone: a poison prompt costs at most three deaths (the one that struck it, its group's,
its own alone), and the innocent prompts a death struck run at the fleet's pace, not one per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum, Flag
from typing import Any, Protocol

import redis

from batchfleet.backoff import backoff_s
from batchfleet.config import Config
from batchfleet.errors import ErrorCode, JobRefused, PromptError, RecordError, RetryableError
from batchfleet.http1 import ConnectFailed
from batchfleet.jobs import ALLOWED
from batchfleet.keys import TRIMMED
from batchfleet.prompts import InvalidPrompt, check_body
from batchfleet.records import Prompt, Result, job_id_for
from batchfleet.redact import Scrubber

from .breaker import Breaker
from .ledger import MAX_STRIKES, Claim, ClaimKind, DeathOutcome, Ledger, parse_job_data
from .redislink import LINK
from .slots import Slots, Turnover, surplus_cap

__all__ = ["REQUEST_ID", "Backend", "Dispatcher", "Flight", "FlightState", "Mode"]

log = logging.getLogger("batchfleet.worker.dispatcher")

# A request that failed with one of these never reached the server (nothing to strike it for): no
# connection could be opened (batchfleet.http1, under batchfleet.sglang's client).
_NOT_SENT = (ConnectFailed,)
LOG_TAIL_CHARS = 4000  # of the server log, in a quarantined prompt's result
# While part of the surplus still waits in the server, the claim loop gathers free slots before it
# claims, until half the surplus is used up or for at most this long: one Redis call for several
# prompts (at 1,000 prompts/s: ~20 instead of ~5; a Redis call costs the worker ~150 µs of CPU).
# The refill delay it adds is measured with the rest (Turnover), so the surplus grows to cover it,
# and where finishes come faster than the surplus can grow (it is at most the capacity), half of it
# triggers the claim sooner: the server's slots never wait for the gathering.
CLAIM_GATHER_S = 0.02
# Suspects (one strike) a worker runs as one group beside normal work; when its queues are dry, a group
# fills its free slots (capacity + surplus). A death while a group runs sends its members to run alone (two strikes):
# the group's size is what such a death costs, and what the struck prompts gain in pace.
SUSPECT_GROUP_MAX = 8
# The SGLang request id (`rid`) of the request the current task is sending: `<job id>-<session>-<attempt>`,
# set by the dispatcher before each call of the backend, which puts it in the request body (SGLang's
# OpenAI endpoints take `rid`). A cancel aborts the request by it (`POST /abort_request`).
REQUEST_ID: ContextVar[str | None] = ContextVar("batchfleet_request_id", default=None)


class Backend(Protocol):
    async def __call__(self, prompt: Prompt) -> dict[str, Any]: ...


class Mode(Flag):
    """What holds the claim loop back; RUNNING (none of it): it claims. The parts have their own
    causes and ends, so several can hold at once (a cancelled run whose server restarts is
    PAUSED | CANCELLED). Changed only by the dispatcher's methods."""

    RUNNING = 0
    # The server does not serve (not started yet, dead, restarting) or the worker stops: no claims,
    # prompts waiting to retry wait too. `pause`, `server_lost`, `drain`; ended by `resume`.
    PAUSED = 1
    # A request got no answer: is the server still there? No claims until the keeper has looked
    # (`server_checked`, or `resume` after a restart), so a dead server does not swallow a stream of
    # new claims. Set by the dispatcher itself.
    TROUBLE = 2
    # A drain is under way (with PAUSED): prompts waiting to retry go back at once. `drain`.
    DRAINING = 4
    # The run was cancelled: claim nothing of it. `cancel`; ended by `uncancel` (its flag went away).
    CANCELLED = 8


class FlightState(Enum):
    """Where a claimed prompt's request stands, and who ends the prompt. Its task holds it while it is
    OUTSIDE or INSIDE (a cancel hands it back); `server_lost` takes it over (COLLECTED...: struck if
    inside, else handed back); a lapsed lease or a cancelled run drops it (LOST); its outcome, or its
    hand back, ends it (SETTLED). Each transition is a method; one that does not apply keeps the state.

        OUTSIDE ──sent──▶ INSIDE ──answered──▶ OUTSIDE          (its task holds it)
           │collected        │collected
           ▼                 ▼
        COLLECTED ──sent──▶ COLLECTED_INSIDE ──answered──▶ COLLECTED   (server_lost holds it)
        OUTSIDE, INSIDE ──lost──▶ LOST                                 (dropped silently)
        any ──settled──▶ SETTLED
    """

    OUTSIDE = "outside"  # nothing of it in the server: not sent yet, answered, or the request never reached it
    INSIDE = "inside"  # its request is (or may still be) inside the server: a death strikes it
    COLLECTED = "collected"  # taken over by `server_lost`, nothing inside: handed back
    COLLECTED_INSIDE = "collected_inside"  # taken over by `server_lost`, inside: struck
    LOST = "lost"  # its lease lapsed (another worker requeued it) or its run was cancelled: dropped
    SETTLED = "settled"  # its outcome is written (or it was handed back): nothing left to do

    # Transitions compare by identity with module-level aliases: an Enum member's hash (a dict
    # lookup) costs more than the bool it replaced, and `sent` runs for every request.
    def sent(self) -> FlightState:
        if self is _OUTSIDE:
            return _INSIDE
        return _COLLECTED_INSIDE if self is _COLLECTED else self

    def answered(self) -> FlightState:
        """The server answered: it holds nothing of this prompt."""
        if self is _INSIDE:
            return _OUTSIDE
        return _COLLECTED if self is _COLLECTED_INSIDE else self

    def unsent(self, before: FlightState) -> FlightState:
        """This attempt never reached the server; an earlier one (`before` it) may have."""
        return self if before.inside else self.answered()

    def collected(self) -> FlightState:
        if self is _OUTSIDE:
            return _COLLECTED
        return _COLLECTED_INSIDE if self is _INSIDE else self

    def lost(self) -> FlightState:
        return _LOST if self is _OUTSIDE or self is _INSIDE else self

    @property
    def inside(self) -> bool:
        return self is _INSIDE or self is _COLLECTED_INSIDE

    @property
    def held_by_task(self) -> bool:
        """Its task ends it: cancelled, the task hands it back."""
        return self is _OUTSIDE or self is _INSIDE


_OUTSIDE, _INSIDE = FlightState.OUTSIDE, FlightState.INSIDE
_COLLECTED, _COLLECTED_INSIDE = FlightState.COLLECTED, FlightState.COLLECTED_INSIDE
_LOST, _SETTLED = FlightState.LOST, FlightState.SETTLED


@dataclass(slots=True, eq=False)
class Flight:
    """One claimed job while this worker holds it."""

    claim: Claim
    prompt: Prompt | None = None
    attempts: int = 0
    state: FlightState = FlightState.OUTSIDE
    sent_at: float = 0.0  # time.monotonic() when its request was last sent
    rid: str = ""  # the SGLang request id of its latest request (REQUEST_ID)
    failed_epoch: int | None = None  # the breaker's epoch at its last failed attempt
    uncounted: int = 0  # attempts that did not count (the server was at fault)

    @property
    def settled(self) -> bool:
        return self.state is _SETTLED


class Dispatcher:
    def __init__(self, ledger: Ledger, backend: Backend, *, config: Config, worker: str,
                 queues: Callable[[], list[str]], server_ok: Callable[[], bool] = lambda: True,
                 clock: Callable[[], float] | None = None,
                 on_completion: Callable[[int], None] = lambda tokens: None,
                 abort: Callable[[list[str]], Awaitable[object]] | None = None,
                 probe: Callable[[], Awaitable[bool]] | None = None) -> None:
        self.ledger = ledger
        self.backend = backend
        self.config = config
        self.worker = worker
        self.queues = queues
        self.server_ok = server_ok
        self.clock = clock or _wall_clock
        self.on_completion = on_completion  # completion tokens of each success (throughput meter)
        self.abort = abort  # aborts requests in the server by their rids (a cancel)
        self.scrub = Scrubber.for_config(config)  # error texts become results, exports and log lines
        self.slots = Slots(0)
        self.capacity = 0  # what the server runs at once (the semaphore admits capacity + surplus)
        self.surplus = 0  # prompts kept waiting in the server's queue on purpose
        self.surplus_max = 0
        self._surplus_auto = False
        self._surplus_checked = 0.0
        self.turnover = Turnover()
        self.tasks: dict[asyncio.Task[None], Flight] = {}
        self._mode = Mode.PAUSED  # until the keeper (or a test) resumes it
        self._mode_changed = asyncio.Event()  # set, and replaced, at each change of mode
        self.done = 0
        self.failed = 0
        self.refused = 0
        self.handed_back = 0
        self.struck = 0
        self.quarantined = 0
        self.dropped = 0  # in-flight prompts dropped because the run was cancelled
        self._group: set[asyncio.Task[None]] = set()  # the group of suspects this worker runs, if any
        self._solo: asyncio.Task[None] | None = None  # the prompt running alone, if any
        self.retry_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # tests swap it out
        self._paused_said = False
        # Whose fault is a failure, the prompt's or the server's (worker.breaker): open, it holds claims
        # (PAUSED) and hands prompts back uncounted until the keeper probes, restarts or closes it.
        self.breaker = Breaker(config.breaker_prompts)
        self.probe = probe or _server_generates  # does the server generate? (the keeper's health probe)
        self._probing: asyncio.Future[bool] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.sick_handed_back = 0  # prompts handed back because the breaker was open
        self.breaker_why = ""  # why it last opened, in words

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    # --- the mode -----------------------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def cancelled(self) -> bool:
        return bool(self._mode & Mode.CANCELLED)

    def _set_mode(self, mode: Mode) -> None:
        if mode is not self._mode:
            self._mode = mode
            self._mode_changed.set()
            self._mode_changed = asyncio.Event()

    async def _until_mode(self, ready: Callable[[Mode], bool], timeout_s: float | None = None) -> bool:
        """Wait until `ready(mode)`, at most `timeout_s` (None: no limit); return `ready(mode)`."""
        if not ready(self._mode):
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                async with asyncio.timeout(timeout_s):
                    while not ready(self._mode):
                        await self._mode_changed.wait()
        return ready(self._mode)

    def pause(self) -> None:
        """Claim nothing, and let prompts waiting to retry wait: the server is not serving, or the
        worker stops."""
        self._set_mode(self._mode | Mode.PAUSED)

    def resume(self) -> None:
        """The server serves (again): claims go on, unless a drain is under way or the run is cancelled.
        A request's trouble before it is over: the server was just (re)started."""
        self._set_mode(self._mode & ~(Mode.PAUSED | Mode.TROUBLE))

    def _report_trouble(self) -> None:
        """A request got no answer: claim nothing more until the keeper has looked at the server."""
        self._set_mode(self._mode | Mode.TROUBLE)

    def server_checked(self) -> None:
        """The keeper looked after TROUBLE and the server is alive: claims may go on."""
        self._set_mode(self._mode & ~Mode.TROUBLE)

    async def until_trouble(self, timeout_s: float) -> bool:
        """For the keeper: wait up to `timeout_s` for a request to get no answer; True while TROUBLE
        holds (until `server_checked` or `resume`)."""
        return await self._until_mode(_in_trouble, timeout_s)

    def uncancel(self) -> None:
        """The run's cancel flag went away (purged): claim from it again."""
        self._set_mode(self._mode & ~Mode.CANCELLED)

    async def set_capacity(self, capacity: int, *, max_in_flight: int | None = None) -> None:
        """Size the semaphore for a server that runs `capacity` requests at once: capacity + surplus;
        or `max_in_flight` alone when the configuration caps below the server (its slots are not all
        used anyway, so a surplus would only raise the cap)."""
        base = min(capacity, max_in_flight or capacity)
        self.capacity = base
        if base < capacity or self.config.surplus == 0:
            self._surplus_auto, self.surplus_max = False, 0
        else:
            self._surplus_auto = self.config.surplus is None
            self.surplus_max = surplus_cap(base, self.config.surplus)
        self.surplus = self.turnover.surplus(time.monotonic(), self.surplus_max) if self._surplus_auto \
            else self.surplus_max
        self.slots.set_limit(base + self.surplus)

    def _resize_surplus(self, now: float) -> None:
        self._surplus_checked = now
        surplus = self.turnover.surplus(now, self.surplus_max)
        if surplus != self.surplus:
            log.debug("surplus %d -> %d (refill %.1f ms)", self.surplus, surplus, self.turnover.refill_s * 1e3)
            self.surplus = surplus
            self.slots.set_limit(self.capacity + surplus)

    # --- the claim loop -------------------------------------------------------------------------------
    async def run(self, *, burst: bool = False) -> None:
        """Claim and start jobs until cancelled (or, in burst mode, until the queues are empty)."""
        dry = 0  # claims in a row that found the queues dry
        redis_failures = 0  # claims in a row that Redis failed
        while True:
            if self._mode and not await self._until_claimable(burst):
                return  # nothing of a cancelled run will come
            if self._solo is not None:  # a prompt runs alone: nothing else until it is done
                await asyncio.wait({self._solo})
                continue
            now = time.monotonic()
            if self._surplus_auto and now - self._surplus_checked > 0.5:
                self._resize_surplus(now)
            if self.surplus:
                await self.slots.acquire_up_to(0)  # a slot is free
                if self.slots.in_use > self.capacity:  # the server still holds some of the surplus:
                    # gather free slots into one claim, until half the surplus is used up (then at
                    # most CLAIM_GATHER_S): the server never runs dry while the worker gathers
                    await self.slots.wait_free(self.surplus - self.surplus // 2, CLAIM_GATHER_S)
            took = await self.slots.acquire_up_to(self.slots.capacity)
            freed_at = self.slots.take_freed_at()
            if self._mode and self._mode & _HELD:  # paused, or in trouble, meanwhile
                self.slots.release(took)
                continue
            if self.ledger.results_backlog > self.config.max_pending_results:
                self.slots.release(took)
                await self._wait_for_collector()
                continue
            try:
                group = 0 if self._group else max(1, min(SUSPECT_GROUP_MAX, self.capacity // 2))
                claims = await self.ledger.claim(took, self.queues(), suspects=group,
                                                 suspects_dry=max(group, self.slots.capacity), take_solo=True)
            except (redis.RedisError, OSError) as exc:
                # Redis restarting or unreachable: in-flight prompts keep running; claim again later.
                self.slots.release(took)
                LINK.lost("claiming work", exc)
                redis_failures += 1
                await asyncio.sleep(backoff_s(redis_failures, base_s=0.5, max_s=10.0))
                continue
            redis_failures = 0
            LINK.ok()  # says "Redis is back" once after an outage
            if claims and self._mode & Mode.CANCELLED:  # the run was cancelled while the claim was on its way
                self.slots.release(took)
                with contextlib.suppress(redis.RedisError, OSError):
                    self.dropped += await self.ledger.drop(claims)
                continue
            if len(claims) < took:
                self.slots.release(took - len(claims))
            for claim in claims:
                self._start(claim)
            if claims:
                if freed_at is not None and dry == 0 and len(claims) == took:
                    self.turnover.refilled(time.monotonic() - freed_at)  # a slot freed -> refilled
                dry = 0
                continue
            if burst and not self.tasks:
                return
            dry += 1
            await asyncio.sleep(backoff_s(dry, base_s=0.02, max_s=0.5))  # queues are dry: poll gently

    async def _until_claimable(self, burst: bool) -> bool:
        """Wait until the mode is RUNNING. False in burst mode when the run is cancelled and nothing is
        in flight."""
        while mode := self._mode:
            if mode & _STOPPED:
                await self._until_mode(_not_stopped)
            elif mode & Mode.TROUBLE:
                # Without a keeper (tests, benchmarks) nobody looks: go on after a while if the server
                # is said to be fine.
                if not await self._until_mode(_checked, 5.0) and self.server_ok():
                    self.server_checked()
            else:  # CANCELLED
                if burst and not self.tasks:
                    return False
                await asyncio.sleep(0.5)
        return True

    def _start(self, claim: Claim) -> None:
        flight = Flight(claim)
        task = asyncio.create_task(self._run_one(flight), name=f"job {claim.jid}")
        self.tasks[task] = flight
        task.add_done_callback(self._reap_task)
        if claim.kind is ClaimKind.SUSPECT:
            self._group.add(task)
        elif claim.kind is ClaimKind.SOLO:
            self._solo = task
            log.warning("prompt %s was inside %d dead servers: running it alone once the %d prompt(s) in flight "
                        "finish", claim.jid, MAX_STRIKES - 1, len(self.tasks) - 1)

    async def _wait_for_collector(self) -> None:
        """Paused: the results stream is too long. Look again (not only when something is flushed,
        which nothing is while paused) until the collector has drained it."""
        if not self._paused_said:
            self._paused_said = True
            log.warning("results stream holds %d entries: is `producer collect` running? pausing until it drains",
                        self.ledger.results_backlog)
        await asyncio.sleep(min(5.0, self.config.status_interval_s))
        try:
            await self.ledger.flush()
            backlog = await self.ledger.refresh_backlog()
        except (redis.RedisError, OSError) as exc:
            LINK.lost("reading the results stream's length", exc)
            return
        if backlog <= self.config.max_pending_results:
            self._paused_said = False
            log.info("results stream down to %d entries: taking work again", backlog)

    def _reap_task(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        self._group.discard(task)
        if task is self._solo:
            self._solo = None
        if not task.cancelled() and task.exception() is not None:
            log.error("job task crashed", exc_info=task.exception())

    # --- one prompt -----------------------------------------------------------------------------------
    async def _run_one(self, flight: Flight) -> None:
        claim = flight.claim
        holding = True  # this task holds one slot, except while it sleeps between attempts
        try:
            prompt = flight.prompt = self._decode(claim)
            if claim.kind is ClaimKind.SOLO:
                me = asyncio.current_task()
                others = [t for t in self.tasks if t is not me]
                if others:
                    await asyncio.wait(others)
            while True:
                flight.attempts += 1
                before = flight.state
                flight.state = before.sent()
                flight.sent_at = time.monotonic()
                flight.rid = f"{claim.jid}-{self.ledger.session}-{flight.attempts}"
                REQUEST_ID.set(flight.rid)
                try:
                    body = await self.backend(prompt)
                except RetryableError as exc:
                    if exc.status_code is None:  # no answer: the server may be gone
                        if isinstance(exc.__cause__, _NOT_SENT):
                            flight.state = flight.state.unsent(before)
                        self._report_trouble()
                    else:
                        flight.state = flight.state.answered()
                    if self._mode & Mode.DRAINING:
                        await self._hand_back(flight)
                        return
                    # 503 is SGLang's "request queue is full": back-pressure, not sickness (the breaker ignores it)
                    if exc.status_code not in (None, 503) and await self._server_at_fault(flight, claim.jid):
                        return
                    # The server is gone: its keeper strikes what was inside and collects us; the
                    # wait for it is not an attempt's backoff.
                    server_gone = exc.status_code is None and not self.server_ok()
                    if not server_gone and flight.attempts - flight.uncounted >= self.config.max_attempts:
                        self._fail(flight, exc.status_code or 0, ErrorCode.RETRIES_EXHAUSTED,
                                   f"{exc} (after {flight.attempts} attempts)", exc.body)
                        return
                    self.slots.release()  # no slot is held while it waits
                    holding = False
                    if not await self._wait_to_retry(flight, 0.0 if server_gone else self._backoff_s(flight.attempts)):
                        return
                    holding = True
                    continue
                except PromptError as exc:
                    self.breaker.success()  # the server answered sanely: the prompt is at fault
                    self._fail(flight, exc.status_code, ErrorCode.INVALID_PROMPT, str(exc), exc.body)
                    return
                self._succeed(flight, body)
                return
        except _Trimmed as exc:
            flight.state = _SETTLED
            log.info("job %s is a failed job brought back by `rq requeue` whose prompt is in the store only: "
                     "the head feeds it again", claim.jid)
            try:
                await self.ledger.refeed(claim, exc.cid)
            except (redis.RedisError, OSError) as err:
                log.warning("could not hand %s to the head (%s): its lease lapses and it comes back", claim.jid, err)
        except JobRefused as exc:
            log.error("refused job %s: %s", claim.jid, exc)
            flight.state = _SETTLED
            self.refused += 1
            self.ledger.refuse(claim, str(exc))
        except asyncio.CancelledError:
            if flight.state.held_by_task:
                await asyncio.shield(self._hand_back(flight))
            raise
        finally:
            if holding:
                self.slots.release()

    async def _server_at_fault(self, flight: Flight, jid: str) -> bool:
        """The server answered this attempt with an error: the breaker judges whose fault it is. True
        when it is (or may be) the server's: the prompt was handed back, its attempt not counted."""
        breaker = self.breaker
        if breaker.failure(jid):
            self._breaker_opened(f"{breaker.threshold} different prompts failed in a row on this server and none "
                                 "succeeded")
        if not breaker.open and not breaker.counts(flight.failed_epoch):
            # It failed here before, and nothing succeeded here since: does the server generate at all?
            if await self._probe_once():
                breaker.probe_ok()  # it does: the failure is the prompt's, and counts
            elif not breaker.open:
                breaker.trip()
                self._breaker_opened("a prompt failed again and the server's own probe failed")
        if breaker.open:
            flight.uncounted += 1
            self.sick_handed_back += 1
            await self._hand_back(flight)
            return True
        flight.failed_epoch = breaker.epoch
        return False

    def _breaker_opened(self, why: str) -> None:
        """The server is at fault: no claims, no steals (PAUSED until the keeper probes, restarts or
        closes the breaker); the prompts waiting to retry go back to their queues, uncounted."""
        self._set_mode(self._mode | Mode.PAUSED)
        self.breaker_why = why
        log.warning("%s: the server is at fault; taking no work and handing prompts back until it is probed", why)
        waiting = [t for t, f in self.tasks.items() if f.state is _OUTSIDE and t is not asyncio.current_task()]
        task = asyncio.get_running_loop().create_task(self._collect(waiting))
        self._background.add(task)  # held: the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)

    async def _probe_once(self) -> bool:
        """The server's probe (the keeper's /health_generate), shared by the prompts that ask at once."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self.probe())
        try:
            return await asyncio.shield(self._probing)
        except Exception:  # a probe that cannot answer says no
            return False

    async def _wait_to_retry(self, flight: Flight, backoff_s: float) -> bool:
        """Between attempts (holding no slot): the backoff, then until the server is up; then a slot
        again -> True. A drain meanwhile hands the prompt back instead -> False."""
        if backoff_s:
            await self.retry_sleep(backoff_s)
        await self._until_server_ok()
        if self._mode & Mode.DRAINING:
            await self._hand_back(flight)
            return False
        await self.slots.acquire()
        return True

    async def _until_server_ok(self) -> None:
        """Wait while the server is down or paused (a death is collected by `server_lost`, which
        cancels this wait; a drain hands the prompt back)."""
        while not (self.server_ok() and not self._mode & Mode.PAUSED) and not self._mode & Mode.DRAINING:
            await asyncio.sleep(0.2)

    def _decode(self, claim: Claim) -> Prompt:
        """The job as data: every field checked as strictly as the producer checks an input line."""
        try:
            func, args, kwargs = parse_job_data(claim.data)
        except Exception as exc:
            raise JobRefused(f"job data is not batchfleet JSON ({type(exc).__name__}: {str(exc)[:100]})") from exc
        if func not in ALLOWED:
            raise JobRefused(f"job function {func[:100]!r} is not on batchfleet's allow-list")
        if len(args) != 1 or kwargs or not isinstance(args[0], dict):
            raise JobRefused("a batchfleet job takes exactly one prompt argument")
        if args[0].get(TRIMMED) is True:  # a failed job trimmed after its result was collected
            run, cid = args[0].get("run"), args[0].get("cid")
            if run == self.config.run and isinstance(cid, str) and claim.jid == job_id_for(run, cid):
                raise _Trimmed(cid)
            raise JobRefused("trimmed job of another run, or whose id is not its custom_id's")
        try:
            prompt = Prompt.from_dict(args[0])
        except (RecordError, KeyError, TypeError, ValueError) as exc:
            raise JobRefused(f"malformed prompt record: {exc}") from exc
        if not prompt.run:
            raise JobRefused("job names no run (batchfleet's producer always writes one): not run")
        if prompt.run != self.config.run:
            # Its result would land in this run's stream and never reach its own export. Loud, and
            # recoverable: `rq requeue` once workers of run {prompt.run} serve this queue.
            raise JobRefused(f"job of run {prompt.run[:60]!r} on a queue served by run {self.config.run!r}: "
                             "give each run queues of its own")
        if claim.jid != job_id_for(prompt.run, prompt.cid):
            raise JobRefused("job id is not the one its run and custom_id give: not written by `producer enqueue`")
        try:
            check_body(prompt.url, prompt.body, size_bytes=len(claim.data))
        except InvalidPrompt as exc:
            raise JobRefused(f"request refused: {exc}") from exc
        return prompt

    def _backoff_s(self, attempt: int) -> float:
        return backoff_s(attempt, base_s=self.config.backoff_base_s, max_s=self.config.backoff_max_s, jitter=True)

    def _succeed(self, flight: Flight, body: dict[str, Any]) -> None:
        assert flight.prompt is not None
        prompt = flight.prompt
        result = Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=200, body=body,
                        worker=self.worker, attempts=flight.attempts, finished_at=self.clock(), fp=prompt.fp)
        flight.state = _SETTLED
        self.done += 1
        self.breaker.success()
        self.turnover.finished(time.monotonic())
        self.on_completion(result.completion_tokens)
        self.ledger.finish(flight.claim, result)

    def _fail(self, flight: Flight, status: int, code: ErrorCode, message: str, body: object = None) -> None:
        """`body`: the server's error answer (JSON), exported as its response body; kept only as an object."""
        assert flight.prompt is not None
        prompt = flight.prompt
        message = self.scrub(message)
        result = Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=status,
                        body=body if isinstance(body, dict) else None, error={"code": code, "message": message},
                        worker=self.worker, attempts=flight.attempts, finished_at=self.clock(), fp=prompt.fp)
        flight.state = _SETTLED
        self.failed += 1
        self.turnover.finished(time.monotonic())
        log.warning("prompt %s failed (%s): %s", result.cid, code, message)
        self.ledger.finish(flight.claim, result, exc_string=f"{code}: {message}")

    async def _hand_back(self, flight: Flight) -> None:
        flight.state = _SETTLED
        try:
            n = await self.ledger.hand_back([flight.claim])
        except (redis.RedisError, OSError) as exc:
            log.warning("could not hand back %s (%s): its lease lapses and it runs again", flight.claim.jid, exc)
            return
        self.handed_back += n

    # --- control ----------------------------------------------------------------------------------------
    async def _collect(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        """Cancel these prompts' tasks and wait until each has ended, its hand back (if any) written."""
        def finishing(task: asyncio.Task[None]) -> bool:
            flight = self.tasks.get(task)
            return flight is not None and flight.settled
        await _cancel_and_wait(tasks, finishing=finishing)

    async def _hand_back_surplus(self) -> None:
        """At a drain, the prompts beyond the server's capacity are (most likely) still waiting in its
        queue: hand them back now, untouched, rather than let them start and stretch the drain. Those
        sent last go first (prompts not inside the server at all before any)."""
        extra = len(self.tasks) - self.capacity
        if not self.capacity or self.slots.capacity <= self.capacity or extra <= 0:
            return
        open_ = [(t, f) for t, f in self.tasks.items() if not f.settled]
        open_.sort(key=lambda tf: tf[1].sent_at if tf[1].state.inside else float("inf"), reverse=True)
        youngest = [t for t, _ in open_[:extra]]
        if youngest:
            await self._collect(youngest)
            log.info("handed back %d surplus prompt(s) waiting in the server", len(youngest))

    async def server_lost(self, *, reason: str, log_tail: str) -> DeathOutcome:
        """The server died (or hung and was killed): stop claiming, take every prompt back from its
        task, and in one atomic call give a strike to each that was inside the server, the rest back
        untouched. A prompt alone in the server at its MAX_STRIKES-th death is quarantined."""
        self.pause()
        flights = list(self.tasks.items())
        for _, flight in flights:
            flight.state = flight.state.collected()
        await self._collect([t for t, _ in flights])
        open_flights = [f for _, f in flights if f.state is _COLLECTED or f.state is _COLLECTED_INSIDE]
        inside = [f for f in open_flights if f.state is _COLLECTED_INSIDE]
        outside = [f.claim for f in open_flights if f.state is _COLLECTED]
        alone = inside[0] if len(inside) == 1 else None
        entries = [(f.claim, self._quarantine_result(f, reason, log_tail) if f is alone else None) for f in inside]
        exc_string = f"{ErrorCode.SERVER_CRASH}: {reason}"
        outcome = await self.ledger.after_server_death(entries, outside, exc_string=exc_string)
        self.struck += outcome.struck
        self.handed_back += outcome.handed_back
        if outcome.quarantined:
            self.quarantined += len(outcome.quarantined)
            self.failed += len(outcome.quarantined)
            for jid in outcome.quarantined:
                cid = alone.prompt.cid if alone is not None and alone.prompt is not None else jid
                log.error("prompt %s quarantined: its server died %d times with it inside, the last time alone",
                          cid, MAX_STRIKES)
        log.warning("server lost with %d prompt(s) in hand: %d struck (inside it), %d handed back, %d quarantined",
                    len(open_flights), outcome.struck, outcome.handed_back, len(outcome.quarantined))
        return outcome

    def _quarantine_result(self, flight: Flight, reason: str, log_tail: str) -> Result | None:
        prompt = flight.prompt
        if prompt is None:
            return None
        tail = self.scrub(log_tail[-LOG_TAIL_CHARS:])
        message = (f"the server died {MAX_STRIKES} times with this prompt inside, the last time with nothing else "
                   f"in it; quarantined, never run again. Last death: {reason}\n--- server log (tail) ---\n{tail}")
        return Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=0,
                      error={"code": ErrorCode.SERVER_CRASH, "message": message}, worker=self.worker,
                      attempts=flight.attempts, finished_at=self.clock(), fp=prompt.fp)

    async def cancel(self) -> int:
        """The run was cancelled: claim nothing more of it; drop every in-flight prompt (`drop`).
        Returns how many."""
        self._set_mode(self._mode | Mode.CANCELLED)
        return await self._drop([(t, f) for t, f in self.tasks.items() if not f.settled])

    async def drop_cancelled(self, jids: Collection[str]) -> int:
        """These prompts were cancelled (`Keys.drop`: a batch, or the whole run): drop those in flight
        here. Returns how many."""
        return await self._drop([(t, f) for t, f in self.tasks.items()
                                 if f.claim.jid in jids and f.state.held_by_task])

    async def _drop(self, flights: list[tuple[asyncio.Task[None], Flight]]) -> int:
        """Stop these prompts now: their tasks are cancelled (their connections close), the server is
        told to abort their requests (`abort`, by rid: SGLang notices a closed connection only seconds
        later), their leases are released and nothing is published for them."""
        for _, flight in flights:
            flight.state = flight.state.lost()
        dropped = [f for _, f in flights if f.state is _LOST]
        inside = [f.rid for f in dropped if f.rid and f.attempts]
        collecting = asyncio.ensure_future(self._collect([t for t, f in flights if f.state is _LOST]))
        if inside and self.abort is not None:
            try:
                await self.abort(inside)
            except Exception as exc:  # the closed connections abort them too, later
                log.warning("could not abort %d request(s) in the server (%s)", len(inside), exc)
        await collecting
        with contextlib.suppress(redis.RedisError, OSError):  # the producer removed their leases already
            await self.ledger.drop([f.claim for f in dropped])
        self.dropped += len(dropped)
        return len(dropped)

    def drop_lost(self, jids: list[str]) -> None:
        """These jobs' leases lapsed and other workers requeued them: stop running them here (their
        results would be refused anyway)."""
        lost = set(jids)
        for task, flight in list(self.tasks.items()):
            if flight.claim.jid in lost and flight.state.held_by_task:
                flight.state = flight.state.lost()
                task.cancel()

    async def drain(self, timeout_s: float) -> int:
        """Stop claiming; let in-flight prompts finish for up to `timeout_s`; hand back the rest.
        Returns how many were handed back."""
        self._set_mode(self._mode | Mode.PAUSED | Mode.DRAINING)
        before = self.handed_back
        try:
            await self._hand_back_surplus()
            pending = list(self.tasks)
            if pending:
                _, still = await asyncio.wait(pending, timeout=timeout_s)
                await self._collect(still)
            await self.ledger.flush()
        finally:
            self._set_mode(self._mode & ~Mode.DRAINING)
        handed = self.handed_back - before
        if handed:
            log.info("handed back %d in-flight prompt(s)", handed)
        return handed


async def _cancel_and_wait(tasks: Iterable[asyncio.Task[None]], *, again_s: float = 1.0,
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


_HELD = Mode.PAUSED | Mode.TROUBLE | Mode.DRAINING  # no claims; CANCELLED drops what a claim brings
_STOPPED = Mode.PAUSED | Mode.DRAINING


def _in_trouble(mode: Mode) -> bool:
    return bool(mode & Mode.TROUBLE)


def _checked(mode: Mode) -> bool:
    return not mode & Mode.TROUBLE


def _not_stopped(mode: Mode) -> bool:
    return not mode & _STOPPED


class _Trimmed(Exception):
    def __init__(self, cid: str) -> None:
        super().__init__(cid)
        self.cid = cid


async def _server_generates() -> bool:
    """Without a keeper (tests, benchmarks): the server is taken to generate."""
    return True


def _wall_clock() -> float:
    return time.time()
