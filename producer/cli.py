"""`producer`: enqueue a JSONL file of prompts into the run's store, feed and collect (the head process),
show status, export, recover.

Exit status: 0 done; 1 something needs attention (rejected lines, prompts still pending: `export`
still writes the partial file); 2 usage, configuration, store, Redis or I/O errors, a run that does
not exist (one line on stderr, no traceback); 130 interrupted; 141 stdout closed (`| head`).
docs/cli.md lists every command and option. Settings come from
`BATCHFLEET_*` (see batchfleet.config); `--run`, `--redis-url`, `--state-dir` override them. Without
`--state-dir`, commands use the store the run's marker in Redis names (see producer.locate).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

import redis

from batchfleet.cliopts import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    REDIS_HELP,
    Parser,
    UsageError,
    add_common,
    at_least,
    broken_pipe,
    error_line,
    positive,
)
from batchfleet.config import Config, expand_queues
from batchfleet.connection import connect, redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys
from batchfleet.marker import repair_command
from batchfleet.redact import Scrubber
from batchfleet.runs import UnknownRun, require_run, runs_in, unknown_run_message

from . import api, ends
from .collect import collect_once
from .enqueue import EmptyInput
from .export import ExportError, export
from .feed import feed_pass
from .head import Head
from .inputs import MissingExtra, input_problem
from .locate import Access, Located, NoStore, ensure_marker, locate
from .parse import Reject, check_sampling, parse_param
from .queues import LIVE, live_queues
from .recover import recover
from .runs import format_runs, list_runs
from .status import format_status, gather_status
from .store import StoreError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="producer", description=__doc__.split("\n\n")[0].replace("\n", " "))
    add_common(p)
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="directory of the run's store (default: BATCHFLEET_STATE_DIR, else the one the run "
                        "marker in Redis names, else .batchfleet)")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("enqueue", help="validate a JSONL file into the run's store and feed a first window to Redis")
    e.add_argument("file", help="JSONL input: .jsonl, .jsonl.gz, .jsonl.zst, or '-' for stdin")
    e.add_argument("--queues", metavar="QUEUES",
                   help="queues to spread over: names, `hosta.gpu[0-7]` ranges, or `live` (the live workers' queues), "
                        "comma-separated (default: BATCHFLEET_QUEUES)")
    e.add_argument("--max-tokens", type=int, metavar="N", help="max_tokens for lines that do not set it")
    e.add_argument("--temperature", type=float, metavar="T", help="temperature for lines that do not set it")
    e.add_argument("--top-p", type=float, metavar="P", help="top_p for lines that do not set it")
    e.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="default sampling parameter for lines that do not set it (repeatable)")
    e.add_argument("--model", metavar="NAME", help="body.model when a line has none (default: model path or 'default')")
    e.add_argument("--rejects", type=Path, metavar="FILE", help="rejected lines go here (default: FILE.rejects.jsonl)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    e.add_argument("--rerun-changed", action="store_true",
                   help="custom_ids the store holds with another request run again with the new one (their old "
                        "results are replaced); without it such a file is refused (exit 2)")
    e.add_argument("--no-plan", action="store_true",
                   help="feed by expected work alone (longest first): no prefix plan (prompts that share a prefix "
                        "are then spread over the servers)")

    for name, text in (("head", "the head process: keep each queue's window topped up from the store, collect "
                                "results, repair a Redis that lost the run's data (until SIGINT/SIGTERM)"),
                       ("collect", "move finished results from Redis into the store (--follow: run the head)")):
        c = sub.add_parser(name, help=text)
        if name == "collect":
            c.add_argument("--follow", action="store_true", help="keep going: the head process (`producer head`)")
        c.add_argument("--interval", type=positive(), default=2.0, metavar="S", help="seconds between passes")

    s = sub.add_parser("status", help="where every prompt is (read-only; works from the store when Redis is down)")
    s.add_argument("--json", action="store_true", help="one JSON object (keys: docs/store.md, 'Status')")

    ru = sub.add_parser("runs", help="the runs this Redis holds (their run markers), with their counts")
    ru.add_argument("--json", action="store_true", help="a JSON list, one object per run")

    x = sub.add_parser("export", help="write the OpenAI batch output file in input order (exit 0 complete, "
                                      "1 prompts still pending: partial file written, 2 error)")
    x.add_argument("out", type=Path, help="output file; its suffix picks the format: .jsonl, .jsonl.gz, "
                                          ".jsonl.zst, .parquet (extra [parquet])")
    x.add_argument("--errors", type=Path, metavar="FILE",
                   help="write failed prompts' lines here instead of into OUT (default: all lines in OUT)")
    x.add_argument("--wait", action="store_true", help="wait until no prompt is pending")
    x.add_argument("--timeout", type=positive(), metavar="S", help="with --wait: give up waiting after S seconds")

    c = sub.add_parser("cancel", help="cancel the run: remove its queued prompts from Redis, make its workers drop "
                       "the in-flight ones; results so far are kept (export marks the rest `cancelled`)")
    c.add_argument("--wait", type=at_least(0), default=30.0, metavar="S",
                   help="seconds to wait for the live workers to confirm")
    c = sub.add_parser("purge", help="delete every key of run RUN from Redis (SCAN; the store is kept)")
    c.add_argument("target", metavar="RUN", help="the run to purge")
    c.add_argument("--yes", action="store_true", help="really delete (without it: say what would go)")
    c.add_argument("--force", action="store_true", help="even while live workers of the run report")

    sub.add_parser("recover", help="requeue, from the store, the fed prompts that are nowhere in Redis or were "
                                   "failed by a non-batchfleet worker; restore the run marker")
    for name, sp in sub.choices.items():  # --run/--redis-url also after any subcommand
        if name != "runs":
            add_common(sp, sub=True)
        else:
            sp.add_argument("--redis-url", default=argparse.SUPPRESS, metavar="URL", help=REDIS_HELP)
    return p


def _defaults(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for key, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                           ("top_p", args.top_p)):
            if value is not None:
                out[check_sampling(key, value)] = value
        for text in args.param:
            key, value = parse_param(text)
            out[key] = value
    except Reject as exc:
        raise UsageError(str(exc)) from None
    return out


def _queues(text: str | None, config: Config) -> tuple[str, ...]:
    """`--queues`: names, `hosta.gpu[0-7]` ranges, and `live` (the queues live workers serve, which the
    head always feeds: it adds no name). Empty: only the live workers' queues."""
    if text is None:
        return config.queues
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise UsageError(f"--queues wants names like gpu0,gpu1, hosta.gpu[0-7] or live, got {text!r}")
    try:
        return expand_queues(",".join(p for p in parts if p != LIVE))
    except ConfigError as exc:
        raise UsageError(f"--queues: {exc}") from None


