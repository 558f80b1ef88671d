"""Whose fault is a failed request: the prompt's, or the server's? (The circuit breaker.)

A server can be up and still fail everything (HTTP 500 to every generation and to
`/health_generate`: a wedged scheduler, a full disk under it). Without a breaker each prompt it is
given spends its attempts there and fails for good, and the worker keeps claiming (and stealing from
healthy GPUs' queues) to feed it more. The rule here:

- A failure that many *different* prompts meet on one server while *nothing succeeds there* is the
  server's: after `threshold` distinct prompts fail in a row (no success between), the breaker
  OPENS. The dispatcher then claims and steals nothing, and hands every prompt back to its queue
  without counting an attempt (another GPU, or this one restarted, runs it); the keeper probes the
  server (`/health_generate`) and restarts it when the probe fails, or closes the breaker when the
  probe passes (the failures were the prompts' after all).
- A prompt's failed attempt counts only while the same server serves other prompts: its first
  failure counts; a later one counts if something succeeded on that server since its previous
  failure, else the dispatcher asks the server's probe (`/health_generate`): passed, it counts (the
  server generates; the prompt is at fault); failed, the breaker opens. So a server failing
  everything costs no prompt more than one attempt before the breaker opens.

Pure logic: no I/O, no clock. `epoch` counts successes on the current server; `reset` starts a new
server (its successes are new evidence).
"""

from __future__ import annotations

__all__ = ["Breaker"]


class Breaker:
    def __init__(self, threshold: int = 5) -> None:
        if threshold < 1:
            raise ValueError("threshold must be at least 1")
        self.threshold = threshold
        self.epoch = 0  # successes seen (answers and passed probes); grows at each server start too
        self.failing: set[str] = set()  # distinct prompts failed since the last success
        self.open = False
        self.trips = 0  # times it opened

    def success(self) -> None:
        """The server answered a request properly (or a prompt's own error, e.g. HTTP 400). It does not
        close an open breaker: the keeper's probe does (requests sent before the sickness may still end
        well)."""
        self.epoch += 1
        self.failing.clear()

    def failure(self, key: str) -> bool:
        """A request of prompt `key` failed on the server (it answered an error). True when this very
        failure opened the breaker."""
        if self.open:
            return False
        self.failing.add(key)
        if len(self.failing) >= self.threshold:
            self.open = True
            self.trips += 1
            return True
        return False

    def trip(self) -> None:
        """Open it now (the server's own probe failed while a prompt failed again)."""
        if not self.open:
            self.open = True
            self.trips += 1

    def counts(self, last_failure_epoch: int | None) -> bool:
        """Does a prompt's failure count as an attempt? Its first does; a later one only when the server
        succeeded at something since the prompt's previous failure (at `last_failure_epoch`)."""
        return not self.open and (last_failure_epoch is None or self.epoch > last_failure_epoch)

    def probe_ok(self) -> None:
        """The keeper's probe generated: the server works; what failed was the prompts'."""
        self.success()
        self.open = False

    def reset(self) -> None:
        """A new server (a restart): nothing known against it."""
        self.epoch += 1
        self.failing.clear()
        self.open = False
