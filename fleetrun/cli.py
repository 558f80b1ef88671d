"""`batchfleet run prompts.jsonl -o results.jsonl [--gpus 0-7] [--dry-run]`: one host, its GPUs.

    1. Redis: the one at --redis-url / BATCHFLEET_REDIS_URL / REDIS_URL when it answers, else a private
       redis-server with an append-only file in the state dir (fleetrun.redisproc).
    2. The file into the run's store (`producer enqueue`'s code: idempotent by custom_id).
    3. One `rq worker <run>.gpuN` per GPU (RQ_WORKER_CLASS=worker.GPUWorker), `producer head`,
       `supervisor watch` (`--dry-run`: it only advises), started by fleetrun.launch (as `batchfleet
       serve` starts them); their output goes to <state dir>/logs/<run>/.
    4. One progress line (bar, done/total, ETA, tok/s, live workers) and one line per supervisor or worker
       event. tok/s, there and in the summary, is completion tokens per wall-clock second of this run.
    5. When no prompt is pending: stop the processes (SIGTERM: workers stop their servers), export.

Ctrl-C (or SIGTERM) drains: workers hand back what they hold, the head stops, nothing is exported;
running the same command again resumes (the run name defaults to the input file's name) and never
runs a finished prompt again. A second Ctrl-C kills the processes at once (still safe: leases).

Exit status: 0 every prompt has a result and the file is written; 1 the export was written but
some input lines were rejected; 2 usage, configuration, Redis, store or I/O error, or the processes
died; 3 another `batchfleet run` of the run is active (nothing was started); 130 interrupted. One
line on stderr, never a traceback.

Files: the state dir is 0700; each run logs to <state dir>/logs/<run>/ (workers, head, supervisor,
the servers), each launch under a header line; a lease in Redis (fleetrun.lease) keeps a second
`batchfleet run` of the same run from starting anything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import redis

from batchfleet.cliopts import (
    EXIT_ATTENTION,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Parser,
    UsageError,
    add_common,
    broken_pipe,
    common_parent,
    error_line,
    positive,
)
from batchfleet.config import Config
from batchfleet.connection import connect
from batchfleet.fleetview import duration_text
from batchfleet.keys import Keys
from batchfleet.prompts import EMBEDDINGS
from batchfleet.records import WorkerState
from producer.api import (
    ExportError,
    Lines,
    Store,
    cache_text,
    cannot_serve,
    check_target,
    collect_once,
    enqueue,
    export,
    first_url,
    gather_progress,
    input_problem,
    write_empty,
)

from . import serve
from .launch import (
    LAUNCH_ERRORS,
    Events,
    Procs,
    check_gpus,
    check_model_path,
    detect_gpus,
    event_line,
    fleet_redis,
    gpu_groups,
    launch_failed,
    own_dirs,
    parse_gpus,
    queues_of,
    start_fleet,
)
from .lease import LaunchLease

__all__ = ["UsageError", "build_parser", "main", "parse_gpus"]

REDIS_HELP = ("Redis URL, used when it answers (default: BATCHFLEET_REDIS_URL, else REDIS_URL; none, or none "
              "answering: a private redis-server with an append-only file in the state dir)")


def run_name_for(path: Path) -> str:
    """The default run name: the input file's name without its suffixes (`prompts.jsonl.gz` -> `prompts`)."""
    stem = path.name.split(".")[0] or "run"
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem)[:100]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="batchfleet", description="Run a JSONL file of prompts on this host's GPUs, "
               "or serve the OpenAI Batch API on a fleet.")
    add_common(p, redis_help=REDIS_HELP)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="enqueue, serve on this host's GPUs, watch, export (resumable)",
                       description=__doc__.split("\n\n")[0],
                       parents=[common_parent(run_help="run name (default: BATCHFLEET_RUN, else the input "
                                                       "file's name: re-running the same command resumes)",
                                                       redis_help=REDIS_HELP)])
    r.add_argument("file", type=Path, help="JSONL input (.jsonl, .jsonl.gz, .jsonl.zst)")
    r.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                   help="the OpenAI batch output file (.jsonl, .jsonl.gz, .jsonl.zst by suffix)")
    r.add_argument("--errors", type=Path, metavar="FILE", help="write failed prompts here instead of into OUT")
    r.add_argument("--gpus", metavar="GPUS",
                   help="GPU indices, e.g. 0-7 or 0,2,5 (default: every GPU nvidia-smi lists)")
    r.add_argument("--tp", type=positive(int), default=1, metavar="N",
                   help="GPUs per server, tensor parallel: --gpus 0-7 --tp 4 runs 2 servers, on GPUs 0-3 and 4-7 "
                        "(default: 1)")
    r.add_argument("--dry-run", action="store_true",
                   help="the supervisor only advises (`supervisor watch --dry-run`): it restarts nothing")
    r.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="the run's store, logs and private Redis (default: BATCHFLEET_STATE_DIR, else .batchfleet)")
    r.add_argument("--rejects", type=Path, metavar="FILE",
                   help="rejected input lines go here (default: <state dir>/<run>.rejects.jsonl)")
    r.add_argument("--model", metavar="NAME", help="body.model when a line has none (default: BATCHFLEET_MODEL_PATH)")
    r.add_argument("--no-supervisor", action="store_true", help="do not start `supervisor watch`")
    r.add_argument("--fresh-start", action="store_true",
                   help="the supervisor ignores the fleet's memory (`supervisor watch --fresh-start`): no start on "
                        "the spec an earlier run verified as best")
    r.add_argument("--progress-every", type=positive(), default=5.0, metavar="S",
                   help="seconds between progress lines when the output is not a terminal")
    r.add_argument("--timeout", type=positive(), metavar="S", help="give up (drain, exit 2) after S seconds")
    r.add_argument("--rerun-changed", action="store_true",
                   help="custom_ids the run's store holds with another request run again with the new one (their "
                        "old results are replaced); without it such a file is refused (exit 2)")
    r.add_argument("--no-plan", action="store_true",
                   help="feed by expected work alone (longest first): no prefix plan (prompts that share a prefix "
                        "are then spread over the servers)")
    serve.add_parser(sub, common_parent(run_help=f"the run whose fleet serves the batches (default: BATCHFLEET_RUN, "
                                                 f"else {serve.DEFAULT_RUN!r})", redis_help=REDIS_HELP))
    return p


