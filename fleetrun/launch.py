"""A fleet on this host, as `batchfleet run` and `batchfleet serve` start it: one set of functions both
call.

- `own_dirs`: the state dir (0700) and the run's log dir, <state dir>/logs/<run>/ (or
  BATCHFLEET_LOG_DIR/<run>), made and checked before anything starts.
- `fleet_redis`: the Redis at the given URL when it answers, else a private redis-server with an
  append-only file in the state dir (`fleetrun.redisproc`), stopped on the way out.
- `gpu_groups`: the GPUs given (`--gpus`) in groups of `--tp`, one server each: `--gpus 0-7 --tp 4` is
  GPUs 0-3 and 4-7; a size that does not divide the GPUs given, or exceeds the GPUs the host has, is a
  usage error.
- `start_fleet`: one `rq worker <run>.gpuN` (`<run>.gpu0-3` for a group) per GPU group
  (RQ_WORKER_CLASS=worker.GPUWorker), the head
  (`producer head`) and the autopilot (`supervisor watch`), each with its log in the run's log dir
  (one file per process; each launch of the run begins with a header line), the servers' logs and pid
  files there too (BATCHFLEET_LOG_DIR).
  They run in sessions of their own (the terminal's Ctrl-C reaches only the launcher, which drains in
  order: `Procs.stop`), and die with the launcher even when it is killed with -9 (PR_SET_PDEATHSIG):
  a launcher started again never finds the last one's workers holding its GPUs.
- `Events`: the run's events (supervisor decisions, server restarts) since the launch, one line each.
- `launch_failed`: a launcher's error (`LAUNCH_ERRORS`) as one line on stderr and its exit code.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from batchfleet.cliopts import EXIT_ACTIVE, EXIT_ERROR, UsageError, error_line
from batchfleet.config import GPU_LOCAL_PART, Config, group_label, model_path_problem
from batchfleet.connection import redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys
from batchfleet.records import Event
from batchfleet.redact import private_dir_problem, private_file
from producer.api import MissingExtra, StoreError

from .lease import RunActive
from .redisproc import PrivateRedis, PrivateRedisBusy, PrivateRedisError, answers

__all__ = [
    "BIN",
    "LAUNCH_ERRORS",
    "Events",
    "Procs",
    "UsageError",
    "check_gpus",
    "check_model_path",
    "child_env",
    "detect_gpus",
    "event_line",
    "exe",
    "fleet_redis",
    "gpu_groups",
    "launch_failed",
    "own_dirs",
    "parse_gpus",
    "queues_of",
    "start_fleet",
    "start_head",
]

BIN = Path(sys.executable).parent
PR_SET_PDEATHSIG = 1


def parse_gpus(text: str) -> tuple[int, ...]:
    """`0-7`, `0,2,5`, `0-3,6`: GPU indices on this host (not a count)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UsageError(f"--gpus wants GPU indices like 0-7 or 0,2,5, got {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi > 1023:
            raise UsageError(f"--gpus: {part!r} is not a range of GPU indices")
        out.extend(range(lo, hi + 1))
    return tuple(dict.fromkeys(out))


def detect_gpus() -> tuple[int, ...]:
    """The GPUs `nvidia-smi` lists (the simulator's stand-in answers the same way)."""
    exe_path = shutil.which("nvidia-smi")
    if exe_path is None:
        return ()
    try:
        text = subprocess.run([exe_path, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(int(x) for x in (line.strip() for line in text.splitlines()) if x.isdigit())


def check_gpus(gpus: tuple[int, ...]) -> None:
    """`--gpus` names only GPUs `nvidia-smi` lists, where it answers (without it nothing can be checked)."""
    listed = detect_gpus()
    missing = [g for g in gpus if g not in listed]
    if listed and missing:
        raise UsageError(f"--gpus names GPU(s) {','.join(map(str, missing))} that nvidia-smi does not list "
                         f"(it lists {','.join(map(str, listed))})")


def check_model_path(config: Config) -> None:
    """A local-looking model path that does not exist: refused before any server starts."""
    if problem := model_path_problem(config.model_path):
        raise UsageError(problem)


def gpu_groups(gpus: tuple[int, ...], tp: int = 1, *, host_gpus: int | None = None) -> list[tuple[int, ...]]:
    """The servers to start: one per group of `tp` GPUs (tensor parallel), in the order given: `0-7` with
    `tp` 4 is (0, 1, 2, 3) and (4, 5, 6, 7). `host_gpus`: how many GPUs the host has (default: as many as
    nvidia-smi lists, unchecked when none answers)."""
    if tp < 1:
        raise UsageError(f"--tp {tp}: a server needs at least one GPU")
    if host_gpus is None:
        host_gpus = len(detect_gpus()) or None
    if host_gpus is not None and tp > host_gpus:
        raise UsageError(f"--tp {tp}: a server on {tp} GPUs, but this host has {host_gpus} (nvidia-smi)")
    if len(gpus) % tp:
        raise UsageError(f"--tp {tp} does not divide the {len(gpus)} GPU(s) given ({','.join(map(str, gpus))}): "
                         f"give a multiple of {tp} GPUs, or another --tp")
    return [tuple(gpus[i:i + tp]) for i in range(0, len(gpus), tp)]


# --- processes --------------------------------------------------------------------------------------
try:  # looked up here, not in the child between fork and exec (where only async-signal-safe work belongs)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies, however it dies (Linux)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Procs:
    logs: Path
    launcher: str = "batchfleet run"  # who starts them, in each log's header line
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # by group label: gpu0, gpu0-3
    others: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with private_file(self.logs / f"{name}.log") as log:  # 0600: logs may quote prompts
            # one file per process of the run; each launch of the run begins with this line
            log.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.launcher} (pid {os.getpid()}) starts "
                      f"{name} =====\n".encode())
            log.flush()
            # a session of its own: the terminal's Ctrl-C reaches only us, and we drain in order
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_die_with_parent)

    def all(self) -> list[subprocess.Popen[bytes]]:
        return [*self.workers.values(), *self.others.values()]

    def tail(self, name: str, n: int = 1500) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self, timeout_s: float, force: list[bool]) -> dict[str, int | None]:
        """SIGTERM the workers (they hand back what they hold and stop their servers), then the head and
        the supervisor; SIGKILL whatever outlives `timeout_s` or when `force[0]` turns true (a second Ctrl-C)."""
        codes: dict[str, int | None] = {}
        for group in ({f"worker-{g}": p for g, p in self.workers.items()}, self.others):
            for p in group.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in group.values()) and time.monotonic() < deadline and not force[0]:
                time.sleep(0.1)
            for name, p in group.items():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
                codes[name] = p.returncode
        return codes


