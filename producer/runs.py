"""`producer runs`: the runs a Redis holds (every `bf:<run>:meta` run marker), with their counts.

Counts come from the run's store when it is on this host (the source of truth: prompts, succeeded,
failed, pending), else from the run's counters in Redis (succeeded, failed; the prompt total is
only known to the store).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis

from batchfleet.errors import RecordError
from batchfleet.keys import Keys
from batchfleet.marker import read_marker

from .locate import HOST
from .store import Store, StoreError

__all__ = ["format_runs", "list_runs"]


def _int(v: bytes | None) -> int:
    try:
        return int(float(v or 0))
    except ValueError:
        return 0


def list_runs(r: redis.Redis) -> list[dict[str, Any]]:
    """One dict per run marker, sorted by run name: run, host, store, created, counts_from, prompts,
    succeeded, failed, pending (None when unknown), workers (status records alive)."""
    runs = sorted({run for key in r.scan_iter(match=Keys.META_PATTERN, count=1000)
                   if (run := Keys.run_of_meta(key)) is not None})
    out = []
    for run in runs:
        keys = Keys(run)
        row: dict[str, Any] = {"run": run, "host": None, "store": None, "created": None, "counts_from": "redis",
                               "prompts": None, "pending": None}
        try:
            marker = read_marker(r, keys)
        except RecordError as exc:
            marker = None
            row["problem"] = str(exc)
        if marker is not None:
            row.update(host=marker.host, store=marker.path, created=marker.created)
        succeeded, failed = r.hmget(keys.stats, "succeeded", "failed")
        row.update(succeeded=_int(succeeded), failed=_int(failed))
        row["workers"] = sum(1 for w in r.smembers(keys.workers) if r.exists(keys.status(w.decode(errors="replace"))))
        if marker is not None and marker.host == HOST and Path(marker.path).exists():
            try:
                store = Store.open(Path(marker.path), run=run, readonly=True)
                try:
                    with store.read():
                        c = store.counts()
                finally:
                    store.close()
                row.update(counts_from="store", prompts=c["prompts"], succeeded=c["succeeded"], failed=c["failed"],
                           pending=c["pending"])
            except StoreError as exc:
                row["problem"] = str(exc)
        out.append(row)
    return out


def _n(v: int | None) -> str:
    return "?" if v is None else f"{v:,}"


def format_runs(rows: list[dict[str, Any]], *, as_json: bool) -> str:
    if as_json:
        return orjson.dumps(rows).decode()
    if not rows:
        return "no runs in this Redis (no bf:<run>:meta marker: nothing was enqueued here)"
    table = [("run", "prompts", "succeeded", "failed", "pending", "workers", "created", "store")]
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"])) if row["created"] else "?"
        where = f"{row['host']}:{row['store']}" if row["store"] else "?"
        where += "" if row["counts_from"] == "store" else " (counts: Redis)"
        table.append((row["run"], _n(row["prompts"]), _n(row["succeeded"]), _n(row["failed"]), _n(row["pending"]),
                      str(row["workers"]), created, where))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) if 0 < i < 6 else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths, strict=True)))
             .rstrip() for t in table]
    lines += [f"{row['run']}: {row['problem']}" for row in rows if row.get("problem")]
    return "\n".join(lines)
