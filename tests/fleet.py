"""Test helper: real `rq worker gpuN` processes (our worker class) each owning a simulated SGLang
server, exactly as a host's Procfile runs them; plus the producer CLI as a subprocess."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import orjson
import redis

from batchfleet.config import GPU_LOCAL_PART
from batchfleet.keys import Keys
from batchfleet.procs import pid_alive
from batchfleet.records import Event, WorkerStatus

from .conftest import free_port_block

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]


class Fleet:
    made: ClassVar[list[Fleet]] = []  # every fleet of the running test: conftest kills them all at its end
    _seq: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, tmp: Path, redis_url: str, *, run: str | None = None, gpus: int = 2,
                 env: dict[str, str] | None = None, prefix: str | None = None) -> None:
        Fleet.made.append(self)
        # Every fleet has a run and queues of its own unless a test names them: t<n>, queues t<n>.gpuN.
        # (prefix="" only where the queue names are fixed by what is tested, e.g. the shipped Procfile.)
        run = run or f"t{next(Fleet._seq)}"
        prefix = f"{run}." if prefix is None else prefix
        self.tmp = tmp
        self.redis_url = redis_url
        self.run = run
        self.prefix = prefix  # queues are <prefix>gpuN: a test of its own never shares a queue
        self.k = Keys(run)
        self.r = redis.Redis.from_url(redis_url)
        self.port_base = free_port_block(gpus)
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{os.environ.get('PATH', '')}",
            "REDIS_URL": redis_url,
            "RQ_WORKER_CLASS": "worker.GPUWorker",
            "BATCHFLEET_RUN": run,
            "BATCHFLEET_STATE_DIR": str(tmp / "state"),
            "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
            "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid",
            "BATCHFLEET_PORT_BASE": str(self.port_base),
            "BATCHFLEET_STARTUP_TIMEOUT_S": "60",
            "BATCHFLEET_STATUS_INTERVAL_S": "0.5",
            "SGLANG_SIM_GPU_DIR": str(tmp / "gpus"),
            "SGLANG_SIM_TIME_SCALE": "20",
            "SGLANG_SIM_STARTUP_S": "0.2",
            **({"BATCHFLEET_QUEUE_PATTERN": re.escape(prefix) + GPU_LOCAL_PART} if prefix else {}),
            **(env or {}),
        }
        self.workers: dict[int | str, subprocess.Popen[bytes]] = {}  # by GPU, or group label ("gpu0-1")
        self.gpus = gpus
        self.procs: list[subprocess.Popen[bytes]] = []  # every worker ever started, for kill_all
        self.head: subprocess.Popen[bytes] | None = None

    # --- processes ---------------------------------------------------------------------------------
    def record_path(self, gpu: int | str) -> Path:
        return self.tmp / f"sim-{label(gpu)}.json"

    def queue(self, gpu: int | str) -> str:
        """The queue of GPU `gpu` (3: `<prefix>gpu3`) or of a group (`"gpu0-1"`: `<prefix>gpu0-1`)."""
        return f"{self.prefix}{label(gpu)}"

    @property
    def queues(self) -> str:
        """All this fleet's queues, comma-separated (for `producer enqueue --queues`)."""
        return ",".join(self.queue(g) for g in range(self.gpus))

    def start_worker(self, gpu: int | str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"worker-{label(gpu)}.log").open("ab")
        proc = subprocess.Popen(
            [str(BIN / "rq"), "worker", self.queue(gpu), *extra],
            env={**self.env, "SGLANG_SIM_RECORD": str(self.record_path(gpu)), **(env or {})},
            stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)
        self.workers[gpu] = proc
        self.procs.append(proc)
        return proc

    def worker_log(self, gpu: int | str) -> str:
        return (self.tmp / f"worker-{label(gpu)}.log").read_text(errors="replace")

    def start_head(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """The head process (`producer head`): feeds the window, collects, repairs a Redis that lost data."""
        log = (self.tmp / "head.log").open("ab")
        self.head = subprocess.Popen([str(BIN / "producer"), "head", "--interval", "0.5", *extra],
                                     env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.tmp)
        return self.head

    def head_log(self) -> str:
        path = self.tmp / "head.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_head(self, timeout_s: float = 30) -> int | None:
        if self.head is None:
            return None
        if self.head.poll() is None:
            self.head.send_signal(signal.SIGTERM)
        try:
            return self.head.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.head.kill()
            return None

    def stop_all(self, timeout_s: float = 30) -> dict[int | str, int | None]:
        """Stop the workers (SIGTERM, then kill after `timeout_s`), then the head; the workers' codes."""
        for p in self.workers.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for gpu, p in self.workers.items():
            try:
                codes[gpu] = p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[gpu] = None
        self.stop_head(timeout_s)
        return codes

    def kill_all(self) -> None:
        """Finalizer: no process of this fleet (workers, head) outlives its test (servers die with them)."""
        procs = [*self.procs, *([self.head] if self.head is not None else [])]
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def events(self, kind: str | None = None) -> list[Event]:
        out = [Event.from_json(f[b"e"]) for _, f in self.r.xrange(self.k.events)]
        return [e for e in out if kind is None or e.kind == kind]

    def producer(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "producer"), *args], env=self.env, capture_output=True, text=True,
                              cwd=self.tmp, timeout=timeout_s)
        if check and done.returncode not in (0,):
            raise AssertionError(f"producer {args} exited {done.returncode}: {done.stdout}\n{done.stderr}")
        return done

    # --- observations ------------------------------------------------------------------------------
    def sim_record(self, gpu: int | str) -> dict[str, Any]:
        return json.loads(self.record_path(gpu).read_text())

    def stats(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.k.stats).items()}

    def statuses(self) -> list[WorkerStatus]:
        out = []
        for name in self.r.smembers(self.k.workers):
            raw = self.r.get(self.k.status(name.decode()))
            if raw:
                out.append(WorkerStatus.from_json(raw))
        return out

    def finished(self) -> int:
        s = self.stats()
        return s.get("succeeded", 0) + s.get("failed", 0)

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- worker {label(g)}\n{self.worker_log(g)[-3000:]}" for g in self.workers)
                logs += f"\n--- head\n{self.head_log()[-3000:]}"
                raise AssertionError(f"timed out waiting for {what}; stats={self.stats()}\n{logs}")
            for gpu, p in self.workers.items():
                if p.poll() is not None and p.returncode not in (0, -9):
                    raise AssertionError(f"worker {label(gpu)} exited {p.returncode}:\n{self.worker_log(gpu)[-3000:]}")
            if self.head is not None and self.head.poll() not in (None, 0, -9):
                raise AssertionError(f"the head exited {self.head.returncode}:\n{self.head_log()[-3000:]}")
            time.sleep(0.2)