def _state_dir_given(args: argparse.Namespace) -> bool:
    return args.state_dir is not None or bool(os.environ.get("BATCHFLEET_STATE_DIR"))


def _say_lost(config: Config, loc: Located) -> None:
    print(f"producer: Redis lost the data of run {config.run} (its marker {Keys(config.run).meta} is gone while the "
          f"store has fed prompts: restarted without persistence, or a failover). Repair: "
          f"{repair_command(config.run, str(loc.store.path.parent))} (a running `producer head` does it by itself)",
          file=sys.stderr)


def _run(args: argparse.Namespace, config: Config, r: redis.Redis) -> int:
    explicit = _state_dir_given(args)
    if args.cmd == "runs":
        print(format_runs(list_runs(r), as_json=args.json))
        return 0
    if args.cmd in ("cancel", "purge"):
        if args.cmd == "cancel":
            return ends.run_cancel(config, r, explicit=explicit, wait_s=args.wait)
        config.with_(run=args.target)  # the same name rules as --run
        # a typo must not be "purged" (and exit 0): the run must be there
        require_run(r, args.target, where=f"in Redis at {redacted(config.redis_url)}")
        return ends.run_purge(config, r, args.target, yes=args.yes, force=args.force)
    if args.cmd == "status":
        loc = locate(config, r, explicit=explicit, access=Access.READ)
        try:
            print(format_status(gather_status(config, r, loc), as_json=args.json))
        finally:
            loc.store.close()
        return 0
    if args.cmd == "head" or (args.cmd == "collect" and args.follow):
        return Head(config, explicit=explicit, interval_s=args.interval, r=r).run()
    if args.cmd == "export":
        loc = locate(config, r, explicit=explicit, access=Access.WRITE)
        try:
            return _export(args, config, r, loc)
        finally:
            loc.store.close()
    r.ping()
    if args.cmd == "enqueue":
        return _enqueue(args, config, r, explicit)
    loc = locate(config, r, explicit=explicit, access=Access.WRITE)
    keys = Keys(config.run)
    try:
        if args.cmd == "collect":
            if loc.lost:
                _say_lost(config, loc)
            got = collect_once(r, loc.store, keys)
            print(f"collected {got.succeeded:,} succeeded, {got.failed:,} failed into {loc.store.path}"
                  + (f"; dropped {got.rejected:,} result(s) that answer no prompt of this run" if got.rejected else ""))
            return 0
        if args.cmd == "recover":
            with loc.store.write():
                if loc.store.fix_tally():
                    print("recover: the store's counts had drifted from its rows; recounted", file=sys.stderr)
            s = recover(r, loc.store, keys)
            marker = ensure_marker(r, config, loc.store)
            loc.store.plan.beside = False  # its one feed pass: a large store's plan is the head's
            fed = feed_pass(config, r, loc.store, marker.queues)
            print(f"recover: requeued {s.requeued:,} prompt(s) ({s.lost:,} that were nowhere in Redis, {s.foreign:,} "
                  f"failed by a non-batchfleet worker); {s.in_redis:,} fed prompt(s) are fine where they are; "
                  f"fed {fed.total:,} to Redis now, the head feeds the rest")
            return 0
        raise UsageError(f"unknown command {args.cmd}")
    finally:
        loc.store.close()