# --- output -----------------------------------------------------------------------------------------
class Throughput:
    """The run's one throughput figure, on its progress line and in its summary alike: completion tokens
    per wall-clock second since this command started its workers (start-up included), from the run's
    `completion_tokens` counter. Frozen when the last prompt is done."""

    NAME = "tok/s"

    def __init__(self, tokens: int) -> None:
        self.start = self.end = time.monotonic()
        self.tokens0 = self.tokens = tokens
        self.frozen = False

    def update(self, tokens: int) -> None:
        if not self.frozen:
            self.tokens, self.end = tokens, time.monotonic()

    def freeze(self) -> None:
        self.frozen = True

    @property
    def tokens_per_s(self) -> float:
        span = self.end - self.start
        return max(0, self.tokens - self.tokens0) / span if span > 0 else 0.0

    def text(self) -> str:
        return f"{self.tokens_per_s:,.0f} {self.NAME}"

    def summary(self) -> str:
        return f"{self.text()} over {duration_text(self.end - self.start)} (completion tokens per wall-clock second)"


class Screen:
    """One progress line (a rich bar on a terminal, a plain line every few seconds otherwise) and
    messages that print above it. `finish` ends it: the bar goes, its last state stays as a plain line,
    and every later message prints under it."""

    def __init__(self, stream: TextIO, every_s: float) -> None:
        self.stream = stream
        self.every_s = every_s
        self.last = 0.0
        self.last_done = -1
        self.bar: Any = None
        self.rate: Throughput | None = None  # from when the workers start
        self.finished = False

    def _start_bar(self) -> None:
        """On a terminal, the bar starts with the first progress (enqueue's own bar is done by then)."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        # transient: `finish` and `close` erase it, so no bar outlives the run under later lines
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), console=Console(file=self.stream), transient=True)
        self.task = self.bar.add_task("run", total=None, info="")
        self.bar.start()

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _info(self, p: dict[str, Any]) -> str:
        if self.rate is not None:
            self.rate.update(p["completion_tokens"])
        rate = f"  {self.rate.text()}" if self.rate is not None else ""
        hit = p.get("cache_hit_rate")
        cache = f"  cache {hit:.0%}" if hit is not None else ""
        return f"ETA {p['eta']}{rate}  workers {p['workers']['live']}{cache}"

    def _plain(self, p: dict[str, Any], info: str) -> None:
        self.last, self.last_done = time.monotonic(), p["done"]
        share = p["done"] / p["prompts"] if p["prompts"] else 1.0
        filled = round(share * 20)
        print(f"[{'#' * filled}{'.' * (20 - filled)}] {p['done']:,}/{p['prompts']:,} ({share:.0%})  {info}",
              file=self.stream, flush=True)

    def progress(self, p: dict[str, Any]) -> None:
        if self.finished:
            return
        info = self._info(p)
        if self.bar is None and self.stream.isatty():
            self._start_bar()
        if self.bar is not None:
            self.bar.update(self.task, total=p["prompts"], completed=p["done"], info=info)
        elif time.monotonic() - self.last >= self.every_s:
            self._plain(p, info)

    def finish(self, p: dict[str, Any]) -> None:
        """The last progress: the bar is erased and its state printed once as a plain line that stays."""
        if self.finished:
            return
        if p["pending"] == 0 and self.rate is not None:
            self.rate.update(p["completion_tokens"])
            self.rate.freeze()
        info = self._info(p)
        self.close()
        if self.stream.isatty() or p["done"] != self.last_done:
            self._plain(p, info)
        self.finished = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# --- the command ------------------------------------------------------------------------------------
def _run(args: argparse.Namespace, stop: list[bool], force: list[bool]) -> int:
    problem = input_problem(args.file)
    if problem:
        raise UsageError(problem)
    try:  # before hours of work, not after
        check_target(args.output, "-o")
        if args.errors is not None:
            check_target(args.errors, "--errors")
    except ExportError as exc:
        raise UsageError(str(exc)) from None
    try:  # stdin is not read ahead: the line it found would be taken from the enqueue that follows
        with contextlib.nullcontext(None) if str(args.file) == "-" else Lines(str(args.file)) as lines:
            empty = lines is not None and not lines.has_prompt_line()
    except (OSError, EOFError) as exc:  # a corrupt .gz/.zst
        raise UsageError(f"{args.file}: cannot read: {exc}") from None
    if empty:  # nothing to run: no Redis, no store, no key; the export of no prompts
        write_empty(args.output, args.errors)
        print(f"batchfleet: warning: {args.file} holds no prompts (it is empty or only blank lines): nothing ran; "
              f"wrote an empty {args.output}", file=sys.stderr)
        return EXIT_OK
    gpus = parse_gpus(args.gpus) if args.gpus else detect_gpus()
    if not gpus:
        raise UsageError("no GPU found (nvidia-smi lists none): give --gpus, e.g. --gpus 0-7")
    if args.gpus:
        check_gpus(gpus)
    args.groups = gpu_groups(gpus, args.tp)  # a --tp that does not fit: a usage error now, before Redis
    run = args.run or os.environ.get("BATCHFLEET_RUN") or run_name_for(args.file)
    config = Config.from_env(run=run, redis_url=args.redis_url, state_dir=args.state_dir)
    if not config.model_path:
        raise UsageError("BATCHFLEET_MODEL_PATH is not set: the model every GPU's server loads")
    check_model_path(config)
    _check_kind(args.file, config)
    config = own_dirs(config)
    keys = Keys(run)
    out = sys.stderr
    screen = Screen(out, args.progress_every)
    given = args.redis_url or os.environ.get("BATCHFLEET_REDIS_URL") or os.environ.get("REDIS_URL")
    try:
        with fleet_redis(config, given, screen.say) as url:
            return _serve(args, config.with_(redis_url=url), gpus, keys, screen, stop, force)
    finally:
        screen.close()


def _check_kind(path: Path, config: Config) -> None:
    """A generation file for servers that will embed is refused now, before Redis, the store or a server
    starts (`producer enqueue` refuses it once the live workers said so, and the head fails its prompts
    once, but only after the servers started).

    Only this way round can it be known before the servers start. SGLang 0.5.23 makes a server an
    embedding one (`/model_info` is_generation false) when it is given `--is-embedding`, or when the
    model's architecture is one it lists as an embedding, reward or classification model
    (`configs/model_config.py` `is_generation_model`: BertModel, LlamaEmbeddingModel, ...; the list
    changes between releases). So `--is-embedding` says the servers embed; its absence does not say
    they generate, and an embedding file without the flag is left to the live workers' word (an
    embedding model may not need it). stdin is not read ahead: its lines would be taken from enqueue."""
    if str(path) == "-" or "--is-embedding" not in config.server_argv_extra:
        return
    first = first_url(path)
    if first is not None and first[1] != EMBEDDINGS:
        line, url = first
        raise UsageError(f"{path}:{line}: a {url} request, but BATCHFLEET_SERVER_ARGS has --is-embedding: the servers "
                         f"would embed, taking {EMBEDDINGS} requests only; nothing was started (a run holds one kind)")


def _serve(args: argparse.Namespace, config: Config, gpus: tuple[int, ...], keys: Keys, screen: Screen,
           stop: list[bool], force: list[bool]) -> int:
    r = connect(config.redis_url)
    lease = LaunchLease(r, keys)
    lease.acquire()  # before anything starts: a second `batchfleet run` of this run stops here
    try:
        return _enqueue_and_work(args, config, gpus, keys, screen, stop, force, r)
    finally:
        lease.release()


def _enqueue_and_work(args: argparse.Namespace, config: Config, gpus: tuple[int, ...], keys: Keys, screen: Screen,
                      stop: list[bool], force: list[bool], r: redis.Redis) -> int:
    run = config.run
    queues = queues_of(run, args.groups)
    done = enqueue(config, r, args.file, queues=queues, explicit=True, model=args.model or config.model_path,
                   rejects_path=args.rejects or config.state_dir / f"{run}.rejects.jsonl", progress=True,
                   rerun_changed=args.rerun_changed, plan=not args.no_plan)
    store: Store = done.store
    try:
        s = done.summary
        screen.say(f"{args.file}: {s.text()}; run {run}, store {store.path}")
        if s.rejected or s.duplicates:
            screen.say(f"rejected lines are in {s.rejects_path}")
        code = _work(args, config, gpus, keys, store, r, screen, stop, force)
        if code != EXIT_OK:
            return code
        try:
            ex = export(r, store, keys, args.output, errors=args.errors)
        except ExportError as exc:
            raise UsageError(str(exc)) from None
        if (cache := cache_text(gather_progress(r, keys, store))) is not None:
            screen.say(cache)
        screen.say(f"wrote {ex.written:,} lines to {ex.path} ({ex.succeeded:,} succeeded, {ex.failed:,} failed)"
                   + (f"; failures in {args.errors}" if args.errors else "")
                   + (f"; {screen.rate.summary()}" if screen.rate else ""))
        if ex.pending:
            screen.say(f"{ex.pending:,} prompts have no result yet: run the same command again")
            return EXIT_ATTENTION
        return EXIT_ATTENTION if (s.rejected or s.duplicates) else EXIT_OK
    finally:
        store.close()


def _work(args: argparse.Namespace, config: Config, gpus: tuple[int, ...], keys: Keys, store: Store,
          r: redis.Redis, screen: Screen, stop: list[bool], force: list[bool]) -> int:
    """Start the processes, show progress until nothing is pending (or Ctrl-C), stop them."""
    p = gather_progress(r, keys, store)
    if p["pending"] == 0:
        screen.finish(p)
        return EXIT_OK
    def on_signal(_sig: int, _frame: object) -> None:
        if stop[0]:
            force[0] = True
        stop[0] = True

    # from here on Ctrl-C drains in order (before, while enqueueing, it interrupts: KeyboardInterrupt)
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _processes(args, config, gpus, keys, store, r, screen, stop, force)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _processes(args: argparse.Namespace, config: Config, gpus: tuple[int, ...], keys: Keys, store: Store,
               r: redis.Redis, screen: Screen, stop: list[bool], force: list[bool]) -> int:
    """Start the fleet, show progress until nothing is pending or a reason to stop (`_Watch.reason`),
    then stop the processes and say how the run ended."""
    procs, events = Procs(config.logs), Events(r, keys)  # logs: <state dir>/logs/<run>, 0700 (launch.own_dirs)
    screen.rate = Throughput(gather_progress(r, keys, store)["completion_tokens"])
    _start(args, config, keys, r, procs, screen)
    watch = _Watch(args, config, gpus, procs, screen)
    code = EXIT_OK
    p: dict[str, Any] | None = None
    try:
        while True:
            for e in events.new():
                screen.say(event_line(e))
            p = gather_progress(r, keys, store)
            watch.servers(p)
            screen.progress(p)
            if p["pending"] == 0:
                break
            if (code := watch.reason(p, stop[0])) != EXIT_OK:
                break
            time.sleep(1.0)
    finally:
        _stop(procs, events, screen, p, code, config, force)
    if watch.failed and code == EXIT_OK:
        screen.say(f"finished without {len(watch.failed)} GPU(s) whose server could not serve (their queues were "
                   "served by the others): " + "; ".join(f"{q.rpartition('.')[2]}: {why}"
                                                         for q, why in sorted(watch.failed.items())))
    if code == EXIT_INTERRUPTED:
        collect_once(r, store, keys)  # what finished while the workers drained: into the store now
        p = gather_progress(r, keys, store)
        assert screen.rate is not None
        screen.say(f"stopped: {p['done']:,} of {p['prompts']:,} prompts done, {p['pending']:,} pending (kept in "
                   f"{store.path}); {screen.rate.summary()}; run the same command again to resume")
    return code


def _start(args: argparse.Namespace, config: Config, keys: Keys, r: redis.Redis, procs: Procs, screen: Screen) -> None:
    # Before any worker starts: with --fresh-start none starts on the fleet's memory (worker/spec.py).
    if args.fresh_start:
        r.hset(keys.control, Keys.CONTROL_FRESH, b"1")
    else:
        r.hdel(keys.control, Keys.CONTROL_FRESH)
    started = start_fleet(procs, config, args.groups, supervisor=not args.no_supervisor, dry_run=args.dry_run,
                          fresh_start=args.fresh_start)
    screen.say(f"{started}; logs in {procs.logs}")


def _stop(procs: Procs, events: Events, screen: Screen, p: dict[str, Any] | None, code: int, config: Config,
          force: list[bool]) -> None:
    """The progress line's last state, then the processes stopped (draining), their last events and
    any exit code that is not a clean stop."""
    if p is not None:
        screen.finish(p)  # the bar goes before any later line; its last state stays as a plain line
    screen.close()
    if code == EXIT_INTERRUPTED:
        screen.say("interrupted: draining (workers hand back what they hold; Ctrl-C again to kill at once)")
    codes = procs.stop(config.shutdown_grace_s + 30, force)
    for e in events.new():
        screen.say(event_line(e))
    bad = {n: c for n, c in codes.items() if c not in (0, -signal.SIGTERM)}
    if bad:
        screen.say("exit codes: " + ", ".join(f"{n} {c}" for n, c in bad.items()) + f" (logs in {procs.logs})")


class _Watch:
    """What `batchfleet run` watches besides the progress: the servers that cannot serve (said once per
    reason), and the reasons to stop before every prompt is done."""

    def __init__(self, args: argparse.Namespace, config: Config, gpus: tuple[int, ...], procs: Procs,
                 screen: Screen) -> None:
        self.procs = procs
        self.screen = screen
        self.ours = set(queues_of(config.run, gpu_groups(gpus)))
        self.timeout_s: float | None = args.timeout
        self.deadline = None if args.timeout is None else time.monotonic() + args.timeout
        self.said: set[tuple[str, str]] = set()
        self.failed_now: dict[str, str] = {}  # queue -> why its GPU was marked failed, now
        self.failed: dict[str, str] = {}  # queue -> why its GPU cannot serve (failed, or down), as last seen

    def servers(self, p: dict[str, Any]) -> None:
        """A server that cannot serve: say why, once per reason."""
        failed_now, down_now = {}, {}
        for d in p["workers"]["not_serving"]:
            what = cannot_serve(d["state"])
            if what is None:  # starting or restarting
                continue
            why = (d["message"] or "?").strip().splitlines()[0]
            (failed_now if d["state"] == WorkerState.FAILED else down_now)[d["queue"]] = why
            if (d["worker"], d["message"]) not in self.said:
                self.said.add((d["worker"], d["message"]))
                log = self.procs.logs / f"worker-{d['queue'].rpartition('.')[2]}.log"
                self.screen.say(f"{d['queue']}: {what}: {why} (see {log})")
        self.failed_now = failed_now
        self.failed = {**down_now, **failed_now}

    def reason(self, p: dict[str, Any], interrupted: bool) -> int:
        """EXIT_OK to watch on, else the exit code of why the run stops now (each said on the screen)."""
        say, procs = self.screen.say, self.procs
        # no GPU can serve (ours all failed, and no live worker elsewhere on this Redis can): waiting cannot help
        if self.ours <= set(self.failed_now) and len(self.failed_now) >= p["workers"]["live"]:
            say("no GPU can serve; each was marked failed:\n" + "\n".join(
                f"  {q.rpartition('.')[2]}: {self.failed_now[q]}" for q in sorted(self.ours)))
            return EXIT_ERROR
        if interrupted:
            return EXIT_INTERRUPTED
        dead = [g for g, w in procs.workers.items() if w.poll() is not None]
        if len(dead) == len(procs.workers):
            tails = "\n".join(f"--- worker-{g}.log (exit {procs.workers[g].returncode})\n"
                              f"{procs.tail(f'worker-{g}')}" for g in dead)
            say(f"every worker exited; see {procs.logs}\n{tails}")
            return EXIT_ERROR
        if procs.others["head"].poll() is not None:
            say(f"the head exited {procs.others['head'].returncode}:\n{procs.tail('head')}")
            return EXIT_ERROR
        if self.deadline is not None and time.monotonic() > self.deadline:
            say(f"timed out after {self.timeout_s:g} s with {p['pending']:,} prompts pending")
            return EXIT_ERROR
        return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "serve":
        return serve.main(args)
    stop, force = [False], [False]

    def interrupt(_sig: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # until the processes start, SIGTERM is a Ctrl-C: the private Redis is stopped on the way out
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        return _run(args, stop, force)
    except BrokenPipeError:
        return broken_pipe()
    except LAUNCH_ERRORS as exc:
        return launch_failed(exc)
    except KeyboardInterrupt:
        error_line("batchfleet", "interrupted while enqueueing (what was stored is kept): run the same command again "
                   "to resume")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
