"""`batchfleet serve [--host 127.0.0.1] [--port 8000] [--gpus 0-7 [--tp N]]`: the OpenAI Batch API on
this fleet (batchapi/, docs/api.md).

    1. Redis: the one at --redis-url / BATCHFLEET_REDIS_URL / REDIS_URL when it answers, else a private
       redis-server with an append-only file in the state dir (as `batchfleet run`).
    2. The run's store (run `serve` unless --run / BATCHFLEET_RUN names another), ready for batches.
    3. With --gpus: this host's workers, the head and the autopilot, started as `batchfleet run` starts
       them (fleetrun.launch), their servers scheduling by priority. Without: the head only; workers
       started elsewhere with BATCHFLEET_RUN=<run> serve it (the multi-host recipe), and need
       BATCHFLEET_PRIORITY_SCHEDULING=1 for a high batch to pass what waits inside their servers.
    4. The API until SIGINT/SIGTERM, one line per supervisor decision or server restart, and the tenants'
       rows (share, weight, queued, done) when they change; a head that exits is started again; SIGHUP
       reads the tenants file (--tenants) again. Then the workers drain (they hand back what they hold)
       and stop.

`batchfleet serve hash-key` prints the SHA-256 of the API key on stdin, as the tenants file keeps it.

Exit status: 0 stopped by SIGINT/SIGTERM; 2 usage, configuration, Redis, store or I/O error, a port
in use, an open API on a non-loopback address; 3 another `batchfleet serve` or `batchfleet run` of
the run is active (nothing was started); 130 interrupted while starting. One line on stderr, never
a traceback.

Files as `batchfleet run` keeps them (fleetrun.launch): the state dir is 0700, the run logs to
<state dir>/logs/<run>/ with a header line per launch, and the launcher lease in Redis
(fleetrun.lease) keeps a second launcher of the same run from starting anything.
"""

from __future__ import annotations

import argparse
import errno
import getpass
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from batchfleet.cliopts import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    broken_pipe,
    error_line,
    port,
    positive,
)
from batchfleet.config import Config
from batchfleet.connection import connect
from batchfleet.keys import Keys
from batchfleet.redact import Scrubber, install_log_scrubbing

from .launch import (
    LAUNCH_ERRORS,
    Events,
    Procs,
    check_gpus,
    check_model_path,
    event_line,
    fleet_redis,
    gpu_groups,
    launch_failed,
    own_dirs,
    parse_gpus,
    queues_of,
    start_fleet,
    start_head,
)
from .lease import SERVE, LaunchLease

if TYPE_CHECKING:
    from batchapi import ApiKeys, ServeOptions
    from batchapi.fleet import TenantRow

__all__ = ["add_parser", "main"]

DEFAULT_RUN = "serve"
RESTART_AFTER_S = 5.0  # a head that exited is started again after this
HUP = threading.Event()  # a SIGHUP came before the API served (or while the fleet stops): ignored then


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("serve", help="the OpenAI Batch API (Files and Batches) on this fleet (docs/api.md)",
                       description=__doc__.split("\n\n")[0], parents=[parent])
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; another than loopback needs API keys)")
    s.add_argument("--port", type=port, default=8000, metavar="PORT", help="port to listen on (default: 8000)")
    s.add_argument("--gpus", metavar="GPUS", help="also run this host's workers on these GPUs, e.g. 0-7 or 0,2,5, "
                   "with the head and the autopilot (default: none here: workers elsewhere serve the run)")
    s.add_argument("--tp", type=positive(int), default=1, metavar="N",
                   help="GPUs per server, tensor parallel (default: 1)")
    s.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the run's store, the API's files and records, logs (default: BATCHFLEET_STATE_DIR, else "
                        ".batchfleet)")
    s.add_argument("--api-keys-file", type=Path, metavar="FILE",
                   help="bearer API keys, one a line, mode 0600 (also: BATCHFLEET_API_KEYS, comma-separated)")
    s.add_argument("--tenants", type=Path, metavar="FILE",
                   help="the tenants file (TOML, mode 0600): keys as SHA-256, weights, quotas, priorities; read again "
                        "on SIGHUP (also: BATCHFLEET_TENANTS_FILE)")
    s.add_argument("action", nargs="?", choices=("hash-key",),
                   help="hash-key: print the SHA-256 of the API key read from stdin, for the tenants file")
    s.add_argument("--model", metavar="NAME",
                   help="body.model of a request without one (default: BATCHFLEET_MODEL_PATH, else 'default')")
    s.add_argument("--max-upload-mb", type=positive(), default=200.0, metavar="MB",
                   help="largest file upload, in MB (default: 200)")
    s.add_argument("--max-requests", type=positive(int), default=50_000, metavar="N",
                   help="most requests in one batch (default: 50000)")
    s.add_argument("--completion-window-s", type=positive(), default=24 * 3600.0, metavar="S",
                   help="how long a batch's `24h` window lasts: past it the batch expires (default: 86400)")
    s.add_argument("--dry-run", action="store_true", help="with --gpus: the supervisor only advises")
    s.add_argument("--no-supervisor", action="store_true", help="with --gpus: do not start `supervisor watch`")


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} serve: {text}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    """`batchfleet serve`: exit status as the module doc says; one line on stderr for every mistake."""
    def interrupt(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)  # while starting, SIGTERM is a Ctrl-C: cleanup runs
    old_hup = signal.signal(signal.SIGHUP, lambda _sig, _frame: HUP.set())  # read again once serving
    try:
        return _serve(args)
    except BrokenPipeError:
        return broken_pipe()
    except LAUNCH_ERRORS as exc:
        return launch_failed(exc)
    except KeyboardInterrupt:
        error_line("batchfleet", "interrupted while starting")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGHUP, old_hup)


