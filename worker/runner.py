"""One claimed prompt, from its claim to its outcome: read it (`batchfleet.jobs.read_job`), send it to the server,
retry what may succeed later, and write how it ended (`outcomes`).

Outcomes follow the exception tree in `batchfleet.errors`: a reply is a success; PromptError fails the
prompt once with the server's reason; RetryableError retries with capped exponential backoff (the
slot is given back while it waits), unless the server is at fault (`judge`: handed back, uncounted)
or gone (its keeper strikes what was inside and collects this task); JobRefused refuses a job that is
not this run's to run (RQ's failed registry, no result). A prompt with two strikes (SOLO) waits until
the others in flight have finished, then runs alone.

Each request carries the SGLang request id `<job id>-<session>-<attempt>` (`rid`, which SGLang's
OpenAI endpoints take), so a cancel can abort it in the server; a shared fleet's high-priority prompt
also its `priority`, when its server schedules by priority (BATCHFLEET_PRIORITY_SCHEDULING).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from batchfleet.backoff import backoff_s
from batchfleet.config import Config
from batchfleet.errors import ErrorCode, JobRefused, PromptError, RetryableError
from batchfleet.http1 import ConnectFailed
from batchfleet.jobs import Trimmed, read_job
from batchfleet.prompts import EMBEDDINGS, kind_mismatch

from .flight import Board, Flight, FlightState
from .judge import Judge
from .ledger import ClaimKind, Ledger
from .mode import ModeGate
from .outcomes import Outcomes
from .server_side import Server
from .slots import Slots

__all__ = ["PromptRunner"]

log = logging.getLogger("batchfleet.worker.dispatcher")

_SETTLED = FlightState.SETTLED


class PromptRunner:
    def __init__(self, config: Config, ledger: Ledger, server: Server, board: Board, gate: ModeGate, slots: Slots,
                 outcomes: Outcomes, judge: Judge) -> None:
        self.config = config
        self.run_name = config.run
        # its server orders its waiting queue by request priority (started so, or asked in its arguments)
        self.priority = config.priority_scheduling or "--enable-priority-scheduling" in config.server_argv_extra
        self.ledger = ledger
        self.server = server
        self.board = board
        self.gate = gate
        self.slots = slots
        self.outcomes = outcomes
        self.judge = judge
        self._wrong_kind_said = False

    def _wrong_kind(self, flight: Flight) -> bool:
        """The prompt asks what its server cannot do (an embedding on a generation server, or the other
        way round; a chat request would kill an embedding server at its first decode): failed, never
        sent. Said once in the log; the head fails the rest of such a run at once (producer.head)."""
        prompt = flight.prompt
        assert prompt is not None
        reason = kind_mismatch(prompt.url, self.server.is_generation)
        if reason is None:
            return False
        if not self._wrong_kind_said:
            self._wrong_kind_said = True
            log.error("prompt %s not sent: %s (this worker fails such prompts without sending them)",
                      prompt.cid, reason)
        self.outcomes.fail(flight, 0, ErrorCode.WRONG_KIND, reason, quiet=True)
        return True

    async def run(self, flight: Flight) -> None:
        """The task of one claimed prompt; it holds one slot, except while it waits to retry."""
        claim = flight.claim
        try:
            prompt = flight.prompt = read_job(claim.jid, claim.data, self.run_name)
            if claim.kind is ClaimKind.SOLO:
                me = asyncio.current_task()
                others = [t for t in self.board.tasks if t is not me]
                if others:
                    await asyncio.wait(others)
            while True:
                if self._wrong_kind(flight):  # checked before each attempt: a restart may bring another server
                    return
                flight.attempts += 1
                earlier = flight.state
                flight.state = earlier.sent()
                flight.sent_at = time.monotonic()
                rid = flight.rid = f"{claim.jid}-{self.ledger.session}-{flight.attempts}"
                # the body is this flight's own (decoded from its job); an embedding of several inputs
                # takes one rid per input (0.5.23 asserts a list)
                prompt.body["rid"] = _rids(rid, prompt.body["input"]) if prompt.url == EMBEDDINGS else rid
                if prompt.pri and self.priority:
                    prompt.body["priority"] = prompt.pri  # ahead of the server's waiting queue
                try:
                    client = self.server.client
                    if client is None:
                        raise RetryableError("no server serves yet") from ConnectFailed("no server")
                    if prompt.url == EMBEDDINGS:  # its vectors travel on as the server wrote them
                        body, raw = await client.complete_raw(prompt.url, prompt.body)
                    else:
                        body, raw = await client.complete(prompt.url, prompt.body), None
                except RetryableError as exc:
                    if not await self._again(flight, earlier, exc):
                        return
                    continue
                except PromptError as exc:
                    self.judge.breaker.success()  # the server answered sanely: the prompt is at fault
                    self.outcomes.fail(flight, exc.status_code, ErrorCode.INVALID_PROMPT, str(exc), exc.body)
                    return
                self.outcomes.succeed(flight, body, raw)
                return
        except Trimmed as exc:
            flight.state = _SETTLED
            log.info("job %s is a failed job brought back by `rq requeue` whose prompt is in the store only: "
                     "the head feeds it again", claim.jid)
            try:
                await self.ledger.refeed(claim, exc.cid)
            except (redis.RedisError, OSError) as err:
                log.warning("could not hand %s to the head (%s): its lease lapses and it comes back", claim.jid, err)
        except JobRefused as exc:
            self.outcomes.refuse(flight, str(exc))
        except asyncio.CancelledError:
            if flight.state.held_by_task:
                await asyncio.shield(self.outcomes.hand_back(flight))
            raise
        finally:
            if flight.holds_slot:
                flight.holds_slot = False
                self.slots.release()

    async def _again(self, flight: Flight, earlier: FlightState, exc: RetryableError) -> bool:
        """A retryable failure of this attempt. True: try again (it waited without its slot, and holds
        one again); False: the prompt has ended (failed, handed back)."""
        if exc.status_code is None:  # no answer: the server may be gone
            if isinstance(exc.__cause__, ConnectFailed):  # the request never reached it
                flight.state = flight.state.unsent(earlier)
            self.gate.report_trouble()
        else:
            flight.state = flight.state.answered()
        if self.gate.draining:
            await self.outcomes.hand_back(flight)
            return False
        # 503 is SGLang's "request queue is full": back-pressure, not sickness (the breaker ignores it)
        if exc.status_code not in (None, 503) and await self.judge.server_at_fault(flight):
            return False
        # The server is gone: its keeper strikes what was inside and collects this task; the wait for
        # it is not an attempt's backoff.
        server_gone = exc.status_code is None and not self.server.serving()
        if not server_gone and flight.attempts - flight.uncounted >= self.config.max_attempts:
            self.outcomes.fail(flight, exc.status_code or 0, ErrorCode.RETRIES_EXHAUSTED,
                               f"{exc} (after {flight.attempts} attempts)", exc.body)
            return False
        wait_s = 0.0 if server_gone else backoff_s(flight.attempts, base_s=self.config.backoff_base_s,
                                                   max_s=self.config.backoff_max_s, jitter=True)
        self.slots.release()  # no slot is held while it waits
        flight.holds_slot = False
        if wait_s:
            await asyncio.sleep(wait_s)
        while not (self.server.serving() and not self.gate.paused) and not self.gate.draining:
            await asyncio.sleep(0.2)  # the server is down or paused; a death collects this task
        if self.gate.draining:
            await self.outcomes.hand_back(flight)
            return False
        await self.slots.acquire()
        flight.holds_slot = True
        return True


def _rids(rid: str, value: object) -> str | list[str]:
    """The request id(s) of an embedding request: one for one input (a string, or token ids), else one
    per input, `<rid>.<index>` (`worker.takeback` aborts them by these)."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return [f"{rid}.{i}" for i in range(len(value))]
    return rid
