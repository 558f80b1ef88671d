"""What the API knows of its files and batches, on disk beside the run's store.

    <state dir>/<run>.api.sqlite   files(id, owner, doc), batches(n, id, owner, doc): one JSON record each
    <state dir>/<run>.files/<id>   the bytes of each file (uploads, outputs, errors)

Every file is 0600 and every directory 0700. Each change is committed before it is answered
(synchronous=FULL): a `kill -9` of serve loses no file it acknowledged and no batch state it showed.
A file's bytes are written beside their place, synced and renamed into it before its record is
committed; bytes with no record (a crash in between) are removed at the next start.

The records are also held in memory, which is what the API reads: a poll costs no query. A record is
never changed in place: a new one replaces it (under the lock), so a reader never sees half of a
change made by the batch engine's thread. A change holds `lock` through its commit (its fsync); a
reader takes only the short lock of the memory, so no read waits on the disk.

Every method that writes (the commits, `Upload`) blocks on the disk: the API calls them in a thread,
never on its event loop.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from batchfleet.redact import private_dir

from .objects import BatchRecord, FileRecord
from .quota import Tally

__all__ = ["Registry", "Upload"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (n INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
                                    doc BLOB NOT NULL);
"""


class Registry:
    def __init__(self, state_dir: Path, run: str) -> None:
        private_dir(state_dir)
        self.dir = private_dir(state_dir / f"{run}.files")
        self.path = state_dir / f"{run}.api.sqlite"
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self.db.execute(statement)
        self.lock = threading.RLock()  # one change at a time, through its commit
        self._mem = threading.Lock()  # the dicts below, changed and copied only under it: never held over a commit
        self.files: dict[str, FileRecord] = {}
        self.batches: dict[str, BatchRecord] = {}  # in creation order
        for (doc,) in self.db.execute("SELECT doc FROM files ORDER BY rowid"):
            rec = FileRecord.from_doc(orjson.loads(doc))
            self.files[rec.id] = rec
        for (doc,) in self.db.execute("SELECT doc FROM batches ORDER BY n"):
            b = BatchRecord.from_json(doc)
            self.batches[b.id] = b
        self._order = list(self.batches)
        self._open = {i: None for i, b in self.batches.items() if not b.final}  # unfinished, oldest first
        self._sweep()

    def _sweep(self) -> None:
        """Bytes without a record (a crash between writing and committing): gone."""
        for p in self.dir.iterdir():
            if p.name not in self.files:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    # --- files --------------------------------------------------------------------------------------
    def file_path(self, file_id: str) -> Path:
        return self.dir / file_id

    def temp_path(self, file_id: str) -> Path:
        """Where a file's bytes are written before they are renamed into place (swept if left)."""
        return self.dir / f".{file_id}.tmp"

    def add_file(self, rec: FileRecord) -> None:
        """Record a file whose bytes are in place (`file_path`)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO files (id, owner, doc) VALUES (?, ?, ?)",
                       (rec.id, rec.owner, orjson.dumps(_file_doc(rec))))
            with self._mem:
                self.files[rec.id] = rec

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            gone = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0
            with self._mem:
                self.files.pop(file_id, None)
        self.file_path(file_id).unlink(missing_ok=True)
        return gone

    def file(self, file_id: str, owner: str) -> FileRecord | None:
        rec = self.files.get(file_id)
        return rec if rec is not None and rec.owner == owner else None

    def list_files(self, owner: str, *, purpose: str | None = None, order: str = "desc") -> list[FileRecord]:
        with self._mem:
            out = [f for f in self.files.values() if f.owner == owner and (purpose is None or f.purpose == purpose)]
        return out[::-1] if order == "desc" else out

    # --- batches ------------------------------------------------------------------------------------
    def put_batch(self, rec: BatchRecord) -> None:
        """Add a batch, or replace its record by a new one."""
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, owner, doc) VALUES (?, ?, ?) "
                       "ON CONFLICT(id) DO UPDATE SET doc = excluded.doc", (rec.id, rec.owner, rec.to_json()))
            with self._mem:
                if rec.id not in self.batches:
                    self._order.append(rec.id)
                self.batches[rec.id] = rec
                if rec.final:
                    self._open.pop(rec.id, None)
                else:
                    self._open.setdefault(rec.id, None)

    def update(self, batch_id: str, change: Callable[[BatchRecord], BatchRecord | None], *,
               persist: bool = True) -> BatchRecord:
        """Replace a batch's record by `change(current)` (None: leave it), atomically against every other
        change: what the engine decided is applied to the record as it is now (a cancel may have come
        in meanwhile). `persist=False`: in memory only, for figures derived from the store
        (request_counts), which a restart derives again. Returns the record now."""
        with self.lock:
            current = self.batches[batch_id]
            new = change(current)
            if new is None:
                return current
            if persist:
                self.put_batch(new)
            else:
                with self._mem:
                    self.batches[batch_id] = new
            return new

    def batch(self, batch_id: str, owner: str) -> BatchRecord | None:
        rec = self.batches.get(batch_id)
        return rec if rec is not None and rec.owner == owner else None

    def list_batches(self, owner: str) -> list[BatchRecord]:
        """The owner's batches, newest first."""
        with self._mem:
            return [b for b in (self.batches[i] for i in reversed(self._order)) if b.owner == owner]

    def all_batches(self, start: int = 0) -> list[BatchRecord]:
        """Every batch, oldest first; from the `start`-th made on (those made since a caller looked)."""
        with self._mem:
            return [self.batches[i] for i in self._order[start:]]

    def unfinished(self) -> list[BatchRecord]:
        """Every batch not in a final state, oldest first."""
        with self._mem:
            return [self.batches[i] for i in self._open]


class Upload:
    """A file's bytes as they arrive: written beside their place (`Registry.temp_path`); `keep` syncs
    them, renames them into place and commits the file's record, `discard` drops them. Each call
    blocks on the disk (the API runs them in a thread); a lock keeps them in order, so `discard` after
    a cancelled `write` waits for it."""

    def __init__(self, registry: Registry, file_id: str) -> None:
        self.registry = registry
        self.tmp = registry.temp_path(file_id)
        self.lock = threading.Lock()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.tally = Tally()  # its requests and their conversations' bytes, for the quotas

    def write(self, data: bytes | bytearray) -> None:
        with self.lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self.tally.feed(data)

    def keep(self, rec: FileRecord) -> FileRecord:
        """The bytes synced and in place, the record committed (with the upload's counts): from here a
        `kill -9` loses nothing. Returns the record."""
        with self.lock:
            rec.requests, rec.prompt_bytes = self.tally.close()
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.registry.file_path(rec.id))
            self.registry.add_file(rec)
            return rec

    def discard(self) -> None:
        """Drop what was not kept (nothing, after `keep`)."""
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            self.tmp.unlink(missing_ok=True)


def _file_doc(rec: FileRecord) -> dict[str, object]:
    return {"id": rec.id, "owner": rec.owner, "filename": rec.filename, "bytes": rec.bytes, "purpose": rec.purpose,
            "created_at": rec.created_at, "requests": rec.requests, "prompt_bytes": rec.prompt_bytes}
