"""Configuration: one typed, frozen object, built in one place from the environment.

Every setting is an environment variable `BATCHFLEET_<FIELD>` (upper case), so `rq worker gpu0`,
`producer` and `supervisor` on every host read the same thing. A misspelled `BATCHFLEET_*`
variable is an error, not silently ignored. `REDIS_URL` (RQ's own variable) is honoured when
`BATCHFLEET_REDIS_URL` is not set. CLIs may override fields with `dataclasses.replace`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

import redis.connection

from .errors import ConfigError
from .keys import FINISHED_TTL_S, valid_queue_name
from .records import STRATEGIES
from .redact import MASK, redact_argv, redact_url

__all__ = ["DEFAULT_QUEUE", "DEFAULT_QUEUE_PATTERN", "EVENT_LOOPS", "GPU_LOCAL_PART", "STRATEGIES", "Config",
           "expand_queues", "gpu_group_for_queue", "gpu_index_for_queue", "group_label", "lora_item",
           "model_path_problem", "queue_host", "redis_url_problem"]

ENV_PREFIX = "BATCHFLEET_"
DEFAULT_QUEUE = "gpu0"  # where prompts go when no queue is given and no worker has reported

EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # Config.event_loop
# Queue names (see docs/multihost.md): unique fleet-wide, `[<run>.][<host>.]gpuN`. The last
# dot-separated part is the local part and names the GPU, or the group of GPUs of one server, on the
# worker's own host: `hostb.gpu3` runs on local GPU 3 at port base + 3, exactly like `gpu3` on a single
# host; `hostb.gpu0-3` on GPUs 0, 1, 2 and 3 (one tensor-parallel server) at port base + 0; `gpu0_2`
# on GPUs 0 and 2 (ranges and single GPUs joined by `_`).
QUEUE_NAME = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
GPU_LOCAL_PART = r"gpu\d+(?:-\d+)?(?:_\d+(?:-\d+)?)*"
LOCAL_PART = re.compile(GPU_LOCAL_PART)
# Every GPU queue, host-qualified or not: what a worker may take from when its own queue is dry.
DEFAULT_QUEUE_PATTERN = r"(?:[A-Za-z0-9_-]+\.)*" + GPU_LOCAL_PART
_RANGE = re.compile(r"\[(\d+)-(\d+)\]")


@dataclass(frozen=True, slots=True, repr=False)
class Config:
    # Where the fleet meets.
    redis_url: str = "redis://127.0.0.1:6379/0"
    run: str = "default"
    state_dir: Path = Path(".batchfleet")  # results database and logs on the producer/worker host
    # Where a worker writes its server's log and pid file, and `batchfleet run` its processes' logs
    # (unset: <state_dir>/logs; `batchfleet run` gives each run its own, <state_dir>/logs/<run>).
    log_dir: Path | None = None
    # Queues the head feeds besides those live workers serve (recorded for the run at enqueue). Empty:
    # the live fleet's queues, or DEFAULT_QUEUE when no worker has reported yet.
    queues: tuple[str, ...] = ()
    queue_pattern: str = DEFAULT_QUEUE_PATTERN  # which RQ queues a worker may take work from when its own is dry

    # The SGLang server a worker owns.
    sglang_cmd: str = "python -m sglang.launch_server"
    model_path: str = ""
    server_args: str = ""  # extra launch flags, shell-quoted
    strategy: str = "default"  # one of STRATEGIES
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    server_host: str = "127.0.0.1"
    port_base: int = 30000
    gpu: int | None = None  # overrides the index taken from the queue name
    server_api_key: str = ""
    startup_timeout_s: float = 1200.0  # a 27B model can take many minutes to load and capture graphs

    # How a worker runs prompts.
    max_in_flight: int | None = None  # cap below the server's capacity (normally unset: fill the server)
    # Prompts kept waiting in the server's own queue beyond its capacity, so a finished slot is refilled
    # at the server's next step rather than after a round trip to the worker and Redis. Unset: sized
    # from the measured turnover (worker/slots.py, Turnover); 0: none; N: exactly N.
    surplus: int | None = None
    request_timeout_s: float = 3600.0  # one long generation, not the httpx default of 5 s
    # The worker's event loop: "auto" (uvloop when installed: ~10% less CPU per prompt; SGLang itself
    # needs it, so a GPU host has it), "uvloop" (required), or "asyncio" (the standard library's).
    event_loop: str = "auto"
    max_attempts: int = 6  # transient failures per prompt before it is failed
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    lease_ttl_s: float = 15.0  # a dead worker's prompts run again after at most this (+ reaper period)
    status_interval_s: float = 2.0
    health_interval_s: float = 10.0  # how often a worker asks its server for a real generation
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight prompts get this long before they are handed back
    # A server that cannot start this many times in a row (or is restarted this many times for being
    # sick) marks its GPU `failed`: no work is taken; it tries again when told or after failed_retry_s.
    server_start_attempts: int = 3
    failed_retry_s: float = 600.0
    # The circuit breaker: this many different prompts failing in a row on one server (nothing succeeding
    # between) make it the server's fault (worker.breaker).
    breaker_prompts: int = 5
    max_pending_results: int = 500_000  # stop taking work when the collector falls this far behind
    # ... or when the results stream holds about this many bytes (its length x the worker's mean result
    # size): an embedding result carries its vectors (~20 KB a 1024-dimension input), so a count alone let
    # a fleet whose head had stopped fill Redis's memory long before 500,000 results
    max_pending_result_bytes: int = 256 * 1024 * 1024

    # Tests only: shift every wall-clock reading a worker takes (status/event/result timestamps) by this
    # many seconds, to show that no lease or timeout decision trusts a host's clock (they use Redis TIME).
    test_clock_offset_s: float = 0.0

    # The window the head keeps in Redis, per queue: max(2 x the workers' effective capacity, window_s of
    # the queue's measured throughput), at most window_max; window_default before any worker reports.
    window_s: float = 60.0
    window_default: int = 1000
    window_max: int = 20_000
    # A shared fleet (`batchfleet serve`'s tenants, producer/share.py): a queue holds share_window_s of
    # its throughput (a tenant's new batch waits behind no more of another's work), and a tenant's usage
    # halves every share_half_life_s (how long one that was idle may have the fleet before sharing).
    share_window_s: float = 4.0
    share_half_life_s: float = 300.0
    # Start servers with --enable-priority-scheduling --disable-priority-preemption, and send a shared
    # fleet's high-priority prompts with a request priority: the server runs them before those waiting
    # in its own queue, never preempting one that runs (`batchfleet serve` turns it on for its workers).
    priority_scheduling: bool = False
    # LoRA adapters every server of the fleet loads at start (`name=path`, comma-separated; SGLang's
    # `--lora-paths` items): the worker starts its server with `--enable-lora --lora-paths ...`, and a
    # line naming an adapter outside them (or the `--lora-paths` of BATCHFLEET_SERVER_ARGS) is refused at
    # enqueue. `max_loras_per_batch`: `--max-loras-per-batch` (the adapters one running batch may hold,
    # the base model counting; unset: SGLang's 8).
    lora_paths: tuple[str, ...] = ()
    max_loras_per_batch: int | None = None

    # A finished run's keys (every prompt has its result in the store) expire after this (see producer.ends).
    finished_ttl_s: int = FINISHED_TTL_S

    # `batchfleet serve`: the bearer API keys it accepts (comma-separated), or a file of them (one a
    # line, mode 0600). Secrets: never shown; the API keeps only their SHA-256.
    api_keys: tuple[str, ...] = ()
    api_keys_file: Path | None = None
    # `batchfleet serve`'s tenants (keys as SHA-256, weights, quotas, priorities): a TOML file, mode 0600,
    # read at start and on SIGHUP (docs/api.md).
    tenants_file: Path | None = None

    def __post_init__(self) -> None:
        problem = redis_url_problem(self.redis_url)
        if problem:
            raise ConfigError(problem)
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.run):
            raise ConfigError(f"run name {self.run!r} may only hold letters, digits, '_', '.' and '-'")
        bad = [q for q in self.queues if not valid_queue_name(q)]
        if bad:
            raise ConfigError(f"queue names may only hold letters, digits, '_', '.' and '-': {', '.join(bad)}")
        if self.finished_ttl_s < 1:
            raise ConfigError("finished_ttl_s must be at least 1 (seconds)")
        if self.window_s <= 0 or self.window_default < 1 or self.window_max < 1:
            raise ConfigError("window_s, window_default and window_max must be positive")
        if self.share_window_s <= 0 or self.share_half_life_s <= 0:
            raise ConfigError("share_window_s and share_half_life_s must be positive")
        try:
            re.compile(self.queue_pattern)
        except re.error as exc:
            raise ConfigError(f"queue_pattern {self.queue_pattern!r} is not a regular expression: {exc}") from None
        if self.tenants_file is not None and self.tenants_file.suffix != ".toml":
            raise ConfigError(f"tenants_file {str(self.tenants_file)!r}: the tenants file is TOML and its name ends "
                              "in .toml (docs/api.md)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("lease_ttl_s", "status_interval_s", "health_interval_s", "request_timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.surplus is not None and self.surplus < 0:
            raise ConfigError("surplus must be 0 (none), a positive number, or unset (sized from turnover)")
        if any(c in self.server_api_key for c in "\r\n\0"):
            raise ConfigError("server_api_key holds a line break or NUL: it could not travel in a header")
        if self.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"event_loop {self.event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        if self.server_start_attempts < 1 or self.breaker_prompts < 1:
            raise ConfigError("server_start_attempts and breaker_prompts must be at least 1")
        if self.failed_retry_s <= 0:
            raise ConfigError("failed_retry_s must be positive")
        if self.max_pending_result_bytes < 1:
            raise ConfigError("max_pending_result_bytes must be at least 1")
        try:
            shlex.split(self.sglang_cmd + " " + self.server_args)
        except ValueError as exc:
            raise ConfigError(f"sglang_cmd/server_args do not parse as shell words: {exc}") from exc
        if self.max_loras_per_batch is not None and self.max_loras_per_batch < 1:
            raise ConfigError("max_loras_per_batch must be at least 1")
        names = [lora_item(item)[0] for item in self.lora_paths]  # raises ConfigError for a bad item
        if len(set(names)) != len(names):
            twice = sorted(n for n in set(names) if names.count(n) > 1)
            raise ConfigError(f"lora_paths names an adapter twice: {', '.join(twice)}")
        if self.lora_paths and "--lora-paths" in self.server_argv_extra:  # argparse would keep one list only
            raise ConfigError("the LoRA adapters are given twice, in BATCHFLEET_LORA_PATHS and as --lora-paths in "
                              "BATCHFLEET_SERVER_ARGS: give them once")

    def __repr__(self) -> str:
        """Secrets hidden: a configuration may end up in a log line or a traceback."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "redis_url":
                value = redact_url(value)
            elif f.name == "server_api_key" and value:
                value = MASK
            elif f.name == "api_keys":
                value = tuple(MASK for _ in value)
            elif f.name == "server_args":
                value = shlex.join(redact_argv(shlex.split(value)))
            shown.append(f"{f.name}={value!r}")
        return f"Config({', '.join(shown)})"

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Build the configuration from `env` (default: os.environ), then apply `overrides`."""
        env = os.environ if env is None else env
        hints = get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {ENV_PREFIX}{close[0].upper()}?)" if close else ""
                raise ConfigError(f"unknown setting {key}{hint}")
            values[name] = _parse(name, hints[name], raw)
        if not values.get("redis_url") and env.get("REDIS_URL"):  # an empty BATCHFLEET_REDIS_URL is unset
            values["redis_url"] = env["REDIS_URL"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> Config:
        return replace(self, **changes)

    # --- derived values ------------------------------------------------------------------------
    @property
    def server_argv_extra(self) -> list[str]:
        return shlex.split(self.server_args)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The fleet's LoRA adapters, name -> path: BATCHFLEET_LORA_PATHS, then the `--lora-paths` items
        BATCHFLEET_SERVER_ARGS gives (as SGLang reads them: `<PATH>`, `<NAME>=<PATH>`, a JSON object)."""
        out = dict(lora_item(item) for item in self.lora_paths)
        extra = self.server_argv_extra
        for i, token in enumerate(extra):
            if token != "--lora-paths":
                continue
            for item in extra[i + 1:]:
                if item.startswith("--"):
                    break
                out.setdefault(*lora_item(item))
        return out

    @property
    def logs(self) -> Path:
        """The log directory: `log_dir`, else <state_dir>/logs."""
        return self.log_dir if self.log_dir is not None else self.state_dir / "logs"

    @property
    def results_db(self) -> Path:
        return self.state_dir / f"{self.run}.sqlite"

    def port_for(self, gpu: int) -> int:
        return self.port_base + gpu


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, as one line that shows the fix; None when redis-py can use it.
    `localhost:6379` (no scheme) -> "... write redis://localhost:6379/0"."""
    if not url.strip():
        return "the Redis URL is empty: set BATCHFLEET_REDIS_URL (or REDIS_URL), e.g. redis://localhost:6379/0"
    if not url.startswith(REDIS_SCHEMES):
        if "://" in url:
            return (f"Redis URL {redact_url(url)!r}: the scheme must be redis://, rediss:// (TLS) or unix:// "
                    "(e.g. redis://localhost:6379/0)")
        fixed = redact_url("redis://" + url.strip().lstrip("/"))
        shown = fixed[len("redis://"):]
        head, _, query = shown.partition("?")
        if head and "/" not in head:  # no database: add it, and the port when there is none
            has_port = re.search(r":\d+$", head.rpartition("@")[2]) is not None
            fixed = "redis://" + head + ("" if has_port else ":6379") + "/0" + (f"?{query}" if query else "")
        return f"Redis URL {shown!r} has no scheme: write {fixed} (rediss:// for TLS)"
    try:
        redis.connection.parse_url(url)
    except ValueError as exc:
        return f"Redis URL {redact_url(url)!r}: {exc} (e.g. redis://localhost:6379/0)"
    return None


def gpu_group_for_queue(queue: str) -> tuple[int, ...] | None:
    """The local GPUs a queue names (one server's): its last dot-separated part. `hostb.gpu3` -> (3,),
    `hostb.gpu0-3` -> (0, 1, 2, 3), `gpu0_2` -> (0, 2), `gpu0-1_4-5` -> (0, 1, 4, 5); None when the last
    part names no GPU (`cpu`, `gpu3.hostb`), a range runs backwards (`gpu3-1`) or a GPU comes twice."""
    local = queue.rpartition(".")[2]
    if not LOCAL_PART.fullmatch(local):
        return None
    out: list[int] = []
    for item in local[3:].split("_"):
        lo, _, hi = item.partition("-")
        first, last = int(lo), int(hi or lo)
        if first > last or last - first >= 1024:
            return None
        out.extend(range(first, last + 1))
    return tuple(out) if len(set(out)) == len(out) else None


def model_path_problem(path: str) -> str | None:
    """A model path that looks local (`/`, `./`, `../`, `~`) and does not exist: SGLang would take it for a
    hub id and die at start-up on every GPU (it expands no `~`). None when it exists or is a hub id."""
    if not path.startswith(("/", "./", "../", "~")) or os.path.exists(path):
        return None
    hint = " (SGLang does not expand ~: give the full path)" if path.startswith("~") else ""
    return f"the model path {path!r} (BATCHFLEET_MODEL_PATH) does not exist on this host{hint}"


def gpu_index_for_queue(queue: str) -> int | None:
    """The first local GPU a queue names: `gpu3` -> 3, `hostb.gpu3` -> 3, `jobA.hostb.gpu12` -> 12,
    `hostb.gpu4-7` -> 4 (its server's port is base + 4); None when the last part names no GPU."""
    group = gpu_group_for_queue(queue)
    return group[0] if group else None


def group_label(gpus: tuple[int, ...] | list[int]) -> str:
    """The local part of a queue for these GPUs: `gpu3`, `gpu0-3` (a run), `gpu0_2`, `gpu0-1_4-5`."""
    parts: list[str] = []
    i = 0
    while i < len(gpus):
        j = i
        while j + 1 < len(gpus) and gpus[j + 1] == gpus[j] + 1:
            j += 1
        parts.append(str(gpus[i]) if i == j else f"{gpus[i]}-{gpus[j]}")
        i = j + 1
    return "gpu" + "_".join(parts)


def queue_host(queue: str) -> str:
    """The part of a queue name before its local part (`hostb` in `hostb.gpu3`, `jobA.hostb` in
    `jobA.hostb.gpu3`, "" for `gpu3`)."""
    return queue.rpartition(".")[0]


def expand_queues(text: str) -> tuple[str, ...]:
    """Comma-separated queue names, each with at most one `[A-B]` range: `hosta.gpu[0-7],hostb.gpu[0-7]`
    is 16 queues. Duplicates are dropped, order kept. Raises ConfigError on a malformed name."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        ranges = _RANGE.findall(part)
        if len(ranges) > 1:
            raise ConfigError(f"queue {part!r}: one [A-B] range per name")
        names = [part]
        if ranges:
            lo, hi = int(ranges[0][0]), int(ranges[0][1])
            if lo > hi or hi - lo >= 4096:
                raise ConfigError(f"queue {part!r}: range [{lo}-{hi}] is empty or too large")
            names = [_RANGE.sub(str(i), part, count=1) for i in range(lo, hi + 1)]
        for name in names:
            if not QUEUE_NAME.fullmatch(name):
                raise ConfigError(f"queue name {name!r}: letters, digits, '_' and '-', in dot-separated parts")
            out.append(name)
    return tuple(dict.fromkeys(out))


def lora_item(item: str) -> tuple[str, str]:
    """(name, path) of one `--lora-paths` item as SGLang 0.5.23 reads it (`LoRAPathAction`): `<PATH>`
    (its name is the path), `<NAME>=<PATH>` (split at the first `=`), or a JSON object with
    `lora_name` and `lora_path`; ConfigError for an empty one."""
    item = item.strip()
    if item.startswith("{") and item.endswith("}"):
        try:
            obj = json.loads(item)
            name, path = str(obj["lora_name"]), str(obj["lora_path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"LoRA adapter {item!r}: a JSON item holds lora_name and lora_path ({exc})") from None
    elif "=" in item:
        name, path = item.split("=", 1)
    else:
        name = path = item
    if not name.strip() or not path.strip():
        raise ConfigError(f"LoRA adapter {item!r}: want NAME=PATH")
    return name.strip(), path.strip()


def _parse(name: str, hint: Any, raw: str) -> Any:
    text = str(hint)
    try:
        if raw == "" and "None" in text:
            return None
        if "tuple" in text:
            return tuple(p.strip() for p in raw.split(",") if p.strip())
        if "Path" in text:
            return Path(raw)
        if "float" in text:
            return float(raw)
        if "int" in text:
            return int(raw)
        if "bool" in text:
            return raw.strip().lower() in {"1", "true", "yes", "on"}
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from exc
    return raw
