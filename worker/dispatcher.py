"""Keep exactly `capacity` prompts in flight against one server: claim jobs as slots free up, run
each as an asyncio task through the backend, and report outcomes to the ledger.

Outcomes follow the exception tree in `batchfleet.errors`: a reply is a success; PromptError fails
the prompt once with the server's reason; RetryableError retries with capped exponential backoff
(the slot is given back while it waits) unless the server itself is gone, in which case the prompt
is handed back to its queue untouched; JobRefused fails a job that names a foreign function.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis

from batchfleet.config import Config
from batchfleet.errors import JobRefused, PromptError, RetryableError
from batchfleet.jobs import ALLOWED
from batchfleet.records import Prompt, Result

from .ledger import Claim, Ledger, parse_job_data
from .slots import Slots

__all__ = ["Backend", "Dispatcher"]

log = logging.getLogger("batchfleet.worker.dispatcher")


class Backend(Protocol):
    async def __call__(self, prompt: Prompt) -> dict[str, Any]: ...


class Dispatcher:
    def __init__(self, ledger: Ledger, backend: Backend, *, config: Config, worker: str,
                 queues: Callable[[], list[str]], server_ok: Callable[[], bool] = lambda: True) -> None:
        self.ledger = ledger
        self.backend = backend
        self.config = config
        self.worker = worker
        self.queues = queues
        self.server_ok = server_ok
        self.slots = Slots(0)
        self.tasks: dict[asyncio.Task[None], Claim] = {}
        self.accepting = asyncio.Event()  # cleared while paused (server restarting) or stopping
        self.done = 0
        self.failed = 0
        self.handed_back = 0
        self._tokens: deque[tuple[float, int]] = deque()  # (finished_at, completion tokens) for tokens/s
        self.retry_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # tests swap it out

    @property
    def in_flight(self) -> int:
        return len(self.tasks)

    # --- the claim loop -------------------------------------------------------------------------------
    async def run(self, *, burst: bool = False) -> None:
        """Claim and start jobs until cancelled (or, in burst mode, until the queues are empty)."""
        idle_s = 0.02
        redis_wait_s = 0.5
        while True:
            await self.accepting.wait()
            took = await self.slots.acquire_up_to(self.slots.capacity)
            if not self.accepting.is_set():
                self.slots.release(took)
                continue
            if self.ledger.results_backlog > self.config.max_pending_results:
                self.slots.release(took)
                log.warning("results stream holds %d entries: is `producer collect` running? waiting",
                            self.ledger.results_backlog)
                await asyncio.sleep(5)
                await self.ledger.flush()
                continue
            try:
                claims = await self.ledger.claim(took, self.queues())
            except (redis.RedisError, OSError) as exc:
                # Redis restarting or unreachable: in-flight prompts keep running; claim again later.
                self.slots.release(took)
                log.warning("cannot claim work from Redis (%s); retrying in %.1f s", exc, redis_wait_s)
                await asyncio.sleep(redis_wait_s)
                redis_wait_s = min(redis_wait_s * 2, 10.0)
                continue
            redis_wait_s = 0.5
            if len(claims) < took:
                self.slots.release(took - len(claims))
            for claim in claims:
                task = asyncio.create_task(self._run_one(claim), name=f"job {claim.jid}")
                self.tasks[task] = claim
                task.add_done_callback(self._reap_task)
            if claims:
                idle_s = 0.02
                continue
            if burst and not self.tasks:
                return
            await asyncio.sleep(idle_s)  # queues are dry: poll gently
            idle_s = min(idle_s * 2, 0.5)

    def _reap_task(self, task: asyncio.Task[None]) -> None:
        self.tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("job task crashed", exc_info=task.exception())

    # --- one prompt -----------------------------------------------------------------------------------
    async def _run_one(self, claim: Claim) -> None:
        holding = True  # this task holds one slot, except while it sleeps between attempts
        attempt = 0
        try:
            prompt = self._decode(claim)
            while True:
                attempt += 1
                try:
                    body = await self.backend(prompt)
                except RetryableError as exc:
                    if not self.server_ok() or not self.accepting.is_set():
                        # The server is gone (or we are stopping): not the prompt's fault.
                        await self._hand_back(claim)
                        return
                    if attempt >= self.config.max_attempts:
                        self._fail(claim, prompt, attempt, exc.status_code or 0, "retries_exhausted",
                                   f"{exc} (after {attempt} attempts)")
                        return
                    self.slots.release()
                    holding = False
                    await self.retry_sleep(self._backoff_s(attempt))
                    await self.slots.acquire()
                    holding = True
                    continue
                except PromptError as exc:
                    self._fail(claim, prompt, attempt, exc.status_code, "invalid_prompt", str(exc))
                    return
                self._succeed(claim, prompt, attempt, body)
                return
        except JobRefused as exc:
            log.error("refused job %s: %s", claim.jid, exc)
            self._fail(claim, None, 0, 0, "refused", str(exc))
        except asyncio.CancelledError:
            await asyncio.shield(self._hand_back(claim))
            raise
        finally:
            if holding:
                self.slots.release()

    def _decode(self, claim: Claim) -> Prompt:
        try:
            func, args, kwargs = parse_job_data(claim.data)
        except Exception as exc:
            raise JobRefused(f"job data is not batchfleet JSON ({type(exc).__name__})") from exc
        if func not in ALLOWED:
            raise JobRefused(f"job function {func!r} is not on batchfleet's allow-list")
        if len(args) != 1 or kwargs or not isinstance(args[0], dict):
            raise JobRefused("a batchfleet job takes exactly one prompt argument")
        try:
            prompt = Prompt.from_dict(args[0])
        except (KeyError, TypeError, ValueError) as exc:
            raise JobRefused(f"malformed prompt record: {exc}") from exc
        if prompt.run and prompt.run != self.config.run:
            # Its result would land in this run's stream and never reach its own export. Loud, and
            # recoverable: `rq requeue` once workers of run {prompt.run} serve this queue.
            raise JobRefused(f"job of run {prompt.run!r} on a queue served by run {self.config.run!r}: "
                             "give each run queues of its own")
        return prompt

    def _backoff_s(self, attempt: int) -> float:
        base = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1))
        return base * random.uniform(0.5, 1.0)  # jitter: a fleet must not retry in lockstep

    def _succeed(self, claim: Claim, prompt: Prompt, attempts: int, body: dict[str, Any]) -> None:
        result = Result(cid=prompt.cid, jid=claim.jid, seq=prompt.seq, status_code=200, body=body,
                        worker=self.worker, attempts=attempts)
        self.done += 1
        self._tokens.append((time.monotonic(), result.completion_tokens))
        self.ledger.finish(claim, result)

    def _fail(self, claim: Claim, prompt: Prompt | None, attempts: int, status: int, code: str, message: str) -> None:
        result = Result(cid=prompt.cid if prompt else claim.jid, jid=claim.jid, seq=prompt.seq if prompt else -1,
                        status_code=status, error={"code": code, "message": message}, worker=self.worker,
                        attempts=attempts)
        self.failed += 1
        log.warning("prompt %s failed (%s): %s", result.cid, code, message)
        self.ledger.finish(claim, result, exc_string=f"{code}: {message}")

    async def _hand_back(self, claim: Claim) -> None:
        self.handed_back += await self.ledger.hand_back([claim])

    # --- control ----------------------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> int:
        """Stop claiming; let in-flight prompts finish for up to `timeout_s`; hand back the rest.
        Returns how many were handed back."""
        self.accepting.clear()
        pending = list(self.tasks)
        if pending:
            _, still = await asyncio.wait(pending, timeout=timeout_s)
            for task in still:
                task.cancel()
            if still:
                await asyncio.gather(*still, return_exceptions=True)
                log.info("handed back %d in-flight prompt(s)", len(still))
            await self.ledger.flush()
            return len(still)
        await self.ledger.flush()
        return 0

    def tokens_per_s(self, window_s: float = 30.0) -> float:
        now = time.monotonic()
        while self._tokens and self._tokens[0][0] < now - window_s:
            self._tokens.popleft()
        if not self._tokens:
            return 0.0
        span = max(now - self._tokens[0][0], min(window_s, 1.0))
        return sum(t for _, t in self._tokens) / span
