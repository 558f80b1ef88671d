"""Which store is the run's: the one its marker in Redis names, on the host it names.

    marker in Redis        the store is the marker's (host, absolute path, id); another host, another
                           path given, or a store with another id is refused with a message naming the
                           right one. Any directory works: no need to cd to where the run was enqueued.
    no marker, Redis up    a new run (enqueue creates the store and writes the marker), a run that ended
                           (its keys expired or were purged: every prompt has its result or was
                           cancelled, nothing is FED), or a run whose Redis lost its data: the store at
                           --state-dir has FED prompts (`lost`)
    Redis down             the store at --state-dir (default .batchfleet/<run>.sqlite), read-only

Reads (`status`, and `export` with Redis down) open SQLite read-only and never create a directory or
a store.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import redis

from batchfleet.config import Config
from batchfleet.errors import RecordError
from batchfleet.keys import Keys
from batchfleet.marker import FINISHED, RunMarker, read_marker

from .store import MissingStore, Store, StoreError

__all__ = ["HOST", "Access", "Located", "NoStore", "ensure_marker", "locate"]

HOST = socket.gethostname()


class Access(Enum):
    """What a command does with the run's store, so what `locate` may do to find it."""

    CREATE = "create"  # enqueue: create the store when the run is new
    WRITE = "write"  # head, collect, recover, export: the store must exist
    READ = "read"  # status: read-only


class NoStore(StoreError):
    """Nothing was enqueued in this run yet (no marker, no store)."""


@dataclass
class Located:
    store: Store
    marker: RunMarker | None
    redis_error: str | None = None  # Redis could not be read: the store at --state-dir was opened
    lost: bool = False  # the marker is missing while the store has fed prompts: Redis lost the run's data


def locate(config: Config, r: redis.Redis | None, *, explicit: bool, access: Access) -> Located:
    """The run's store (see the module doc). `explicit`: --state-dir / BATCHFLEET_STATE_DIR was given.
    Raises StoreError (with the right store named) or NoStore."""
    keys = Keys(config.run)
    marker, redis_error = None, None
    if r is not None:
        try:
            marker = read_marker(r, keys)
        except redis.AuthenticationError:
            raise  # not down: wrong credentials are the caller's error to report
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            redis_error = f"{type(exc).__name__}: {exc}"
        except RecordError as exc:
            raise StoreError(f"{exc}: check it (redis-cli HGETALL {keys.meta}); it names the run's store") from None
    given = config.results_db.absolute()
    if marker is not None:
        if marker.host != HOST:
            raise StoreError(f"run {config.run}'s store is on host {marker.host} at {marker.path} "
                             f"(this is {HOST}): run this command there")
        path = Path(marker.path)
        if explicit and given != path:
            raise StoreError(f"run {config.run}'s store is {marker.path} on {marker.host}, not {given}: "
                             f"use --state-dir {marker.state_dir}, or give no --state-dir")
        try:
            store = Store.open(path, run=config.run, readonly=access is Access.READ)
        except MissingStore:
            raise StoreError(f"run {config.run}'s store {marker.path} on {marker.host} (named by the run marker "
                             f"{keys.meta} in Redis) is missing") from None
        if store.id != marker.store_id:
            store.close()
            raise StoreError(f"{path} is not run {config.run}'s store: its id is {store.id}, the run marker in "
                             f"Redis names store {marker.store_id} at {marker.path} on {marker.host}")
        return Located(store, marker)
    if access is Access.CREATE and redis_error is None:
        store = Store.create_or_open(given, run=config.run)
    else:
        try:
            store = Store.open(given, run=config.run, readonly=access is Access.READ or redis_error is not None)
        except MissingStore:
            if redis_error is not None:
                raise StoreError(f"Redis is down ({redis_error}) and there is no store at {given}: give "
                                 "--state-dir of the run's store") from None
            raise NoStore(f"run {config.run} has no marker in Redis ({keys.meta}) and there is no store at "
                          f"{given}: nothing was enqueued in this run (or give --state-dir)") from None
    return Located(store, None, redis_error, lost=redis_error is None and store.in_redis())


def ensure_marker(r: redis.Redis, config: Config, store: Store, *, queues: tuple[str, ...] = ()) -> RunMarker:
    """Write the run's marker naming `store` (adding `queues` to those recorded). The caller has checked
    the store is the run's (`locate`) and repaired a loss first: writing the marker ends the alarm."""
    keys = Keys(config.run)
    old = read_marker(r, keys)
    merged = tuple(dict.fromkeys((*(old.queues if old else ()), *queues)))
    marker = RunMarker(store_id=store.id, host=HOST, path=str(store.path), created=store.created, queues=merged)
    if old != marker:
        r.hset(keys.meta, mapping=marker.to_mapping())
    # the run has work again: keys left with a TTL by its end (see producer.ends) live as long as it now
    pipe = r.pipeline(transaction=False)
    pipe.hdel(keys.meta, FINISHED)
    for key in keys.run_keys():
        pipe.persist(key)
    pipe.execute()
    return marker