def _hash_key() -> int:
    """`batchfleet serve hash-key`: the SHA-256 of the key on stdin (asked without echo on a terminal)."""
    from batchapi.auth import key_hash

    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.read()
    key = key.strip()
    if not key or any(c.isspace() or ord(c) < 33 for c in key):
        raise UsageError("hash-key: give one API key on stdin (no space or control character in it)")
    print(key_hash(key))
    return EXIT_OK


def _serve(args: argparse.Namespace) -> int:
    from batchapi import ApiKeys, AuthError, ServeOptions, check_exposure

    if args.action == "hash-key":
        return _hash_key()
    run = args.run or os.environ.get("BATCHFLEET_RUN") or DEFAULT_RUN
    config = Config.from_env(run=run, redis_url=args.redis_url, state_dir=args.state_dir, tenants_file=args.tenants)
    if args.port == 0:
        raise UsageError("--port 0: give the port the API listens on (1-65535)")
    try:
        keys = ApiKeys.from_config(config, args.api_keys_file)
        check_exposure(args.host, keys)
    except AuthError as exc:
        raise UsageError(str(exc)) from None
    if args.gpus is None and args.tp != 1:
        raise UsageError("--tp goes with --gpus (the GPUs whose servers it groups)")
    if args.gpus:
        check_gpus(parse_gpus(args.gpus))
    groups = gpu_groups(parse_gpus(args.gpus), args.tp) if args.gpus else []
    if groups and not config.model_path:
        raise UsageError("BATCHFLEET_MODEL_PATH is not set: the model every GPU's server loads")
    if groups:
        check_model_path(config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s serve: %(message)s", datefmt="%H:%M:%S")
    install_log_scrubbing(Scrubber.for_config(config))
    queues = queues_of(run, groups) if groups else config.queues
    options = ServeOptions(host=args.host, port=args.port, max_upload_bytes=int(args.max_upload_mb * 1_000_000),
                           max_requests=args.max_requests, window_s=args.completion_window_s,
                           model=args.model or config.model_path or "default", queues=queues)
    config = own_dirs(config)  # the state dir (0700) and <state dir>/logs/<run>/, or a usage error now
    _check_port(args.host, args.port)  # before anything starts
    given = args.redis_url or os.environ.get("BATCHFLEET_REDIS_URL") or os.environ.get("REDIS_URL")
    with fleet_redis(config, given, _say) as url:
        config = config.with_(redis_url=url)
        r = connect(url)
        r.ping()
        lease = LaunchLease(r, Keys(run), command=SERVE)
        lease.acquire()  # before anything starts: a second serve (or run) of this run stops here
        try:
            return _serve_leased(args, config, r, keys, options, groups)
        finally:
            lease.release()


def _serve_leased(args: argparse.Namespace, config: Config, r: redis.Redis, keys: ApiKeys, options: ServeOptions,
                  groups: list[tuple[int, ...]]) -> int:
    """What runs under the launcher lease: the store made ready, the fleet started, the API until a signal."""
    from batchapi import ServeError, prepare_store, serve_api

    run = config.run
    queues = options.queues
    prepare_store(config, r, queues)
    logs = config.logs  # <state dir>/logs/<run>, 0700 (see launch.own_dirs)
    procs = Procs(logs, launcher=SERVE)
    watch = _Watch(procs, r, Keys(run), config, groups)
    try:
        started = start_fleet(procs, config, groups, supervisor=bool(groups) and not args.no_supervisor,
                              dry_run=args.dry_run, priority=True)
        _say(f"run {run}: {started}; logs in {logs}"
             + ("" if groups else f"; workers elsewhere serve it: BATCHFLEET_RUN={run} "
                                  "BATCHFLEET_PRIORITY_SCHEDULING=1 rq worker <host>.gpuN (docs/multihost.md)"))
        auth = f"{len(keys)} API key(s)" if keys.enabled else "no API key (loopback only)"
        if keys.tenants_file is not None:
            auth += f", {len(keys.by_name)} tenant(s) (SIGHUP reads {keys.tenants_file} again)"
        serve_api(config, r, keys, options, tick=watch.tick, on_rows=_tenant_rows, hup=HUP,
                  on_ready=lambda where: _say(f"the OpenAI Batch API at {where} ({auth}); Ctrl-C stops"))
    except ServeError as exc:
        raise UsageError(str(exc)) from None
    finally:
        _stop(procs, config)
    return EXIT_OK


def _tenant_rows(rows: list[TenantRow]) -> None:
    """The screen's tenant rows: share of the output tokens over the last minute, weight, queued, done."""
    width = max(len(t.name) for t in rows)
    _say("tenants: share (output tokens, last minute), weight, requests queued, done")
    for t in rows:
        _say(f"  {t.name:<{width}}  share {t.share:4.0%}  weight {t.weight:g}  queued {t.queued:,}  done {t.done:,}")


def _check_port(host: str, port: int) -> None:
    """The API's address can be bound (as aiohttp binds it: SO_REUSEADDR), or a usage error now."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"--host {host}: {exc.strerror or exc}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            why = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise UsageError(f"cannot serve on {host}:{port}: {why}") from None


def _stop(procs: Procs, config: Config) -> None:
    force = [False]

    def again(_sig: int, _frame: object) -> None:
        force[0] = True

    old = {sig: signal.signal(sig, again) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if procs.all():
            _say("stopping: the workers hand back what they hold (Ctrl-C again to kill at once)")
        codes = procs.stop(config.shutdown_grace_s + 30, force)
        bad = {n: c for n, c in codes.items() if c not in (0, -signal.SIGTERM)}
        if bad:
            _say("exit codes: " + ", ".join(f"{n} {c}" for n, c in bad.items()) + f" (logs in {procs.logs})")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class _Watch:
    """Called every second while the API serves: the run's events, and the fleet's processes."""

    def __init__(self, procs: Procs, r: redis.Redis, keys: Keys, config: Config, groups: list[tuple[int, ...]]) -> None:
        self.procs = procs
        self.events = Events(r, keys)
        self.config = config
        self.groups = groups
        self.said: set[str] = set()
        self.head_down_at: float | None = None

    def tick(self) -> bool:
        try:
            for e in self.events.new():
                _say(event_line(e))
        except redis.RedisError as exc:
            self._once(f"Redis: {type(exc).__name__}: {exc}")
        for g, w in self.procs.workers.items():
            if w.poll() is not None:
                self._once(f"worker-{g} exited {w.returncode}:\n{self.procs.tail(f'worker-{g}')}")
        head = self.procs.others.get("head")
        if head is not None and head.poll() is not None:
            now = time.monotonic()
            if self.head_down_at is None:
                self.head_down_at = now
                _say(f"the head exited {head.returncode}; starting it again in {RESTART_AFTER_S:g} s:\n"
                     f"{self.procs.tail('head')}")
            elif now - self.head_down_at >= RESTART_AFTER_S:
                self.head_down_at = None
                start_head(self.procs, self.config)
        return True

    def _once(self, text: str) -> None:
        if text not in self.said:
            self.said.add(text)
            _say(text)