def label(gpu: int | str) -> str:
    """A worker's GPU as its queue's local part: 3 -> `gpu3`; a group's label stays as given (`gpu0-1`)."""
    return f"gpu{gpu}" if isinstance(gpu, int) else gpu


def gone(pid: int, timeout_s: float = 10) -> bool:
    """Wait until the process `pid` is gone (or a zombie: it has exited); False if it outlives `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def write_prompts(path: Path, n: int, *, max_tokens: int = 48, start: int = 0,
                  ignore_eos: bool = False) -> list[dict[str, Any]]:
    """n prompts in the simple form, alternating completion and chat. `ignore_eos`: each runs all its
    `max_tokens` (the simulator's end of sequence ends some after a few tokens)."""
    rows: list[dict[str, Any]] = []
    for i in range(start, start + n):
        if i % 2:
            rows.append({"id": f"p{i}", "messages": [{"role": "user", "content": f"Tell me about item {i}"}],
                         "max_tokens": max_tokens})
        else:
            rows.append({"id": f"p{i}", "prompt": f"Describe the number {i} in detail", "max_tokens": max_tokens,
                         "temperature": 0.5})
        if ignore_eos:
            rows[-1]["ignore_eos"] = True
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return rows


def expected_text(row: dict[str, Any]) -> str:
    """What the simulator must have answered for a simple-form row (its documented rule)."""
    from sglang_sim.textgen import expected_completion, render_chat

    params: dict[str, Any] = {"max_new_tokens": row["max_tokens"]}
    for ours, sim in (("temperature", "temperature"), ("ignore_eos", "ignore_eos")):
        if ours in row:
            params[sim] = row[ours]
    prompt = render_chat(row["messages"]) if "messages" in row else row["prompt"]
    return expected_completion(prompt, params)[0]


def text_of(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
