"""The producer's public API: what the launchers (`fleetrun`), the Batch API (`batchapi`), the benchmarks
and the scripts use of the producer, and all they may use (tests/test_layout.py holds `batchapi` and
`fleetrun` to it). Everything else in `producer/` may change shape without notice.

    the run's store       Store, Span (a range of seqs: one input stored whole), StoreError;
                          locate (which store is the run's) with Access, Located, NoStore;
                          ensure_marker (the run marker in Redis), repair_if_lost
    into the store        enqueue (`producer enqueue` in one call: the store, the marker, one feed
                          pass) -> Enqueued, EnqueueSummary; EmptyInput, ChangedRequests;
                          enqueue_whole (a file as ONE input, whole or not at all, as the Batch
                          API stores a batch) -> Whole, with each refused line's Problem and Fault
    input files           Lines (a file read as enqueue reads it), input_problem, MissingExtra, first_url
                          (the endpoint of a file's first request: its run's kind)
    results               collect_once (the workers' results into the store); export, write_export,
                          write_empty, check_target, ExportError (the OpenAI batch output file)
    taking work back      cancel_prompts, cancelled_line (a span's prompts cancelled, their lines)
    a shared fleet        priority_level (a batch's priority by name), read_tenants (each tenant's figures the
                          head published); an input's owner: enqueue_whole(owner=...)
    watching              gather_progress (the figures of a progress line), cache_text (the radix
                          caches' line), cannot_serve (what to
                          say of a worker whose server cannot serve)

Each name is documented where it is defined; this module adds `enqueue`, `first_url` and `repair_if_lost`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from batchfleet.config import DEFAULT_QUEUE, Config
from batchfleet.fleetview import read_fleet_view
from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys

from .collect import collect_once
from .ends import cancel_prompts, cancelled_line
from .enqueue import (
    ChangedRequests,
    EmptyInput,
    EnqueueSummary,
    Fault,
    Problem,
    Whole,
    enqueue_file,
    enqueue_whole,
    read_requests,
)
from .export import ExportError, check_target, export, write_empty, write_export
from .feed import FeedSummary, feed_pass
from .inputs import Lines, MissingExtra, input_problem
from .locate import Access, Located, NoStore, ensure_marker, locate
from .recover import _take_failed, recover
from .share import PRIORITIES
from .status import cache_text, cannot_serve, gather_progress
from .store import Span, Store, StoreError
from .tenants import read_tenants

__all__ = [
    "Access",
    "ChangedRequests",
    "EmptyInput",
    "EnqueueSummary",
    "Enqueued",
    "ExportError",
    "Fault",
    "Lines",
    "Located",
    "MissingExtra",
    "NoStore",
    "Problem",
    "Span",
    "Store",
    "StoreError",
    "Whole",
    "cache_text",
    "cancel_prompts",
    "cancelled_line",
    "cannot_serve",
    "check_target",
    "collect_once",
    "enqueue",
    "enqueue_whole",
    "ensure_marker",
    "export",
    "first_url",
    "gather_progress",
    "input_problem",
    "locate",
    "priority_level",
    "read_tenants",
    "repair_if_lost",
    "write_empty",
    "write_export",
]


@dataclass
class Enqueued:
    """What `enqueue` did: the run's store (open: the caller closes it), the file's summary, the feed pass."""

    store: Store
    summary: EnqueueSummary
    fed: FeedSummary
    waiting: int  # prompts left in the store for the head to feed


def repair_if_lost(config: Config, r: redis.Redis, loc: Located) -> None:
    """A writing command found the run's Redis data lost: requeue what was lost before the marker is
    written again (the marker says all is well)."""
    if loc.lost:
        s = recover(r, loc.store, Keys(config.run))
        print(f"producer: Redis lost the data of run {config.run} (no marker {Keys(config.run).meta}): requeued "
              f"{s.requeued:,} prompt(s) from the store ({s.lost:,} lost, {s.foreign:,} failed by a foreign "
              f"worker; {s.in_redis:,} still in Redis)", file=sys.stderr)


def first_url(path: str | Path) -> tuple[int, str] | None:
    """(line number, url) of the first request of the input file at `path` as enqueue reads it (lines it
    would reject are passed over), or None when it holds none. A run holds one kind (enqueue refuses a
    file that mixes embedding and generation requests), so this is the kind of the file's run. Reads
    up to that line only; not for stdin (`-`), whose lines it would take."""
    with Lines(str(path)) as lines:
        for lineno, _, _, got in read_requests(lines, {}, "default"):
            if type(got) is tuple:
                return lineno, got[1]
    return None


def priority_level(name: str) -> int | None:
    """The level of a batch's priority by name as the head's feed orders them (high 0, normal 1, low 2:
    the lowest first), or None for a name it does not know."""
    return PRIORITIES.get(name)


def enqueue(config: Config, r: redis.Redis, path: str | Path, *, queues: tuple[str, ...] = (),
            explicit: bool = True, defaults: dict[str, Any] | None = None, model: str = "default",
            rejects_path: Path | None = None, progress: bool = False, rerun_changed: bool = False,
            plan: bool = True) -> Enqueued:
    """`producer enqueue`: the file into the run's store, the run marker, one feed pass. `plan`: the run is
    fed by the prefix plan (producer/plan.py), or by expected work alone (`--no-plan`). Raises
    EmptyInput (before anything is made) when the file holds no prompt, ChangedRequests (nothing of the
    file stored, nothing fed) when it asks other requests for custom_ids the store knows and not
    `rerun_changed`."""
    keys = Keys(config.run)
    with Lines(str(path)) as source:
        if not source.has_prompt_line():
            raise EmptyInput(f"{source.name} holds no prompts (it is empty or only blank lines): nothing enqueued")
        loc = locate(config, r, explicit=explicit, access=Access.CREATE)
        try:
            if loc.store.cancelled_at() is not None:
                raise StoreError(f"run {config.run} was cancelled (producer cancel): its workers take no more work; "
                                 f"enqueue under a new run name, or `producer purge {config.run} --yes` first and "
                                 "start a new store")
            repair_if_lost(config, r, loc)
            if not queues and not (loc.marker and loc.marker.queues) and not read_fleet_view(r, keys).capacity:
                queues = (DEFAULT_QUEUE,)  # nothing given and no worker yet: where `rq worker gpu0` looks
            marker = ensure_marker(r, config, loc.store, queues=queues)

            if plan != loc.store.plan.on:
                with loc.store.write():
                    loc.store.plan.turn(plan)

            def take_failed(failed: list[tuple[int, str]]) -> None:
                _take_failed(r, keys, [(seq, job_id_for(config.run, cid)) for seq, cid in failed])

            s = enqueue_file(loc.store, source, defaults=defaults or {}, model=model, rejects_path=rejects_path,
                             progress=progress, rerun_changed=rerun_changed, take_failed=take_failed,
                             adapters=frozenset(config.lora_adapters),
                             generates=read_fleet_view(r, keys).is_generation)
            loc.store.plan.beside = False  # a large store's plan is the head's: this feed pass goes by expected work
            try:
                fed = feed_pass(config, r, loc.store, marker.queues)
            finally:
                loc.store.plan.beside = True  # `batchfleet run` goes on feeding from this store
            with loc.store.read():
                waiting = loc.store.counts()["waiting"]
        except BaseException:
            loc.store.close()
            raise
    return Enqueued(loc.store, s, fed, waiting)