def _export(args: argparse.Namespace, config: Config, r: redis.Redis, loc: Located) -> int:
    if loc.redis_error is not None:
        print(f"producer: Redis at {redacted(config.redis_url)} is down ({loc.redis_error}): exporting what the "
              f"store {loc.store.path} holds (results still in Redis are not included)", file=sys.stderr)
    elif loc.lost:
        _say_lost(config, loc)
    try:
        ex = export(None if loc.redis_error else r, loc.store, Keys(config.run), args.out, wait=args.wait,
                    timeout_s=args.timeout, errors=args.errors)
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # e.g. the disk filled up while writing
        raise UsageError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    if ex.succeeded + ex.failed + ex.pending + ex.cancelled == 0:
        print(f"producer: run {config.run} has no prompts in its store {loc.store.path}: nothing to export "
              "(wrong --run?)", file=sys.stderr)
        return 2
    print(f"wrote {ex.written:,} lines to {ex.path} ({ex.succeeded:,} succeeded, {ex.failed:,} failed)"
          + (f"; {ex.errors_written:,} failed prompt(s) to {ex.errors_path}" if ex.errors_path else ""))
    if ex.cancelled:
        print(f"{ex.cancelled:,} line(s) are prompts the run's cancel took back (error code 'cancelled')")
    if ex.rejected:
        print(f"{ex.rejected:,} result(s) answered no prompt of this run (forged, or another run's) and are not "
              "exported", file=sys.stderr)
    if ex.pending:
        print(f"{ex.pending:,} prompts have no result yet, e.g. {', '.join(ex.first_pending)}", file=sys.stderr)
        return 1
    return 0


