"""The store's file: its tables, how a new one is made, how an old layout is brought up to date.

The layout is `store.py`'s docstring. A new store is made in a private file beside its path, then
linked into place (`create`), so whoever opens the path finds a whole store or no file. A store of an
older layout is migrated in place by the first writer that opens it (`migrate`).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from batchfleet.records import Result
from batchfleet.redact import private_dir

__all__ = ["PAGE_SIZE", "READABLE", "SCHEMA_VERSION", "connect", "create", "migrate"]

SCHEMA_VERSION = "4"  # 3: request fingerprints, reruns, input files' paths and fingerprints; 4: the plan
# Pages of a new store: 16 KiB, not SQLite's 4 KiB. An enqueue (a serve batch) writes its prompts in big
# transactions; with a quarter of the pages to link, checksum and append to the WAL, storing 50,000
# requests of ~260 B takes ~25% less time (a store made before keeps its pages).
PAGE_SIZE = 16384
READABLE = ("2", "3", SCHEMA_VERSION)  # layouts read as they are where they cannot be migrated (read-only)

# `prompts_waiting` is ordered by (cost DESC, seq), the feed's order; it also holds pk and file (and state, so
# SQLite takes it as covering) for the plan's sorted pass, which then never reads the prompts' bodies
# (store.py's `_WAITING_BY_INPUT` is its twin for a store fed by input; docs/store.md).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, path TEXT, fp TEXT, prompts INTEGER, enqueued_at REAL
);
CREATE TABLE IF NOT EXISTS prompts (
    seq INTEGER PRIMARY KEY,
    cid TEXT NOT NULL UNIQUE,
    ep INTEGER NOT NULL,
    body BLOB NOT NULL,
    file INTEGER NOT NULL,
    line INTEGER NOT NULL,
    cost INTEGER NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,
    fp BLOB,
    pk BLOB
);
CREATE INDEX IF NOT EXISTS prompts_waiting ON prompts(cost DESC, seq, pk, file, state) WHERE state = 0;
CREATE INDEX IF NOT EXISTS prompts_fed ON prompts(seq) WHERE state = 1;
CREATE TABLE IF NOT EXISTS results (
    seq INTEGER PRIMARY KEY, ok INTEGER NOT NULL, line BLOB NOT NULL, finished_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tally (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reruns (seq INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS plan (pos INTEGER PRIMARY KEY, seq INTEGER NOT NULL, file INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS plan_cursors (file INTEGER PRIMARY KEY, pos INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS owners (file INTEGER PRIMARY KEY, tenant TEXT NOT NULL, priority INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, weight REAL NOT NULL) WITHOUT ROWID;
INSERT OR IGNORE INTO tally (name, n) VALUES ('waiting', 0), ('fed', 0), ('done', 0), ('ok', 0), ('cancelled', 0);
"""

# Schema 2 -> 3: the columns and table fingerprints need. Old rows keep fp NULL (computed when needed).
_MIGRATE_2 = """
ALTER TABLE prompts ADD COLUMN fp BLOB;
ALTER TABLE files ADD COLUMN path TEXT;
ALTER TABLE files ADD COLUMN fp TEXT;
ALTER TABLE files ADD COLUMN prompts INTEGER;
ALTER TABLE files ADD COLUMN enqueued_at REAL;
CREATE TABLE IF NOT EXISTS reruns (seq INTEGER PRIMARY KEY);
"""

# Schema 3 -> 4: the prefix plan (producer/plan.py; old rows keep pk NULL: they sort together, first),
# and who owns an input and how much the fleet owes it (`batchfleet serve`'s tenants).
_MIGRATE_3 = """
ALTER TABLE prompts ADD COLUMN pk BLOB;
CREATE TABLE IF NOT EXISTS plan (pos INTEGER PRIMARY KEY, seq INTEGER NOT NULL, file INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS plan_cursors (file INTEGER PRIMARY KEY, pos INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS owners (file INTEGER PRIMARY KEY, tenant TEXT NOT NULL, priority INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, weight REAL NOT NULL) WITHOUT ROWID;
"""


def create(path: Path, run: str) -> None:
    """Make the store in a private file beside `path`, then link it into place. Whoever opens
    `path` (the head polls it from before the first enqueue) finds a whole store already in WAL
    mode, or no file: never an empty file, tables without their meta rows, or a connection
    switching the file to WAL (that switch fails at once with "database is locked" for a
    concurrent opener, busy timeout or not). Two creators at once: the first link wins, the
    other opens that store."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.new")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    try:
        db = connect(tmp, readonly=False)
        try:
            db.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", [
                ("schema", SCHEMA_VERSION), ("store_id", uuid.uuid4().hex), ("run", run),
                ("created", repr(time.time())), ("host", socket.gethostname()), ("rejected_results", "0")])
            db.execute("COMMIT")
        finally:
            db.close()  # the last connection checkpoints: the file alone is the whole store
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another enqueue made it first: open that one
        except OSError:  # a file system without hard links (some network or FUSE ones)
            if not path.exists():
                os.replace(tmp, path)  # atomic too; only a second creator racing here could lose
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)


@contextmanager
def writing(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction holding SQLite's writer lock from its first statement (BEGIN IMMEDIATE),
    rolled back on any error."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def connect(path: Path, *, readonly: bool) -> sqlite3.Connection:
    """A connection in autocommit mode: transactions are explicit (BEGIN IMMEDIATE / BEGIN), never implicit."""
    if readonly:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=60.0)
    else:
        db = sqlite3.connect(path, isolation_level=None, timeout=60.0)
        db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a store being made (`create`); no-op on one made
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL-safe
    db.execute("PRAGMA cache_size=-65536")  # 64 MiB: the unique cid index of a 10M-prompt run
    return db


def migrate(db: sqlite3.Connection, schema: str) -> str:
    """Bring a store of layout `schema` up to this one, in one transaction (another process may have
    done it meanwhile); returns the layout it has then."""
    with writing(db):
        schema = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0]
        if schema == "2":
            _migrate_2(db)
            schema = "3"
        if schema == "3":
            _run(db, _MIGRATE_3)
            schema = "4"
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (schema,))
    return schema


def _run(db: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _migrate_2(db: sqlite3.Connection) -> None:
    """Schema 2 -> 3: the fingerprint columns, and the export lines of HTTP errors in OpenAI's shape."""
    _run(db, _MIGRATE_2)
    fixed = []
    for seq, raw in db.execute("SELECT seq, line FROM results WHERE ok = 0").fetchall():
        line = orjson.loads(raw)
        resp, err = line.get("response"), line.get("error")
        if isinstance(resp, dict) and isinstance(err, dict) and isinstance(resp.get("status_code"), int):
            # the one definition of an export line; the server's body was not kept then
            res = Result(cid=line["custom_id"], jid=str(resp.get("request_id")), seq=seq,
                         status_code=resp["status_code"], body=resp.get("body"), error=err)
            fixed.append((orjson.dumps(res.batch_output_line()), seq))
    db.executemany("UPDATE results SET line = ? WHERE seq = ?", fixed)
