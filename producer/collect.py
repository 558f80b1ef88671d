"""`producer collect`: move finished prompts' results from Redis into the SQLite store.

Workers XADD one `Result` per finished prompt to `Keys.results` and SADD its job id to `Keys.done`.
The collector reads the stream in batches, stores each batch in one write transaction (success wins
over failure), and only after COMMIT deletes the entries and the job ids from Redis. A crash in
between stores the same results again next time, which the upsert makes harmless. Draining is what
keeps Redis memory bounded however many prompts a run has.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass

import orjson
import redis

from batchfleet.keys import Keys
from batchfleet.records import Result

from .store import Store

__all__ = ["CollectSummary", "collect_once", "follow", "redis_time_s"]

BATCH = 1000


@dataclass
class CollectSummary:
    succeeded: int = 0
    failed: int = 0
    unreadable: int = 0  # entries left in the stream because they do not decode as a Result

    @property
    def stored(self) -> int:
        return self.succeeded + self.failed


def redis_time_s(entry_id: bytes) -> float:
    """When Redis added a stream entry, in seconds: the milliseconds part of its id (`<ms>-<seq>`). Entries
    of one millisecond tie; the store's upsert lets the later-applied one win, and entries are applied in
    stream order."""
    return int(entry_id.partition(b"-")[0]) / 1000


def collect_once(r: redis.Redis, store: Store, keys: Keys, *, batch: int = BATCH) -> CollectSummary:
    """Drain the results stream as it stands now."""
    out = CollectSummary()
    lo = "-"
    while True:
        entries = r.xrange(keys.results, min=lo, max="+", count=batch)
        if not entries:
            return out
        ids, jids, rows, prompts = [], [], [], []
        for eid, fields in entries:
            try:
                res = Result.from_json(fields[b"r"])
            except (KeyError, TypeError, ValueError) as exc:
                out.unreadable += 1
                print(f"collect: stream entry {eid.decode()} is not a Result ({exc}); left in place",
                      file=sys.stderr)
                continue
            ids.append(eid)
            jids.append(res.jid)
            # Ordered by Redis's clock (the entry id's milliseconds), not the worker host's: two hosts'
            # results for one prompt are compared by when Redis accepted them.
            rows.append((res.cid, res.jid, int(res.ok), orjson.dumps(res.batch_output_line()), redis_time_s(eid)))
            # a prompt whose enqueue crashed before its row was written still gets exported
            prompts.append((res.cid, res.seq, res.jid, ""))
            if res.ok:
                out.succeeded += 1
            else:
                out.failed += 1
        if rows:
            with store.write():
                store.upsert_results(rows)
                store.add_prompts(prompts)
            pipe = r.pipeline(transaction=False)
            pipe.xdel(keys.results, *ids)
            pipe.srem(keys.done, *jids)
            pipe.execute()
        if len(entries) < batch:
            return out
        lo = "(" + entries[-1][0].decode()  # exclusive: skips entries left in place above


def follow(r: redis.Redis, store: Store, keys: Keys, *, interval_s: float) -> CollectSummary:
    """Collect every `interval_s` until SIGINT/SIGTERM; the pass in progress finishes first."""
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    total = CollectSummary()
    try:
        while not stop.is_set():
            got = collect_once(r, store, keys)
            total.succeeded += got.succeeded
            total.failed += got.failed
            total.unreadable = got.unreadable
            if got.stored:
                print(f"collect: +{got.succeeded} ok, +{got.failed} failed "
                      f"(total {total.succeeded} ok, {total.failed} failed)", file=sys.stderr, flush=True)
            stop.wait(interval_s)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    return total