def _enqueue(args: argparse.Namespace, config: Config, r: redis.Redis, explicit: bool) -> int:
    defaults, queues = _defaults(args), _queues(args.queues, config)
    if args.queues is not None and LIVE in (p.strip() for p in args.queues.split(",")) \
            and not live_queues(r, Keys(config.run)):
        raise UsageError(f"--queues live: no live worker of run {config.run!r} reports a queue: start the workers "
                         "first, or name the queues (e.g. hosta.gpu[0-7],hostb.gpu[0-7])")
    problem = input_problem(args.file)
    if problem:
        raise UsageError(problem)
    # Ctrl-C may also surface as a read error of the input (a pipe torn down by the same Ctrl-C): it is
    # still an interruption, said as one.
    sigint: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        sigint.append(signum)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        done = api.enqueue(config, r, args.file, queues=queues, explicit=explicit, defaults=defaults,
                           model=args.model or config.model_path or "default", rejects_path=args.rejects,
                           progress=not args.no_progress, rerun_changed=args.rerun_changed, plan=not args.no_plan)
    except EmptyInput as exc:
        print(f"producer: warning: {exc}", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        return _interrupted(config, r, explicit)
    except MissingExtra as exc:
        raise UsageError(str(exc)) from None
    except (OSError, EOFError) as exc:  # a corrupt .gz/.zst, a read error
        if sigint:
            return _interrupted(config, r, explicit)
        other = getattr(exc, "filename", None)
        if other and str(other) != str(args.file):  # the store's directory, the rejects file
            raise UsageError(f"{other}: {exc.strerror or exc}") from None
        raise UsageError(f"{args.file}: cannot read: {exc}") from None
    finally:
        signal.signal(signal.SIGINT, previous)
    done.store.close()
    s, fed = done.summary, done.fed
    rate = s.lines / s.seconds if s.seconds else 0.0
    print(f"{args.file}: {s.lines:,} lines in {s.seconds:.1f} s ({rate:,.0f}/s): {s.counts()}; store {done.store.path}")
    if fed.total:
        print("fed to Redis: " + ", ".join(f"{q} {n:,}" for q, n in fed.fed.items() if n))
    if done.waiting:
        print(f"{done.waiting:,} prompt(s) wait in the store: keep the head process running to feed them "
              "(`producer head`, the Procfile's collector line)")
    if s.rejected or s.duplicates:
        print(f"rejected lines are in {s.rejects_path}", file=sys.stderr)
        return 1
    return 0


def _interrupted(config: Config, r: redis.Redis, explicit: bool) -> int:
    stored = _stored(config, r, explicit)
    print(f"producer: interrupted: the store of run {config.run} holds {stored} prompt(s); run the same command "
          "again to resume: stored lines are skipped, none runs twice", file=sys.stderr)
    return EXIT_INTERRUPTED


def _stored(config: Config, r: redis.Redis, explicit: bool) -> str:
    """How many prompts the run's store holds now (after an interrupted enqueue), as text."""
    try:
        loc = locate(config, r, explicit=explicit, access=Access.READ)
    except (StoreError, redis.RedisError, sqlite3.Error):
        return "an unknown number of"
    try:
        with loc.store.read():
            return f"{loc.store.counts()['prompts']:,}"
    finally:
        loc.store.close()


def _no_such_run(config: Config, r: redis.Redis | None) -> str:
    """NoStore said as "run X does not exist", with the runs that do (in Redis, or stores in the state dir)."""
    known: set[str] = set()
    if r is not None:
        with contextlib.suppress(redis.RedisError, OSError):
            known.update(runs_in(r))
    with contextlib.suppress(OSError):
        known.update(p.name.removesuffix(".sqlite") for p in config.state_dir.glob("*.sqlite"))
    known.discard(config.run)
    return unknown_run_message(config.run, sorted(known), where=(
        f"(no marker {Keys(config.run).meta} in Redis at {redacted(config.redis_url)}, no store "
        f"{config.results_db.absolute()}: nothing was enqueued in this run, or give --state-dir)"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config: Config | None = None
    r: redis.Redis | None = None
    scrub = Scrubber([])

    def fail(text: str) -> int:
        error_line("producer", scrub(text))
        return EXIT_USAGE

    try:
        config = Config.from_env(run=args.run, redis_url=args.redis_url, state_dir=args.state_dir)
        scrub = Scrubber.for_config(config)
        r = connect(config.redis_url)
        return _run(args, config, r)
    except BrokenPipeError:
        return broken_pipe()
    except NoStore:
        assert config is not None
        return fail(_no_such_run(config, r))
    except (UsageError, ConfigError, StoreError, UnknownRun) as exc:
        return fail(str(exc))
    except redis.RedisError as exc:
        url = redacted(config.redis_url) if config else "?"
        return fail(f"Redis at {url} failed: {type(exc).__name__}: {exc}")
    except sqlite3.Error as exc:
        path = config.results_db if config else "?"
        return fail(f"store {path}: {exc}")
    except OSError as exc:  # a directory or file that cannot be made, read or written
        return fail(f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc))
    except KeyboardInterrupt:
        error_line("producer", "interrupted (what was written is kept: run the same command again to complete it)")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
