"""How a claimed prompt ends, written down: a result (a success, a final failure, a quarantine), a
hand back to its queue, or a refusal (RQ's failed registry, no result). Each is counted in the
worker's `Tally` and goes to Redis through the ledger (results batched by its flusher)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from batchfleet.errors import ErrorCode
from batchfleet.prompts import EMBEDDINGS
from batchfleet.records import Result
from batchfleet.redact import Scrubber

from .breaker import Breaker
from .flight import Flight, Tally
from .ledger import MAX_STRIKES, Ledger
from .slots import Turnover

__all__ = ["LOG_TAIL_CHARS", "Outcomes"]

log = logging.getLogger("batchfleet.worker.dispatcher")

LOG_TAIL_CHARS = 4000  # of the server log, in a quarantined prompt's result


def _one_line_object(raw: bytes) -> str:
    """The text of a JSON object's bytes (parsed already: valid JSON) when it fits on one line of the export,
    else "" (a pretty-printed answer is dumped again, as any other)."""
    raw = raw.strip(b" \t\r\n")
    if raw[:1] != b"{" or raw[-1:] != b"}" or b"\n" in raw or b"\r" in raw:
        return ""
    return raw.decode()


class Outcomes:
    def __init__(self, ledger: Ledger, tally: Tally, *, worker: str, clock: Callable[[], float], scrub: Scrubber,
                 breaker: Breaker, turnover: Turnover, on_completion: Callable[[int], None],
                 on_prompt_tokens: Callable[[int, int], None] | None = None) -> None:
        self.ledger = ledger
        self.tally = tally
        self.worker = worker
        self.clock = clock  # the worker's clock: a result's finished_at (informational)
        self.scrub = scrub  # error texts become results, exports and log lines
        self.breaker = breaker
        self.turnover = turnover
        self.on_completion = on_completion  # completion tokens of each success (the throughput meter)
        # (job bytes, prompt tokens) of each answered embedding: what its usage says a request's bytes are
        self.on_prompt_tokens = on_prompt_tokens

    def succeed(self, flight: Flight, body: dict[str, Any], raw: bytes | None = None) -> None:
        """`raw`: the answer's bytes, as the server sent them (`body` is what they parse to). An object on one
        line is carried as is (`Result.raw_body`): its floats are not dumped again here, nor parsed by the
        collector."""
        prompt = flight.prompt
        assert prompt is not None
        text = _one_line_object(raw) if raw is not None and isinstance(body, dict) else ""
        result = Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=200,
                        body=None if text else body, raw_body=text, worker=self.worker, attempts=flight.attempts,
                        finished_at=self.clock(), fp=prompt.fp)
        flight.settle()
        self.tally.done += 1
        self.breaker.success()
        self.turnover.finished(time.monotonic())
        self.on_completion(result.completion_tokens)
        if self.on_prompt_tokens is not None and prompt.url == EMBEDDINGS:
            usage = body.get("usage")
            tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            if isinstance(tokens, int):
                self.on_prompt_tokens(len(flight.claim.data), tokens)
        self.ledger.finish(flight.claim, result)

    def fail(self, flight: Flight, status: int, code: ErrorCode, message: str, body: object = None, *,
             quiet: bool = False) -> None:
        """`body`: the server's error answer (JSON), exported as its response body; kept only as an object.
        `quiet`: no log line (the caller said why once for many)."""
        prompt = flight.prompt
        assert prompt is not None
        message = self.scrub(message)
        result = Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=status,
                        body=body if isinstance(body, dict) else None, error={"code": code, "message": message},
                        worker=self.worker, attempts=flight.attempts, finished_at=self.clock(), fp=prompt.fp)
        flight.settle()
        self.tally.failed += 1
        self.turnover.finished(time.monotonic())
        if not quiet:
            log.warning("prompt %s failed (%s): %s", result.cid, code, message)
        self.ledger.finish(flight.claim, result, exc_string=f"{code}: {message}")

    def refuse(self, flight: Flight, reason: str) -> None:
        log.error("refused job %s: %s", flight.claim.jid, reason)
        flight.settle()
        self.tally.refused += 1
        self.ledger.refuse(flight.claim, reason)

    async def hand_back(self, flight: Flight) -> None:
        """Back to its queue (where its strikes say), untouched."""
        flight.settle()
        try:
            n = await self.ledger.hand_back([flight.claim])
        except (redis.RedisError, OSError) as exc:
            log.warning("could not hand back %s (%s): its lease lapses and it runs again", flight.claim.jid, exc)
            return
        self.tally.handed_back += n

    def quarantine(self, flight: Flight, reason: str, log_tail: str) -> Result | None:
        """The result of a prompt its server died on MAX_STRIKES times, the last time alone."""
        prompt = flight.prompt
        if prompt is None:
            return None
        tail = self.scrub(log_tail[-LOG_TAIL_CHARS:])
        message = (f"the server died {MAX_STRIKES} times with this prompt inside, the last time with nothing else "
                   f"in it; quarantined, never run again. Last death: {reason}\n--- server log (tail) ---\n{tail}")
        return Result(cid=prompt.cid, jid=flight.claim.jid, seq=prompt.seq, status_code=0,
                      error={"code": ErrorCode.SERVER_CRASH, "message": message}, worker=self.worker,
                      attempts=flight.attempts, finished_at=self.clock(), fp=prompt.fp)
