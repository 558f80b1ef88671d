"""Fault injection from env, for reliability tests of the worker and supervisor.

SGLANG_SIM_CRASH_AFTER=N    hard os._exit once N requests were admitted (connections reset)
SGLANG_SIM_CRASH_MARKER=s   hard os._exit when a request whose prompt contains s is admitted (a poison prompt)
SGLANG_SIM_HANG_AFTER=N     the scheduler stops after N admitted requests; HTTP stays up
SGLANG_SIM_FAIL_STARTUP=oom die at start-up with the CUDA out-of-memory line
SGLANG_SIM_ERROR_RATE=p     a seeded fraction p of generation requests get HTTP 500
SGLANG_SIM_ERROR_MARKER=s   a generation request whose prompt contains s gets HTTP 500, every time
SGLANG_SIM_FAULT_GPUS=1,3   only these GPU indices misbehave (default: all)
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from .logs import log

__all__ = ["Faults"]


@dataclass
class Faults:
    crash_after: int | None = None
    crash_marker: str | None = None  # whitespace-normalised, as prompts are words
    hang_after: int | None = None
    fail_startup: str | None = None
    error_rate: float = 0.0
    error_marker: str | None = None  # whitespace-normalised, as crash_marker
    error_marker_hits: int = 0  # requests refused for it (the record says how often each was tried)
    _rng: random.Random = field(default_factory=lambda: random.Random(12345))

    @classmethod
    def from_env(cls, gpu_index: int) -> Faults:
        env = os.environ
        only = env.get("SGLANG_SIM_FAULT_GPUS", "").strip()
        if only and gpu_index not in {int(x) for x in only.split(",") if x.strip()}:
            return cls()

        def num(key: str) -> int | None:
            return int(env[key]) if env.get(key, "").strip() else None

        return cls(
            crash_after=num("SGLANG_SIM_CRASH_AFTER"),
            crash_marker=" ".join(env.get("SGLANG_SIM_CRASH_MARKER", "").split()) or None,
            hang_after=num("SGLANG_SIM_HANG_AFTER"),
            fail_startup=env.get("SGLANG_SIM_FAIL_STARTUP") or None,
            error_rate=float(env.get("SGLANG_SIM_ERROR_RATE") or 0.0),
            error_marker=" ".join(env.get("SGLANG_SIM_ERROR_MARKER", "").split()) or None,
            _rng=random.Random(int(env.get("SGLANG_SIM_ERROR_SEED") or 12345)),
        )

    def on_admitted(self, admitted_total: int, engine: Any, prompt_words: list[str] | None = None) -> None:
        if self.crash_after is not None and admitted_total >= self.crash_after:
            self._crash()
        if self.crash_marker is not None and prompt_words and self.crash_marker in " ".join(prompt_words):
            self._crash()
        if self.hang_after is not None and admitted_total >= self.hang_after:
            engine.hang()

    @staticmethod
    def _crash() -> None:
        """Die like a CUDA illegal memory access in the scheduler: every request in the server fails."""
        log("Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access was encountered")
        log("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
            "below might be incorrect.")
        sys.stderr.flush()
        os._exit(1)  # no cleanup: sockets reset, GPU file left behind with a dead pid

    def draw_error(self, prompts: list[Any] | None = None) -> bool:
        """True when this generation request should fail with HTTP 500: its prompt holds the error
        marker (every time), or the seeded draw says so (arrival order)."""
        if self.error_marker is not None and prompts and any(
                isinstance(p, str) and self.error_marker in " ".join(p.split()) for p in prompts):
            self.error_marker_hits += 1
            return True
        return self.error_rate > 0 and self._rng.random() < self.error_rate
