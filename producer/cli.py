"""`producer`: enqueue a JSONL file of prompts, collect results, show status, export.

Exit status: 0 done; 1 something needs attention (rejected lines, prompts still pending);
2 usage, configuration or Redis errors (one line on stderr, no traceback).
Settings come from `BATCHFLEET_*` (see batchfleet.config); `--run`, `--redis-url`, `--state-dir`
override them.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path
from typing import Any

import redis

from batchfleet.config import Config
from batchfleet.connection import connect, redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys

from .collect import collect_once, follow
from .enqueue import enqueue_file
from .export import export
from .parse import Reject, check_sampling, parse_param
from .queues import resolve_queues
from .status import format_status, gather_status
from .store import Store

__all__ = ["main"]


class UsageError(Exception):
    """Bad arguments: exit 2 with the message."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="producer", description=__doc__.split("\n")[0])
    p.add_argument("--run", help="run name (BATCHFLEET_RUN)")
    p.add_argument("--redis-url", help="Redis URL (BATCHFLEET_REDIS_URL / REDIS_URL)")
    p.add_argument("--state-dir", type=Path, help="where the results store lives (BATCHFLEET_STATE_DIR)")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("enqueue", help="validate a JSONL file and enqueue one job per prompt")
    e.add_argument("file", help="JSONL input ('-' for stdin)")
    e.add_argument("--queues", help="queues to spread over: names, `hosta.gpu[0-7]` ranges, or `live` (the live "
                   "workers' queues), comma-separated (default: BATCHFLEET_QUEUES)")
    e.add_argument("--max-tokens", type=int)
    e.add_argument("--temperature", type=float)
    e.add_argument("--top-p", type=float)
    e.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="default sampling parameter for lines that do not set it (repeatable)")
    e.add_argument("--model", help="body.model when a line has none (default: model path or 'default')")
    e.add_argument("--rejects", type=Path, help="rejected lines go here (default: FILE.rejects.jsonl)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar or lines")

    c = sub.add_parser("collect", help="move finished results from Redis into the results store")
    c.add_argument("--follow", action="store_true", help="keep collecting until SIGINT/SIGTERM")
    c.add_argument("--interval", type=float, default=2.0, metavar="S")

    s = sub.add_parser("status", help="queues, fleet tokens/s and ETA (collects first)")
    s.add_argument("--json", action="store_true", help="one JSON object (keys: see producer.status)")

    x = sub.add_parser("export", help="write the OpenAI batch output file in input order")
    x.add_argument("out", type=Path)
    x.add_argument("--wait", action="store_true", help="wait until no prompt is pending")
    x.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
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


def _run(args: argparse.Namespace, config: Config) -> int:
    r = connect(config.redis_url)
    r.ping()
    store = Store(config.results_db)
    keys = Keys(config.run)
    try:
        if args.cmd == "enqueue":
            return _enqueue(args, config, r, store)
        if args.cmd == "collect":
            got = follow(r, store, keys, interval_s=args.interval) if args.follow else collect_once(r, store, keys)
            print(f"collected {got.succeeded:,} succeeded, {got.failed:,} failed into {config.results_db}")
            return 0
        if args.cmd == "status":
            print(format_status(gather_status(config, r, store), as_json=args.json))
            return 0
        ex = export(r, store, keys, args.out, wait=args.wait, timeout_s=args.timeout)
        print(f"wrote {ex.written:,} lines to {ex.path} ({ex.succeeded:,} succeeded, {ex.failed:,} failed)")
        if ex.pending:
            print(f"{ex.pending:,} prompts have no result yet, e.g. {', '.join(ex.first_pending)}", file=sys.stderr)
            return 1
        return 0
    finally:
        store.close()


def _enqueue(args: argparse.Namespace, config: Config, r: redis.Redis, store: Store) -> int:
    defaults = _defaults(args)
    queues = resolve_queues(args.queues if args.queues is not None else ",".join(config.queues), r, Keys(config.run))
    if args.file != "-" and not Path(args.file).is_file():
        raise UsageError(f"{args.file}: no such file")
    s = enqueue_file(config, r, store, args.file, queues=queues, defaults=defaults,
                     model=args.model or config.model_path or "default", rejects_path=args.rejects,
                     progress=not args.no_progress)
    rate = s.lines / s.seconds if s.seconds else 0.0
    print(f"{args.file}: {s.lines:,} lines in {s.seconds:.1f} s ({rate:,.0f}/s): {s.new:,} new, "
          f"{s.present:,} already queued or running, {s.collected:,} already finished, "
          f"{s.rejected:,} rejected, {s.duplicates:,} duplicates")
    if s.new:
        print("queues: " + ", ".join(f"{q} {n:,}" for q, n in s.per_queue.items()))
    if s.rejected or s.duplicates:
        print(f"rejected lines are in {s.rejects_path}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = None
    try:
        config = Config.from_env(run=args.run, redis_url=args.redis_url, state_dir=args.state_dir)
        return _run(args, config)
    except (UsageError, ConfigError) as exc:
        print(f"producer: {exc}", file=sys.stderr)
    except redis.RedisError as exc:
        url = redacted(config.redis_url) if config else "?"
        print(f"producer: Redis at {url} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    except sqlite3.Error as exc:
        path = config.results_db if config else "?"
        print(f"producer: results store {path}: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("producer: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
