"""`supervisor watch | status | run | restart | retry | report`: thin; parse, build, call one function.

    supervisor watch              the autopilot with its live view (console lines when not a terminal)
    supervisor watch --dry-run    the same, advising only: nothing is restarted
    supervisor watch --view-only  the live view alone, read-only (also: --once [--json])
    supervisor status [--json]    one read-only snapshot
    supervisor run                the autopilot without the live view (console lines), e.g. under honcho
    supervisor retry [QUEUE ...]  GPUs marked failed (their servers could not start) try again

Exit status (docs/cli.md): 0 done; 1 `restart` found no serving worker to canary, `retry` no failed GPU,
`report` found no history; 2 a usage or configuration error, Redis unreachable (one-shot commands), a run Redis does not
hold (one-shot commands: `status`, `watch --once`, `restart`, `retry`, `report`), a metrics port that cannot be
bound, a report that cannot be written; 130 interrupted; 141 stdout closed (`| head`). One line on stderr, never a
traceback. `watch` and `run` wait for a run that does not exist yet (they start beside the workers).
"""

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

from batchfleet.cliopts import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Parser,
    UsageError,
    add_common,
    at_least,
    broken_pipe,
    error_line,
    fraction,
    port,
    positive,
)
from batchfleet.config import STRATEGIES, Config
from batchfleet.connection import connect, redacted
from batchfleet.errors import ConfigError
from batchfleet.keys import Keys
from batchfleet.records import ServerSpec, WorkerState
from batchfleet.redact import Scrubber
from batchfleet.runs import UnknownRun, require_run

from .classify import WindowReport, classify_window
from .fleet import FleetSnapshot, read_fleet
from .ladder import LadderConfig
from .pilotstate import PilotState
from .settings import Settings
from .view import phase_line, render

__all__ = ["build_parser", "main"]


