"""`producer export`: the OpenAI batch output file, one line per prompt that has a result (a prompt of a
cancelled run that had none exports with error code `cancelled`).

Lines come out in input order (the store's `seq`), each exactly `Result.batch_output_line()` as the
collector stored it; only prompts enqueued into the store can have one (see collect.py). The file is
written next to its destination and renamed into place, so a reader never sees half an export.
With Redis up, results waiting in Redis are collected first; with Redis down, the store alone is
exported (read-only).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from batchfleet.keys import Keys

from .collect import collect_once
from .store import Store

__all__ = ["ExportSummary", "export"]

SHOW_PENDING = 5


@dataclass
class ExportSummary:
    path: Path
    written: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0  # prompts `producer cancel` took back: their lines say error code `cancelled`
    pending: int = 0
    rejected: int = 0  # results dropped over the run because they answered no prompt of it
    first_pending: list[str] = field(default_factory=list)


def export(r: redis.Redis | None, store: Store, keys: Keys, out: Path, *, wait: bool = False,
           timeout_s: float | None = None, poll_s: float = 2.0) -> ExportSummary:
    """Collect (unless `r` is None; with `wait`: until nothing is pending or `timeout_s` passes), then
    write `out`."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while r is not None:
        collect_once(r, store, keys)
        with store.read():
            pending = store.counts()["pending"]
        if not wait or pending == 0 or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the export private to this user
    try:
        with store.read(), os.fdopen(fd, "wb") as fh:
            # one read snapshot: the counts and the lines agree even while a collector writes
            counts = store.counts()
            summary = ExportSummary(path=out, succeeded=counts["succeeded"], failed=counts["failed"],
                                    cancelled=counts["cancelled"],
                                    pending=counts["pending"], rejected=store.rejected_results(),
                                    first_pending=store.pending_examples(SHOW_PENDING))
            for line in store.result_lines():
                fh.write(line)
                fh.write(b"\n")
                summary.written += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return summary
