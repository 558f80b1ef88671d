"""`producer runs`: the runs a Redis holds (every `bf:<run>:meta` run marker), with their counts.

Counts come from the run's store when it is on this host (the source of truth: prompts, succeeded,
failed, cancelled, pending), else from the run's counters in Redis (succeeded, failed; the prompt
total and the cancelled are only known to the store). The store also says which input files the run
came from: their paths and the fingerprints of their requests (`store.FileFingerprint`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis

from batchfleet.errors import RecordError
from batchfleet.fleetview import read_fleet_view
from batchfleet.keys import Keys
from batchfleet.marker import read_marker

from .locate import HOST
from .store import Input, Store, StoreError

__all__ = ["format_runs", "input_dict", "input_text", "list_runs"]


def _int(v: bytes | None) -> int:
    try:
        return int(float(v or 0))
    except ValueError:
        return 0


def input_dict(i: Input) -> dict[str, Any]:
    """An input file of a run, as `runs --json` and `status --json` show it."""
    return {"name": i.name, "path": i.path, "fingerprint": i.fp, "prompts": i.prompts, "enqueued_at": i.enqueued_at}


def input_text(d: dict[str, Any]) -> str:
    """An `input_dict` on one line: the path and the start of the fingerprint."""
    return f"{d['path']} (requests {d['fingerprint'][:12]}, {d['prompts']:,} prompts)"


def list_runs(r: redis.Redis) -> list[dict[str, Any]]:
    """One dict per run marker, sorted by run name: run, host, store, created, counts_from, prompts,
    succeeded, failed, cancelled, pending (None when unknown), workers (status records alive), inputs
    (the input files, the latest last; empty when the store is not on this host)."""
    runs = sorted({run for key in r.scan_iter(match=Keys.META_PATTERN, count=1000)
                   if (run := Keys.run_of_meta(key)) is not None})
    out = []
    for run in runs:
        keys = Keys(run)
        row: dict[str, Any] = {"run": run, "host": None, "store": None, "created": None, "counts_from": "redis",
                               "prompts": None, "cancelled": None, "pending": None, "inputs": []}
        try:
            marker = read_marker(r, keys)
        except RecordError as exc:
            marker = None
            row["problem"] = str(exc)
        if marker is not None:
            row.update(host=marker.host, store=marker.path, created=marker.created)
        succeeded, failed = r.hmget(keys.stats, "succeeded", "failed")
        row.update(succeeded=_int(succeeded), failed=_int(failed))
        row["workers"] = len(read_fleet_view(r, keys).live)
        if marker is not None and marker.host == HOST and Path(marker.path).exists():
            try:
                store = Store.open(Path(marker.path), run=run, readonly=True)
                try:
                    with store.read():
                        c = store.counts()
                        inputs = store.inputs()
                finally:
                    store.close()
                row.update(counts_from="store", prompts=c["prompts"], succeeded=c["succeeded"], failed=c["failed"],
                           cancelled=c["cancelled"], pending=c["pending"], inputs=[input_dict(i) for i in inputs])
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
    table = [("run", "prompts", "succeeded", "failed", "pending", "cancelled", "workers", "created", "store")]
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"])) if row["created"] else "?"
        where = f"{row['host']}:{row['store']}" if row["store"] else "?"
        where += "" if row["counts_from"] == "store" else " (counts: Redis)"
        table.append((row["run"], _n(row["prompts"]), _n(row["succeeded"]), _n(row["failed"]), _n(row["pending"]),
                      _n(row["cancelled"]), str(row["workers"]), created, where))
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.rjust(w) if 0 < i < 7 else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths, strict=True)))
             .rstrip() for t in table]
    for row in rows:
        if row["inputs"]:
            more = f" (+{len(row['inputs']) - 1} earlier)" if len(row["inputs"]) > 1 else ""
            lines.append(f"{row['run']}: input {input_text(row['inputs'][-1])}{more}")
    lines += [f"{row['run']}: {row['problem']}" for row in rows if row.get("problem")]
    return "\n".join(lines)
