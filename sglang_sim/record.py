"""The observation record: what the simulator saw, for tests (env SGLANG_SIM_RECORD, GET /sim/observed).

Written atomically at most every RECORD_EVERY_S and at clean exit, so a test can assert on the
peak concurrency it produced or the flags a launcher passed, even after the server is gone.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Recorder"]

RECORD_EVERY_S = 0.5
MAX_SAMPLES = 2000


class Recorder:
    def __init__(self, *, version: str, argv: list[str], flags: dict[str, Any], strategy: str,
                 effective: int, profile: str, gpu_indices: list[int]) -> None:
        # `{gpu}` in the path is the index of the server's first GPU: one variable serves a launcher's
        # every server
        gpu_index = gpu_indices[0] if gpu_indices else 0
        raw = os.environ.get("SGLANG_SIM_RECORD", "").replace("{gpu}", str(gpu_index))
        self.path = Path(raw) if raw else None
        # The record is for tests and may be read by anyone who can read the run's files: like the
        # logs batchfleet writes, it never holds the API key (the record says only that one was set).
        self.static = {
            "pid": os.getpid(), "version": version, "argv": _redact_argv(argv),
            "flags": {k: ("***" if k in SECRET_FLAGS and v else v) for k, v in flags.items()}, "strategy": strategy,
            "effective_max_running_requests": effective, "profile": profile, "gpu_index": gpu_index,
            "gpu_indices": list(gpu_indices),
        }
        self.requests_by_endpoint: Counter[str] = Counter()
        self.abort_calls = 0  # POST /abort_request received (not in requests_total: no generation)
        self.samples: list[list[float]] = []
        self.engine: Engine | None = None
        self.started_wall = time.time()
        self.ready = False
        self._last_write = 0.0
        self._last_sample: tuple[int, int] | None = None

    def count_request(self, endpoint: str) -> None:
        self.requests_by_endpoint[endpoint] += 1

    def snapshot(self) -> dict[str, Any]:
        e = self.engine
        return {
            **self.static,
            "ready": self.ready,
            "peak_running": e.peak_running if e else 0,
            "peak_queued": e.peak_queued if e else 0,
            "running": e.running if e else 0,
            "queued": e.queued if e else 0,
            "admitted_total": e.admitted_total if e else 0,
            "requests_total": sum(self.requests_by_endpoint.values()),
            "requests_by_endpoint": dict(self.requests_by_endpoint),
            "generation_tokens_total": e.metrics.generation_tokens if e else 0,
            "prompt_tokens_total": e.metrics.prompt_tokens if e else 0,
            "cached_tokens_total": e.metrics.cached_tokens if e else 0,
            "aborted_total": e.metrics.aborted if e else 0,
            "abort_calls": self.abort_calls,
            "error_marker_hits": e.faults.error_marker_hits if e else 0,
            "sick": e.faults.sick if e else False,
            "sick_answers": e.faults.sick_answers if e else 0,
            # [seconds since start, running, queued] whenever the pair changed (sampled per tick)
            "max_running_seen_over_time": self.samples,
            # per rank, in model time: occupied slot-seconds, and [model s, slot-seconds] when it first ran
            # its capacity and at its latest admission of a client request (slot fill while work remained)
            "slot_fill": [{"cap": r.cap, "t": r.t, "slot_s": r.slot_s, "full_at": r.full_at, "last_admit": r.last_admit,
                           "first_admit": r.first_admit,
                           "longest_s": r.longest_s} for r in e.ranks] if e else [],
            "first_admit_wall": e.first_admit_wall if e else None,
            "last_finish_wall": e.last_finish_wall if e else None,
            **({"requests": e.request_log, "admitted": e.admit_log} if e and e.request_log is not None else {}),
            **({"lora": self._lora(e)} if e and e.cfg.lora is not None else {}),
        }

    @staticmethod
    def _lora(e: Engine) -> dict[str, Any]:
        """Adapter loads into the GPU pools: per name, in all, and [model s, dp rank, loaded, evicted] per
        load (the latest MAX_SWITCHES); the most distinct adapters (the base counting) a rank's forward
        ran with; implicit reloads of evicted or unloaded adapters; the names registered now."""
        reg = e.cfg.lora
        assert reg is not None
        return {"loads": dict(e.lora_loads), "loads_total": sum(e.lora_loads.values()), "switches": e.lora_switches,
                "peak_adapters_in_batch": e.peak_adapters, "reloads": reg.reloads, "registered": list(reg.registry),
                "max_loras_per_batch": reg.settings.max_loras_per_batch}

    def on_tick(self) -> None:
        e = self.engine
        if e is not None:
            pair = (e.running, e.queued)
            if pair != self._last_sample:
                self._last_sample = pair
                self.samples.append([round(time.time() - self.started_wall, 3), *pair])
                del self.samples[:-MAX_SAMPLES]
        if self.path and time.monotonic() - self._last_write >= RECORD_EVERY_S:
            self.write()

    def write(self) -> None:
        self._last_write = time.monotonic()
        if not self.path:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.snapshot(), default=str))
        tmp.replace(self.path)


SECRET_FLAGS = frozenset({"api_key", "admin_api_key", "ssl_keyfile_password"})


def _redact_argv(argv: list[str]) -> list[str]:
    out: list[str] = []
    hide = False
    for token in argv:
        flag, eq, _ = token.partition("=")
        secret = flag.startswith("--") and flag[2:].replace("-", "_") in SECRET_FLAGS
        out.append("***" if hide else f"{flag}=***" if secret and eq else token)
        hide = secret and not eq
    return out
