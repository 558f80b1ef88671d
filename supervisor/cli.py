"""`supervisor watch | run | restart | report`: thin; parse, build, call one function."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections import deque
from pathlib import Path

import orjson
import redis
from rich.console import Console
from rich.live import Live

from batchfleet.config import STRATEGIES, Config
from batchfleet.connection import connect, redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys
from batchfleet.records import ServerSpec

from .autopilot import Settings
from .classify import classify_window
from .fleet import FleetSnapshot, read_fleet
from .ladder import LadderConfig
from .view import render

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="supervisor", description="Watch (and steer) a batchfleet fleet.")
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="one row per worker with its class, refreshed live")
    watch.add_argument("--once", action="store_true", help="print one snapshot and exit")
    watch.add_argument("--json", action="store_true", help="with --once: machine-readable")
    watch.add_argument("--interval", type=float, default=2.0, help="refresh period, seconds")

    run = sub.add_parser("run", help="the autopilot: diagnose, canary, roll out or roll back")
    run.add_argument("--dry-run", action="store_true", help="advise (events, console) without restarting anything")
    run.add_argument("--window", type=float, default=10.0, help="observation window, seconds")
    run.add_argument("--windows", type=int, default=3, help="consecutive stalled windows before acting")
    run.add_argument("--sample", type=float, default=1.0, help="sampling period within a window, seconds")
    run.add_argument("--restart-cost", type=float, default=300.0,
                     help="estimated downtime of one server restart, seconds (model load + warm-up)")
    run.add_argument("--margin", type=float, default=0.2, help="the canary must beat its peers' tokens/s by this share")
    run.add_argument("--verify-windows", type=int, default=2, help="windows measured on the canary and after rollout")
    run.add_argument("--rollout-batch", type=int, default=2, help="servers restarting at once during the rollout")
    run.add_argument("--forbid", action="append", default=[], choices=STRATEGIES, help="never move to this strategy")
    run.add_argument("--keep-prefix-cache", action="store_true", help="the workload needs the radix cache: no no_radix")
    run.add_argument("--mem-fraction-static", type=float, default=0.90, help="with the first rung up (0: leave it)")
    run.add_argument("--max-running-requests", type=int, default=128, help="a ceiling that should not bind (0: leave)")
    run.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0: off)")
    run.add_argument("--metrics-addr", default="127.0.0.1")

    restart = sub.add_parser("restart", help="operator: restart the fleet (or one canary) on another spec")
    restart.add_argument("--strategy", required=True, choices=STRATEGIES)
    restart.add_argument("--mem-fraction-static", type=float)
    restart.add_argument("--max-running-requests", type=int)
    restart.add_argument("--canary", nargs="?", const="", metavar="WORKER",
                         help="only this worker (default: the first serving one)")

    report = sub.add_parser("report", help="PNG of fleet tokens/s and per-GPU in-flight, restarts marked; summary")
    report.add_argument("out", type=Path)
    report.add_argument("--title", default="")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
    return {"watch": _watch, "run": _run, "restart": _restart, "report": _report}[args.command](args, config, r, k)


def _watch(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    recent: deque[FleetSnapshot] = deque(maxlen=5)

    def frame() -> tuple[FleetSnapshot, dict[str, str]]:
        recent.append(read_fleet(r, k, queue_pattern=config.queue_pattern))
        snap = recent[-1]
        classes = {v.worker: v.cls for v in classify_window(list(recent)).servers} if snap.workers else {}
        return snap, classes

    if args.once:
        snap, classes = frame()
        if args.json:
            sys.stdout.write(orjson.dumps({**snap.to_dict(), "classes": classes}).decode() + "\n")
        else:
            Console().print(render(snap, classes=classes))
        return 0
    snap, classes = frame()
    try:
        with Live(render(snap, classes=classes), refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                snap, classes = frame()
                live.update(render(snap, classes=classes))
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .prom import FleetMetrics
    from .run import run_autopilot

    forbid = set(args.forbid) | ({"no_radix"} if args.keep_prefix_cache else set())
    ladder = LadderConfig(forbid=frozenset(forbid), mem_fraction_static=args.mem_fraction_static or None,
                          max_running_requests=args.max_running_requests or None)
    settings = Settings(windows=args.windows, dry_run=args.dry_run, restart_cost_s=args.restart_cost,
                        margin=args.margin, verify_windows=args.verify_windows, rollout_batch=args.rollout_batch)
    metrics = FleetMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    stop = {"now": False}

    def on_signal(sig: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_autopilot(r, k, settings=settings, ladder=ladder, window_s=args.window, sample_s=args.sample,
                  queue_pattern=config.queue_pattern, metrics=metrics, say=lambda s: print(s, flush=True),
                  should_stop=lambda: stop["now"])
    return 0


def _restart(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .run import manual_restart

    canary = args.canary
    if canary == "":
        serving = [w for w in read_fleet(r, k, queue_pattern=config.queue_pattern).workers if w.state == "serving"]
        if not serving:
            print("supervisor: no serving worker to canary; name one: --canary WORKER", file=sys.stderr)
            return 1
        canary = serving[0].worker
    spec = manual_restart(r, k, ServerSpec(strategy=args.strategy, mem_fraction_static=args.mem_fraction_static,
                                           max_running_requests=args.max_running_requests),
                          canary=canary, queue_pattern=config.queue_pattern)
    print(f"{'canary ' + canary if canary else 'fleet'} -> {spec.describe()} (generation {spec.generation}); "
          "workers pick it up within a second: watch with `supervisor watch`")
    return 0


def _report(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .report import load, plot, summarize

    samples, events = load(r, k)
    if not samples:
        print(f"supervisor: no history for run {config.run!r}: `supervisor run` writes it while the fleet works",
              file=sys.stderr)
        return 1
    plot(samples, events, args.out, title=args.title or f"batchfleet run {config.run}")
    print(summarize(samples, events).text())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
