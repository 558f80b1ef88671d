"""Fault injection from env, for reliability tests of the worker and supervisor.

Run-time faults:
SGLANG_SIM_CRASH_AFTER=N    hard os._exit(1) once N requests were admitted (connections reset; logs a CUDA error)
SGLANG_SIM_CRASH_MARKER=s   the same when a request whose prompt contains s is admitted (a poison prompt)
SGLANG_SIM_HANG_AFTER=N     the scheduler stops after N admitted requests; HTTP stays up, /health_generate 503
SGLANG_SIM_SICK_AFTER=N     after N generation requests the process stays up, but every later generation
                            request and /health_generate answer HTTP 500 (/health stays 200)
SGLANG_SIM_ERROR_RATE=p     a seeded fraction p of generation requests get HTTP 500
SGLANG_SIM_ERROR_SEED=n     the seed of that draw (default 12345)
SGLANG_SIM_ERROR_MARKER=s   a generation request whose prompt contains s gets HTTP 500, every time

Start-up faults (the server dies as SGLang 0.5.23 does; see fatal.py):
SGLANG_SIM_FAIL_STARTUP=oom after loading the weights, rank 0 dies of `torch.OutOfMemoryError: CUDA out
                            of memory. Tried to allocate 2.00 GiB. ...`; the server SIGKILLs itself (-9)

Scope:
SGLANG_SIM_FAULT_GPUS=1,3   faults apply only to a server whose group holds one of these GPUs (default: all)
SGLANG_SIM_FAULTS_ONCE=path CRASH_AFTER, HANG_AFTER, SICK_AFTER and FAIL_STARTUP fire at most once across
                            restarts: the server that fires one creates `path`; a server started while
                            it exists runs without them (so a restarted server is healthy)

Faults that need no variable (the simulator behaves as SGLang): the HTTP port already in use, fewer
visible GPUs than ranks, a model path that is neither a directory nor a valid hub id, a model too big
for its GPUs, a memory fraction too high (docs/simulator.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .logs import log

__all__ = ["Faults"]


@dataclass
class Faults:
    crash_after: int | None = None
    crash_marker: str | None = None  # whitespace-normalised, as prompts are words
    hang_after: int | None = None
    sick_after: int | None = None
    fail_startup: str | None = None
    error_rate: float = 0.0
    error_marker: str | None = None  # whitespace-normalised, as crash_marker
    error_marker_hits: int = 0  # requests refused for it (the record says how often each was tried)
    once_path: Path | None = None
    generation_requests: int = 0  # generation requests seen (health probes excluded)
    sick: bool = False
    sick_answers: int = 0  # requests answered 500 for it (generations and /health_generate)
    _rng: random.Random = field(default_factory=lambda: random.Random(12345))

    @classmethod
    def from_env(cls, gpu_indices: list[int]) -> Faults:
        env = os.environ
        only = env.get("SGLANG_SIM_FAULT_GPUS", "").strip()
        if only and not {int(x) for x in only.split(",") if x.strip()} & set(gpu_indices):
            return cls()

        def num(key: str) -> int | None:
            return int(env[key]) if env.get(key, "").strip() else None

        once = Path(env["SGLANG_SIM_FAULTS_ONCE"]) if env.get("SGLANG_SIM_FAULTS_ONCE", "").strip() else None
        spent = once is not None and once.exists()
        return cls(
            crash_after=None if spent else num("SGLANG_SIM_CRASH_AFTER"),
            crash_marker=" ".join(env.get("SGLANG_SIM_CRASH_MARKER", "").split()) or None,
            hang_after=None if spent else num("SGLANG_SIM_HANG_AFTER"),
            sick_after=None if spent else num("SGLANG_SIM_SICK_AFTER"),
            fail_startup=None if spent else (env.get("SGLANG_SIM_FAIL_STARTUP") or None),
            error_rate=float(env.get("SGLANG_SIM_ERROR_RATE") or 0.0),
            error_marker=" ".join(env.get("SGLANG_SIM_ERROR_MARKER", "").split()) or None,
            once_path=once,
            _rng=random.Random(int(env.get("SGLANG_SIM_ERROR_SEED") or 12345)),
        )

    def fire(self) -> None:
        """A once-only fault fires: leave the mark that disarms the next server's."""
        if self.once_path is not None:
            with contextlib.suppress(OSError):
                self.once_path.touch(exist_ok=True)

    def on_admitted(self, admitted_total: int, engine: Any, prompt_words: list[str] | None = None) -> None:
        if self.crash_after is not None and admitted_total >= self.crash_after:
            self.fire()
            self._crash()
        if self.crash_marker is not None and prompt_words and self.crash_marker in " ".join(prompt_words):
            self._crash()
        if self.hang_after is not None and admitted_total >= self.hang_after:
            self.fire()
            engine.hang()

    @staticmethod
    def _crash() -> None:
        """Die like a CUDA illegal memory access in the scheduler: every request in the server fails."""
        log("Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access was encountered")
        log("CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
            "below might be incorrect.")
        sys.stderr.flush()
        os._exit(1)  # no cleanup: sockets reset, GPU file left behind with a dead pid

    def on_generation_request(self) -> bool:
        """Count a generation request on arrival; True when the server is sick and must answer 500."""
        self.generation_requests += 1
        if not self.sick and self.sick_after is not None and self.generation_requests > self.sick_after:
            self.sick = True
            self.fire()
            log(f"SGLANG_SIM_SICK_AFTER={self.sick_after}: the server is sick from now on (HTTP 500 to every "
                "generation and to /health_generate)")
        if self.sick:
            self.sick_answers += 1
        return self.sick

    def draw_error(self, prompts: list[Any] | None = None) -> bool:
        """True when this generation request should fail with HTTP 500: its prompt holds the error
        marker (every time), or the seeded draw says so (arrival order)."""
        if self.error_marker is not None and prompts and any(
                isinstance(p, str) and self.error_marker in " ".join(p.split()) for p in prompts):
            self.error_marker_hits += 1
            return True
        return self.error_rate > 0 and self._rng.random() < self.error_rate