def _autopilot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="advise (events, console) without restarting anything")
    p.add_argument("--window", type=positive(), default=10.0, metavar="S", help="observation window, seconds")
    p.add_argument("--windows", type=positive(int), default=3, metavar="N",
                   help="consecutive stalled windows before acting when only the gauges say mamba-bound")
    p.add_argument("--static-windows", type=positive(int), default=1, metavar="N",
                   help="... when the servers' start-up facts say their mamba pool caps them")
    p.add_argument("--sample", type=positive(), default=1.0, metavar="S",
                   help="sampling period within a window, seconds")
    p.add_argument("--restart-cost", type=at_least(0), default=None, metavar="S",
                   help="one server restart's cost in seconds until the canary has measured one; without it, what "
                        "the workers measured (their servers' start + drain, median per shape), else 300")
    p.add_argument("--fresh-start", action="store_true",
                   help="ignore the fleet's memory: do not start on the spec an earlier run verified as best")
    p.add_argument("--margin", type=at_least(0), default=0.2, metavar="F",
                   help="the canary must beat its peers' tokens/s by this share")
    p.add_argument("--verify-windows", type=positive(int), default=2, metavar="N",
                   help="windows of steady measurement for the canary and after the rollout")
    p.add_argument("--rollout-batch", type=positive(int), default=2, metavar="N",
                   help="servers restarting at once during the rollout")
    p.add_argument("--phase-timeout", type=positive(), default=900.0, metavar="S",
                   help="seconds a canary may take to serve and be measured, a rollout to progress, a check to run")
    p.add_argument("--retry-after", type=at_least(0), default=600.0, metavar="S",
                   help="seconds before a rolled-back change may be tried again (doubles each time it fails)")
    p.add_argument("--forbid", action="append", default=[], choices=STRATEGIES, metavar="STRATEGY",
                   help=f"never move to this strategy (repeatable; one of {', '.join(STRATEGIES)})")
    p.add_argument("--keep-prefix-cache", action="store_true", help="the workload needs the radix cache: no no_radix")
    p.add_argument("--prefill-weight", type=at_least(0), default=0.05, metavar="W",
                   help="what a prefilled token costs beside a generated one, when the prefix plan predicts reuse "
                        "(a strategy that loses it prefills more)")
    p.add_argument("--mem-fraction-static", type=fraction(zero_ok=True), default=0.90, metavar="F",
                   help="with the first rung up (0: leave it)")
    p.add_argument("--max-running-requests", type=at_least(0, int), default=128, metavar="N",
                   help="a ceiling that should not bind (0: leave it)")
    p.add_argument("--metrics-port", type=port, default=0, metavar="P",
                   help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="A", help="address the metrics server binds to")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="supervisor", description="Watch (and steer) a batchfleet fleet.")
    add_common(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    watch = sub.add_parser("watch", help="the autopilot with its live view: diagnose, canary, roll out or back")
    _autopilot_args(watch)
    watch.add_argument("--view-only", action="store_true", help="only the live view; never writes anything")
    watch.add_argument("--once", action="store_true", help="print one read-only snapshot and exit")
    watch.add_argument("--json", action="store_true", help="with --once: machine-readable")
    watch.add_argument("--interval", type=positive(), default=2.0, metavar="S",
                       help="--view-only refresh period, seconds")
    status = sub.add_parser("status", help="one read-only snapshot of the fleet")
    status.add_argument("--json", action="store_true", help="machine-readable")
    run = sub.add_parser("run", help="the autopilot without the live view (one console line per decision)")
    _autopilot_args(run)

    restart = sub.add_parser("restart", help="operator: restart the fleet (or one canary) on another spec")
    restart.add_argument("--strategy", required=True, choices=STRATEGIES, metavar="STRATEGY",
                         help=f"the mamba strategy to restart on: {', '.join(STRATEGIES)}")
    restart.add_argument("--mem-fraction-static", type=fraction(), metavar="F",
                         help="--mem-fraction-static for the new servers")
    restart.add_argument("--max-running-requests", type=positive(int), metavar="N",
                         help="--max-running-requests for the new servers")
    restart.add_argument("--canary", nargs="?", const="", metavar="QUEUE",
                         help="only this GPU (its queue or worker name; default: the first serving one)")

    retry = sub.add_parser("retry", help="operator: GPUs marked failed start their servers again")
    retry.add_argument("queues", nargs="*", metavar="QUEUE", help="their queues (default: every failed GPU)")

    report = sub.add_parser("report", help="PNG of fleet tokens/s and per-GPU in-flight, restarts marked; summary")
    report.add_argument("out", type=Path, help="the PNG to write")
    report.add_argument("--title", default="", metavar="TEXT", help="chart title (default: the run's name)")
    for sp in sub.choices.values():  # --run/--redis-url also after the subcommand
        add_common(sp, sub=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:
        return broken_pipe()
    except (UsageError, ConfigError, UnknownRun) as exc:
        error_line("supervisor", str(exc))
    except redis.RedisError as exc:
        error_line("supervisor", f"Redis failed: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:  # (the live views and the autopilot stop on Ctrl-C by themselves, with 0)
        return EXIT_INTERRUPTED
    return EXIT_USAGE


def _main(args: argparse.Namespace) -> int:
    if args.command == "report":
        try:
            import matplotlib  # noqa: F401  (an extra: GPU hosts need not carry it)
        except ImportError:
            raise UsageError("`report` draws with matplotlib, which is not installed: "
                             "pip install 'batchfleet[report]'") from None
    config = Config.from_env(run=args.run, redis_url=args.redis_url)
    scrub = Scrubber.for_config(config)
    r = connect(config.redis_url, socket_timeout_s=15.0)  # a Redis that stops answering is an outage, not a hang
    k = Keys(config.run)
    long_running = args.command == "run" or (args.command == "watch" and not args.once)
    if not long_running:  # the autopilot waits for Redis rather than exit on a blip
        where = f"in Redis at {redacted(config.redis_url)}"
        try:
            r.ping()
            require_run(r, config.run, where=where)  # a typo must not show an empty fleet, or create keys
        except (redis.RedisError, OSError) as exc:
            raise UsageError(f"cannot reach Redis at {redacted(config.redis_url)}: {scrub(str(exc))}") from None
    if args.command == "watch":
        if args.once:
            return _status(args, config, r, k)
        if args.view_only:
            return _view(args, config, r, k)
    return {"watch": _autopilot, "run": _autopilot, "status": _status, "restart": _restart,
            "retry": _retry, "report": _report}[args.command](args, config, r, k)


class _Console(Console):
    """rich's Console, whose closed stdout is the CLI's to handle (rich exits 1 by itself)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def _classes_of(recent: deque[FleetSnapshot]) -> WindowReport | None:
    return classify_window(list(recent)) if recent and recent[-1].workers else None


def _status(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    snap = read_fleet(r, k, queue_pattern=config.queue_pattern)
    report = classify_window([snap]) if snap.workers else None
    classes = {v.worker: str(v.cls) for v in report.servers} if report else {}
    if args.json:
        sys.stdout.write(orjson.dumps({**snap.to_dict(), "classes": classes}).decode() + "\n")
    else:
        console = _Console()
        console.print(render(snap, report=report, width=console.width))
    return 0


def _view(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    """Read-only live view: classifies the last few snapshots itself, writes nothing."""
    recent: deque[FleetSnapshot] = deque(maxlen=5)
    console = _Console()

    def frame() -> object:
        try:
            recent.append(read_fleet(r, k, queue_pattern=config.queue_pattern))
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            from rich.text import Text

            return Text(f"Redis at {redacted(config.redis_url)} unreachable ({exc}); retrying", style="red")
        return render(recent[-1], report=_classes_of(recent), width=console.width)

    try:
        with Live(frame(), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                live.update(frame())
    except KeyboardInterrupt:
        return 0


def _autopilot(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .prom import FleetMetrics
    from .run import run_autopilot

    forbid = set(args.forbid) | ({"no_radix"} if args.keep_prefix_cache else set())
    ladder = LadderConfig(forbid=frozenset(forbid), mem_fraction_static=args.mem_fraction_static or None,
                          max_running_requests=args.max_running_requests or None, prefill_weight=args.prefill_weight)
    settings = Settings(windows=args.windows, static_windows=args.static_windows, dry_run=args.dry_run,
                        restart_cost_s=args.restart_cost, margin=args.margin, verify_windows=args.verify_windows,
                        rollout_batch=args.rollout_batch, phase_timeout_s=args.phase_timeout,
                        retry_after_s=args.retry_after, fresh_start=args.fresh_start)
    metrics = FleetMetrics()
    if args.metrics_port:
        try:
            metrics.serve(args.metrics_port, args.metrics_addr)
        except OSError as exc:  # in use, or an address this host does not have
            raise UsageError(f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port} (--metrics-addr, "
                             f"--metrics-port): {exc.strerror or exc}") from None
    stop = {"now": False}

    def on_signal(sig: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    common = dict(settings=settings, ladder=ladder, window_s=args.window, sample_s=args.sample,
                  queue_pattern=config.queue_pattern, metrics=metrics, should_stop=lambda: stop["now"],
                  redis_label=redacted(config.redis_url))
    live_view = args.command == "watch" and sys.stdout.isatty()
    scrub = Scrubber.for_config(config)
    if not live_view:
        run_autopilot(r, k, say=lambda s: print(scrub(s), flush=True), **common)  # type: ignore[arg-type]
        return 0
    console = _Console()
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        def show(snap: FleetSnapshot, report: WindowReport | None, state: PilotState) -> None:
            live.update(render(snap, report=report, width=console.width,
                               phase=phase_line(state, dry_run=settings.dry_run)))

        run_autopilot(r, k, say=lambda s: live.console.print(scrub(s), highlight=False), show=show,  # type: ignore[arg-type]
                      **common)
    return 0


def _restart(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .run import manual_restart

    canary = args.canary
    if canary == "":
        workers = read_fleet(r, k, queue_pattern=config.queue_pattern).workers
        serving = [w for w in workers if w.state is WorkerState.SERVING]
        if not serving:
            print("supervisor: no serving worker to canary; name one: --canary QUEUE", file=sys.stderr)
            return 1
        canary = serving[0].queue
    spec = manual_restart(r, k, ServerSpec(strategy=args.strategy, mem_fraction_static=args.mem_fraction_static,
                                           max_running_requests=args.max_running_requests),
                          canary=canary, queue_pattern=config.queue_pattern)
    print(f"{'canary ' + canary if canary else 'fleet'} -> {spec.describe()} (generation {spec.generation}); "
          "workers pick it up within a second: watch with `supervisor watch --view-only`")
    return 0


def _retry(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    """A new token per queue in `bf:<run>:retry`: each named GPU's worker, if failed, starts again."""
    queues = list(args.queues)
    if not queues:
        workers = read_fleet(r, k, queue_pattern=config.queue_pattern).workers
        queues = sorted({w.queue for w in workers if w.state is WorkerState.FAILED})
        if not queues:
            print("supervisor: no GPU is marked failed; name one: supervisor retry QUEUE", file=sys.stderr)
            return 1
    r.hset(k.retry, mapping={q: str(time.time_ns()) for q in queues})
    print(f"told {', '.join(queues)} to start again; workers look within a few seconds")
    return 0


def _report(args: argparse.Namespace, config: Config, r: redis.Redis, k: Keys) -> int:
    from .report import load, plot, summarize

    samples, events = load(r, k)
    if not samples:
        print(f"supervisor: no history for run {config.run!r}: `supervisor watch` writes it while the fleet works",
              file=sys.stderr)
        return 1
    try:
        plot(samples, events, args.out, title=args.title or f"batchfleet run {config.run}")
    except OSError as exc:
        raise UsageError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(summarize(samples, events).text())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
