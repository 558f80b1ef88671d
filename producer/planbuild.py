"""The plan's sorted pass beside the head's loop, for a store too large to sort inside a feed pass.

`Plan.rebuild` orders the waiting prompts in one SQL statement inside the caller's write transaction:
right for a few thousand prompts, but at 10M the sort takes ~23 s and holds SQLite's single writer
lock all along: the enqueue that ends with a feed pass waited for it, and so did the head's loop (no
result collected, no window topped up). A `Build` makes the same pass in a thread on a connection of
its own, in two steps that never hold the writer lock for long:

1. **sort**, in a read transaction (a snapshot, WAL: the head writes on): the waiting prompts in plan
   order into a TEMP table, which lives in the connection's private temporary database (spilled to a
   temporary file as it grows; SQLite's sorter is bounded the same way), so the store's lock is not
   taken. The snapshot also reads `plan_stale`: what it holds then is what this plan covers.
2. **copy**, into a table of the store named for this build, `CHUNK` rows per write transaction (~10 ms
   each), pausing as long after each: a writer of the head's waits about one chunk, not the copy.

The head installs a finished build in one of its own write transactions (`Plan.next`): the build's
table becomes `plan`, the cursors start again, and the plan is current unless prompts became WAITING
after the snapshot (then `plan_stale` changed and stays). Prompts fed while the build ran are still
in it; the plan is read with `state = 0`, so they are skipped, never fed twice. Until it is installed
the head feeds from the plan it has, or by expected work when that is empty: a build changes the
order, never what is fed.
"""

from __future__ import annotations

import itertools
import os
import sqlite3
import threading
import time
from pathlib import Path

from .storefile import connect, writing

__all__ = ["BUILD_TABLES", "CHUNK", "Build"]

CHUNK = 20_000  # plan rows per write transaction of the copy (~10 ms each)
BUILD_TABLES = "plan_build_"  # the prefix of a build's table (one left by a killed head is dropped at install)
_NUMBERS = itertools.count(1)


class Build:
    """One sorted pass in a thread of its own (module doc). `select` is the plan's ordered SELECT of
    (seq, file) over the waiting prompts, `keyed` the query saying whether any waiting prompt has a
    key (none: nothing to group, no sort). Read `done`, then `error`, `table`, `seen_stale`, `keyless`."""

    def __init__(self, path: Path, *, select: str, keyed: str, by_input: bool, stale_key: str) -> None:
        self.path = path
        self.by_input = by_input
        self.table = f"{BUILD_TABLES}{os.getpid()}_{next(_NUMBERS)}"
        self.sorted = threading.Event()  # step 1 is over: the copy (which takes the writer lock) is next
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seen_stale: str | None = None  # the store's `plan_stale` in the snapshot sorted
        self.keyless = False
        self.rows = 0
        self._select, self._keyed, self._stale_key = select, keyed, stale_key
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name="plan-build", daemon=True)
        self._thread.start()

    def cancel(self, *, wait: bool) -> None:
        """Stop the build (its table, if made, is dropped). `wait`: until its thread has ended, which a
        caller holding the store's writer lock must not ask (the thread may be waiting for that lock)."""
        with self._lock:
            self._cancelled = True
            if self._db is not None:
                self._db.interrupt()
        if wait:
            self._thread.join()

    def _run(self) -> None:
        try:
            with self._lock:
                if self._cancelled:
                    return
                self._db = db = connect(self.path, readonly=False)
            try:
                self._sort(db)
                self.sorted.set()
                self._copy(db)
            except BaseException:
                self._drop(db)
                raise
            finally:
                with self._lock:
                    self._db = None
                db.close()
        except BaseException as exc:  # handed to the head, which installs nothing and rebuilds inside its feed
            self.error = exc
        finally:
            self.done.set()

    def _sort(self, db: sqlite3.Connection) -> None:
        db.execute("BEGIN")
        try:
            row = db.execute("SELECT value FROM meta WHERE key = ?", (self._stale_key,)).fetchone()
            self.seen_stale = None if row is None else row[0]
            self.keyless = db.execute(self._keyed).fetchone() is None
            db.execute("CREATE TEMP TABLE sorted (seq INTEGER NOT NULL, file INTEGER NOT NULL)")
            if not self.keyless:
                db.execute(f"INSERT INTO temp.sorted (seq, file) {self._select}")
        finally:
            db.execute("COMMIT")

    def _copy(self, db: sqlite3.Connection) -> None:
        with writing(db):
            db.execute(f"CREATE TABLE {self.table} (pos INTEGER PRIMARY KEY, seq INTEGER NOT NULL, "
                       "file INTEGER NOT NULL)")
            if self.by_input:  # `Plan.next(file=)`; rows come in (file, pos) order: appended
                db.execute(f"CREATE INDEX {self.table}_file ON {self.table}(file, pos)")
        last = db.execute("SELECT COALESCE(MAX(rowid), 0) FROM temp.sorted").fetchone()[0]
        for lo in range(0, last, CHUNK):
            if self._cancelled:
                raise InterruptedError("cancelled")
            held = time.monotonic()
            with writing(db):
                db.execute(f"INSERT INTO {self.table} (pos, seq, file) SELECT rowid, seq, file FROM temp.sorted "
                           "WHERE rowid > ? AND rowid <= ? ORDER BY rowid", (lo, lo + CHUNK))
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")  # its own pages: the head's commit never copies them
            # as long as it held the lock: a writer polling for it (SQLite's busy handler sleeps up to
            # 100 ms between tries) gets it, where the next chunk taken at once would starve it
            time.sleep(min(0.1, time.monotonic() - held))
        self.rows = last
        db.execute("DROP TABLE temp.sorted")

    def _drop(self, db: sqlite3.Connection) -> None:
        """Best effort: a table left behind is dropped by the next install."""
        try:
            with writing(db):
                db.execute(f"DROP TABLE IF EXISTS {self.table}")
        except sqlite3.Error:
            pass