def child_env(config: Config, url: str, run: str) -> dict[str, str]:
    """The environment of the fleet's processes: this Redis, this run, its own queues; no API keys."""
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHFLEET_QUEUES", "BATCHFLEET_API_KEYS")}
    env.update({
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "REDIS_URL": url, "BATCHFLEET_REDIS_URL": url, "RQ_REDIS_URL": url,
        "RQ_WORKER_CLASS": "worker.GPUWorker",
        "BATCHFLEET_RUN": run,
        "BATCHFLEET_STATE_DIR": str(config.state_dir),
        "BATCHFLEET_LOG_DIR": str(config.logs),  # this run's: the servers' logs and pid files too
        # queues of its own (<run>.gpuN, <run>.gpu0-3): a Redis shared with other work keeps its queues to itself
        "BATCHFLEET_QUEUE_PATTERN": re.escape(run) + r"\." + GPU_LOCAL_PART,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def exe(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


def queues_of(run: str, groups: list[tuple[int, ...]]) -> tuple[str, ...]:
    """The queue of each group's worker: `<run>.gpuN` for one GPU, `<run>.gpu0-3` for a group (the worker
    reads its GPUs back from the name: `batchfleet.config.gpu_group_for_queue`)."""
    return tuple(f"{run}.{group_label(g)}" for g in groups)


def start_fleet(procs: Procs, config: Config, groups: list[tuple[int, ...]], *, supervisor: bool = True,
                dry_run: bool = False, head_interval_s: float = 1.0, fresh_start: bool = False,
                priority: bool = False) -> str:
    """Start a worker per GPU group, the head and (with `supervisor`) the autopilot, as the config's run.
    `priority`: the servers schedule by request priority (a shared fleet's high batches; unless
    BATCHFLEET_PRIORITY_SCHEDULING says otherwise). Returns what was started, in words."""
    env = child_env(config, config.redis_url, config.run)
    if priority:
        env.setdefault("BATCHFLEET_PRIORITY_SCHEDULING", "1")
    for group, queue in zip(groups, queues_of(config.run, groups), strict=True):
        label = group_label(group)
        procs.workers[label] = procs.start(f"worker-{label}", [exe("rq"), "worker", queue], env)
    start_head(procs, config, interval_s=head_interval_s)
    if supervisor:
        procs.others["supervisor"] = procs.start(
            "supervisor", [exe("supervisor"), "watch", *(["--dry-run"] if dry_run else []),
                           *(["--fresh-start"] if fresh_start else [])], env)
    workers = f"{len(groups)} worker(s) ({config.run}.{group_label(groups[0])} ...), " if groups else ""
    return (f"started {workers}the head" + (", the supervisor" + (" (advising only)" if dry_run else "")
                                             if supervisor else ""))


def start_head(procs: Procs, config: Config, *, interval_s: float = 1.0) -> None:
    """The head (`producer head`) of the config's run: (again) under the name `head`."""
    procs.others["head"] = procs.start("head", [exe("producer"), "head", "--interval", f"{interval_s:g}"],
                                       child_env(config, config.redis_url, config.run))


def own_dirs(config: Config) -> Config:
    """The state dir (0700, like `producer enqueue`'s) and this run's log dir, <state dir>/logs/<run>
    (logs are per run: another run in the same state dir never appends to them). A directory that
    cannot be made or written is a usage error now, before anything starts."""
    state = config.state_dir.absolute()
    logs = ((config.log_dir or state / "logs") / config.run).absolute()
    for what, path in (("state dir", state), ("log dir", logs)):
        if problem := private_dir_problem(path):
            raise UsageError(f"{what} {path} cannot be created or written: {problem}")
    return config.with_(state_dir=state, log_dir=logs)


@contextlib.contextmanager
def fleet_redis(config: Config, given: str | None, say: Callable[[str], None]) -> Iterator[str]:
    """The Redis URL the fleet meets at: `given` when it answers, else a private redis-server (stopped
    when the block ends)."""
    if given and answers(given):
        say(f"Redis: {redacted(given)}")
        yield given
        return
    private = PrivateRedis(config.state_dir / f"{config.run}.redis", run=config.run).start()
    try:
        say(("Redis: none answers at " + redacted(given) + "; " if given else "Redis: ")
            + f"a private redis-server at {private.url} (append-only file in {private.dir})")
        yield private.url
    finally:
        private.stop()


# --- events -----------------------------------------------------------------------------------------
def event_line(e: Event) -> str:
    first = e.message.splitlines()[0] if e.message else ""
    return f"{time.strftime('%H:%M:%S', time.localtime(e.ts))} {e.source or '?'} {e.kind}: {first}"


class Events:
    """New events of the run's stream since this launch."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.key = r, keys.events
        last = r.xrevrange(self.key, count=1)
        self.after = last[0][0] if last else b"0-0"

    def new(self) -> list[Event]:
        out = []
        for eid, fields in self.r.xrange(self.key, min=b"(" + self.after, count=500):
            self.after = eid
            try:
                out.append(Event.from_json(fields[b"e"]))
            except Exception:  # a record this version cannot read: skip it, never stop the run
                continue
        return out


# --- what a launcher says when it cannot go on ----------------------------------------------------------
# Every error a person can cause or fix (a launcher catches these; anything else is a bug)
LAUNCH_ERRORS = (RunActive, UsageError, ConfigError, StoreError, PrivateRedisError, MissingExtra, redis.RedisError,
                 sqlite3.Error, OSError)


def launch_failed(exc: BaseException) -> int:
    """One line on stderr for a launcher's error (one of `LAUNCH_ERRORS`); returns its exit code:
    EXIT_ACTIVE when another launcher of the run is active (its lease, or its private Redis), else
    EXIT_ERROR."""
    if isinstance(exc, RunActive | PrivateRedisBusy):
        text, code = str(exc), EXIT_ACTIVE
    elif isinstance(exc, redis.RedisError):
        text, code = f"Redis failed: {type(exc).__name__}: {exc}", EXIT_ERROR
    elif isinstance(exc, sqlite3.Error):
        text, code = f"store: {exc}", EXIT_ERROR
    elif isinstance(exc, OSError):  # a file or directory that cannot be made, read or written
        text, code = (f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)), EXIT_ERROR
    else:
        text, code = str(exc), EXIT_ERROR
    error_line("batchfleet", text)
    return code
