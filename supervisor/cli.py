"""`supervisor watch [--once] [--json]`: the fleet, live."""

from __future__ import annotations

import argparse
import sys
import time

import orjson
from rich.console import Console
from rich.live import Live

from batchfleet.config import Config
from batchfleet.connection import connect, redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys

from .fleet import read_fleet
from .view import render

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="supervisor", description="Watch (and steer) a batchfleet fleet.")
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="one row per worker, refreshed live")
    watch.add_argument("--once", action="store_true", help="print one snapshot and exit")
    watch.add_argument("--json", action="store_true", help="with --once: machine-readable")
    watch.add_argument("--interval", type=float, default=2.0, help="refresh period, seconds")
    args = parser.parse_args(argv)
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"supervisor: {exc}", file=sys.stderr)
        return 2
    r = connect(config.redis_url)
    k = Keys(config.run)
    try:
        r.ping()
    except Exception as exc:
        print(f"supervisor: cannot reach Redis at {redacted(config.redis_url)}: {exc}", file=sys.stderr)
        return 2
    if args.once:
        snap = read_fleet(r, k, queue_pattern=config.queue_pattern)
        if args.json:
            sys.stdout.write(orjson.dumps(snap.to_dict()).decode() + "\n")
        else:
            Console().print(render(snap))
        return 0
    try:
        with Live(render(read_fleet(r, k, queue_pattern=config.queue_pattern)), refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(read_fleet(r, k, queue_pattern=config.queue_pattern)))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
