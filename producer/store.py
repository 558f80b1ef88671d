"""The run's store: one SQLite file on the head host, the source of truth for every prompt and result.

    meta(key, value)                         store_id (a uuid), run, schema, created, rejected_results
    files(id, name, path, fp, prompts, enqueued_at)
                                             input files, so a prompt's source costs two integers; an
                                             enqueue that completes records the file's absolute path and
                                             the fingerprint of its requests (`FileFingerprint`)
    prompts(seq INTEGER PRIMARY KEY, cid UNIQUE, ep, body, file, line, cost, state, fp)
        seq    input order across every enqueue of the run (the export's order)
        ep     index into records.ENDPOINTS; body = the request body as canonical JSON (sorted keys), sent as is
        cost   expected work: the body's max_tokens (or max_completion_tokens), UNBOUNDED_COST without
        state  WAITING (only in the store) -> FED (an RQ job in Redis) -> DONE (its result is here);
               CANCELLED (`producer cancel`: never fed again; its export line is error `cancelled`)
        fp     the request's fingerprint (`fingerprint`: endpoint and canonical body); NULL in rows of
               a store made before fingerprints (computed from ep and body when needed)
    results(seq INTEGER PRIMARY KEY, ok, line, finished_at)   one final result per prompt, as its export line
    reruns(seq)                              prompts whose request `enqueue --rerun-changed` replaced: a
                                             result without the new fingerprint is not theirs
    tally(name, n)                           counts per state and of successes, kept in the same
                                             transactions as the rows (COUNT(*) over 10M rows is slow)

Partial indexes keep the two hot questions cheap however large the run: "which waiting prompts go next"
(`prompts_waiting`, longest expected work first, then input order) and "which prompts are in Redis"
(`prompts_fed`). A store whose meta says `feed_order = input` (`order_feed_by_input`: the one store of
`batchfleet serve`, where each batch is one input) feeds an older input's prompts before a newer one's,
longest first within each (`prompts_waiting_input`, in place of `prompts_waiting`), and counts a span
(a batch) from indexes (`counts_in`; `results_failed`).

A `Span` is the prompts one transaction enqueued, by seq (a `batchfleet serve` batch): counts, the
export and cancel can be asked for one span rather than the whole run.

Writers (enqueue, feed, collect, recover) hold SQLite's single writer lock for a whole transaction
(`Store.write()`, BEGIN IMMEDIATE): "is there a result for this prompt?" is serialised against
"result stored, job removed from Redis", so a prompt with a result is never fed again. WAL lets
`status` and `export` read (read-only connections) while the head writes.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from batchfleet.records import ENDPOINTS, Result
from batchfleet.redact import private_dir

__all__ = ["UNBOUNDED_COST", "FileFingerprint", "Input", "Known", "MissingStore", "Span", "State", "Store",
           "StoreError", "canonical", "canonical_request", "fingerprint"]

SCHEMA_VERSION = "3"  # 3: request fingerprints, reruns, input files' paths and fingerprints
UNBOUNDED_COST = 1 << 30  # no max_tokens: it may run to the context length, so it goes first
# Pages of a new store: 16 KiB, not SQLite's 4 KiB. An enqueue (a serve batch) writes its prompts in big
# transactions; with a quarter of the pages to link, checksum and append to the WAL, storing 50,000
# requests of ~260 B takes ~25% less time (a store made before keeps its pages).
PAGE_SIZE = 16384
_CHUNK = 900  # host parameters per IN (...) query; well under SQLite's limit
FEED_ORDER = "feed_order"  # meta key: "input" feeds older inputs first (see `order_feed_by_input`)
_WAITING_BY_INPUT = "CREATE INDEX IF NOT EXISTS prompts_waiting_input ON prompts(file, cost DESC, seq) WHERE state = 0"
_FAILED_RESULTS = "CREATE INDEX IF NOT EXISTS results_failed ON results(seq) WHERE ok = 0"  # `counts_in` reads it

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
    fp BLOB
);
CREATE INDEX IF NOT EXISTS prompts_waiting ON prompts(cost DESC, seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS prompts_fed ON prompts(seq) WHERE state = 1;
CREATE TABLE IF NOT EXISTS results (
    seq INTEGER PRIMARY KEY, ok INTEGER NOT NULL, line BLOB NOT NULL, finished_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tally (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS reruns (seq INTEGER PRIMARY KEY);
INSERT OR IGNORE INTO tally (name, n) VALUES ('waiting', 0), ('fed', 0), ('done', 0), ('ok', 0), ('cancelled', 0);
"""

_INSERT = "INSERT OR IGNORE INTO prompts (cid, ep, body, file, line, cost, fp) VALUES (?, ?, ?, ?, ?, ?, ?)"

# Schema 2 -> 3: the columns and table fingerprints need. Old rows keep fp NULL (computed when needed).
_MIGRATE_2 = """
ALTER TABLE prompts ADD COLUMN fp BLOB;
ALTER TABLE files ADD COLUMN path TEXT;
ALTER TABLE files ADD COLUMN fp TEXT;
ALTER TABLE files ADD COLUMN prompts INTEGER;
ALTER TABLE files ADD COLUMN enqueued_at REAL;
CREATE TABLE IF NOT EXISTS reruns (seq INTEGER PRIMARY KEY);
"""


def canonical(body: dict[str, Any]) -> bytes:
    """A request body as canonical JSON: sorted keys (at every level), no spaces. Enqueue stores it so."""
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


_FP_SEEDS = {url: hashlib.blake2b(url.encode() + b"\n", digest_size=16) for url in ENDPOINTS}


def fingerprint(url: str, body: dict[str, Any] | bytes, *, is_canonical: bool = False) -> bytes:
    """A request's fingerprint: 16 bytes of BLAKE2b over its endpoint and its canonical body (after the
    defaults and per-file options enqueue applied). Two lines ask the same of the server exactly when
    their fingerprints agree. `body` as JSON bytes is canonicalised unless `is_canonical`."""
    if not isinstance(body, dict):
        body = bytes(body) if is_canonical else canonical(orjson.loads(body))
    else:
        body = canonical(body)
    return _fingerprint(url, body)


def _fingerprint(url: str, canon: bytes) -> bytes:
    seed = _FP_SEEDS.get(url)
    h = seed.copy() if seed is not None else hashlib.blake2b(url.encode() + b"\n", digest_size=16)
    h.update(canon)
    return h.digest()


def canonical_request(url: str, body: dict[str, Any]) -> tuple[bytes, bytes]:
    """(`canonical(body)`, `fingerprint(url, body)`) from one encoding: what enqueue and serve store
    for every line. The bytes kept are a copy of orjson's result: a batch holding thousands of
    orjson's own results costs a page fault each (~3 us), the copy a tenth of that."""
    out = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    seed = _FP_SEEDS.get(url)
    if seed is None:
        return bytes(memoryview(out)), _fingerprint(url, out)
    h = seed.copy()
    h.update(out)
    return bytes(memoryview(out)), h.digest()


class FileFingerprint:
    """The fingerprint of an input file's requests: BLAKE2b over (custom_id, request fingerprint) of
    each prompt the file holds, in file order (rejected and duplicate lines left out). Formatting,
    blank lines and key order do not change it; any request's change does."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self.prompts = 0

    def add(self, cid: str, fp: bytes) -> None:
        self.add_many(((cid, fp),))

    def add_many(self, prompts: Iterable[tuple[str, bytes]]) -> None:
        """`add` each (custom_id, fingerprint), in one update of the hash."""
        parts: list[bytes] = []
        for cid, fp in prompts:
            raw = cid.encode("utf-8", "surrogatepass")
            parts += (len(raw).to_bytes(4, "big"), raw, fp)  # length-prefixed: any custom_id, no ambiguity
        self._h.update(b"".join(parts))
        self.prompts += len(parts) // 3

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class Known(NamedTuple):
    """A prompt the store holds, as enqueue compares a line with it."""

    seq: int
    file: int
    line: int
    state: int
    fp: bytes  # its request's fingerprint (computed from ep and body where the row has none)


class Span(NamedTuple):
    """The prompts with lo <= seq <= hi: what one transaction enqueued (a `batchfleet serve` batch)."""

    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo + 1


def _within(span: Span | None, column: str = "seq") -> tuple[str, tuple[int, ...]]:
    """The SQL condition (with its leading AND) and parameters that keep a query to `span`."""
    return ("", ()) if span is None else (f" AND {column} BETWEEN ? AND ?", (span.lo, span.hi))


class Input(NamedTuple):
    """An input file an enqueue completed: where it was and what its requests were."""

    name: str  # as given on the command line (FILE:LINE messages use it)
    path: str  # absolute
    fp: str  # FileFingerprint, hex
    prompts: int
    enqueued_at: float


def _wins(ok: int, finished_at: float, old_ok: int, old_finished_at: float) -> bool:
    return ok > old_ok or (ok == old_ok and finished_at >= old_finished_at)


class State(IntEnum):
    """Where a prompt is (the `prompts.state` column)."""

    WAITING = 0  # only in the store: the head feeds it when its queue has room
    FED = 1  # an RQ job in Redis (queued, in flight, or finished and not yet collected)
    DONE = 2  # its final result is in `results`
    CANCELLED = 3  # `producer cancel` took it back before it had a result: `results` holds a `cancelled` line

    @property
    def tally(self) -> str:
        return self.name.lower()


class StoreError(Exception):
    """The store is missing, belongs to another run, or was made by an older batchfleet: exit 2."""


class MissingStore(StoreError):
    """There is no store file at the path."""


class Store:
    """One connection to a run's store. Build with `create_or_open` (enqueue) or `open`."""

    def __init__(self, db: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
        self.db = db
        self.path = path
        self.readonly = readonly
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") == "2" and not readonly:
            meta["schema"] = self._migrate_2()
        if meta.get("schema") not in (SCHEMA_VERSION, "2"):  # 2 is read as it is where it cannot be migrated
            db.close()
            raise StoreError(f"{path} was made by another version of batchfleet (store layout "
                             f"{meta.get('schema', '1')}, this one reads {SCHEMA_VERSION})")
        self.schema: str = meta["schema"]
        self.id: str = meta["store_id"]
        self.run: str = meta["run"]
        self.created: float = float(meta["created"])

    def _migrate_2(self) -> str:
        """Schema 2 -> 3 in one transaction (another process may have done it meanwhile): the
        fingerprint columns, and the export lines of HTTP errors in OpenAI's shape."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if self.db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0] == "2":
                for statement in _MIGRATE_2.split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                fixed = []
                for seq, raw in self.db.execute("SELECT seq, line FROM results WHERE ok = 0").fetchall():
                    line = orjson.loads(raw)
                    resp, err = line.get("response"), line.get("error")
                    if isinstance(resp, dict) and isinstance(err, dict) and isinstance(resp.get("status_code"), int):
                        # the one definition of an export line; the server's body was not kept then
                        res = Result(cid=line["custom_id"], jid=str(resp.get("request_id")), seq=seq,
                                     status_code=resp["status_code"], body=resp.get("body"), error=err)
                        fixed.append((orjson.dumps(res.batch_output_line()), seq))
                self.db.executemany("UPDATE results SET line = ? WHERE seq = ?", fixed)
                self.db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (SCHEMA_VERSION,))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return SCHEMA_VERSION

    # --- opening ------------------------------------------------------------------------------------
    @classmethod
    def create_or_open(cls, path: Path, *, run: str) -> Store:
        """Open the store at `path`, creating it (mode 0600, its directory 0700) when missing."""
        path = path.absolute()
        if not path.exists():
            cls._create(path, run)
        store = cls(cls._connect(path, readonly=False), path, readonly=False)
        store._check_run(run)
        return store

    @classmethod
    def _create(cls, path: Path, run: str) -> None:
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
            db = cls._connect(tmp, readonly=False)
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

    @classmethod
    def open(cls, path: Path, *, run: str, readonly: bool = False) -> Store:
        """Open an existing store; never creates a file or a directory."""
        path = path.absolute()
        if not path.is_file():
            raise MissingStore(f"no store at {path}")
        try:
            db = cls._connect(path, readonly=readonly)
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.Error as exc:
            raise StoreError(f"{path} is not a batchfleet store ({exc})") from None
        if not tables:  # an empty file (an older batchfleet made the store in place): not there yet
            db.close()
            raise MissingStore(f"the store at {path} is still being created (producer enqueue)")
        if "meta" not in tables:
            db.close()
            raise StoreError(f"{path} is not a batchfleet store of this version (no meta table)")
        store = cls(db, path, readonly=readonly)
        store._check_run(run)
        return store

    @staticmethod
    def _connect(path: Path, *, readonly: bool) -> sqlite3.Connection:
        # autocommit mode: transactions are explicit (BEGIN IMMEDIATE / BEGIN), never implicit
        if readonly:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, timeout=60.0)
        else:
            db = sqlite3.connect(path, isolation_level=None, timeout=60.0)
            db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a store being made (`_create`); no-op on one made
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL-safe
        db.execute("PRAGMA cache_size=-65536")  # 64 MiB: the unique cid index of a 10M-prompt run
        return db

    def _check_run(self, run: str) -> None:
        if self.run != run:
            self.db.close()
            raise StoreError(f"{self.path} is the store of run {self.run!r}, not {run!r}")

    def close(self) -> None:
        self.db.close()

    # --- transactions -------------------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction holding SQLite's writer lock from its first statement."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[None]:
        """One consistent snapshot for several queries (WAL: writers are not blocked)."""
        self.db.execute("BEGIN")
        try:
            yield
        finally:
            self.db.execute("COMMIT")

    def _tally(self, name: str, delta: int) -> None:
        if delta:  # an upsert: a store made before a state existed has no row for it
            self.db.execute("INSERT INTO tally (name, n) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET n = n + ?",
                            (name, delta, delta))

    def _among(self, sql: str, values: Sequence[object]) -> list[tuple]:
        rows: list[tuple] = []
        for i in range(0, len(values), _CHUNK):
            part = values[i : i + _CHUNK]
            rows += self.db.execute(sql.format(",".join("?" * len(part))), part).fetchall()
        return rows

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def checkpoint_later(self) -> None:
        """This connection's commits leave the WAL as it is: a commit that takes the WAL past 1,000 pages
        otherwise copies it into the store file and syncs that, in the committing call (~0.1 s of a
        50,000-request serve batch). The caller checkpoints when nobody waits (`checkpoint`); other
        connections' commits still checkpoint as usual."""
        self.db.execute("PRAGMA wal_autocheckpoint=0")

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the store file, as far as readers allow (never waits for them)."""
        self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    # --- enqueue (inside write()) -------------------------------------------------------------------
    def file_id(self, name: str) -> int:
        self.db.execute("INSERT OR IGNORE INTO files (name) VALUES (?)", (name,))
        return self.db.execute("SELECT id FROM files WHERE name = ?", (name,)).fetchone()[0]

    def file_name(self, file_id: int) -> str:
        row = self.db.execute("SELECT name FROM files WHERE id = ?", (file_id,)).fetchone()
        return "?" if row is None else row[0]

    def max_seq(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM prompts").fetchone()[0]

    def insert_prompts(self, rows: Sequence[tuple[str, int, bytes, int, int, int, bytes]]) -> int:
        """(cid, ep, body, file, line, cost, fp), each a new WAITING prompt unless its cid is known (then
        nothing changes). Returns how many were inserted."""
        n = self.db.executemany(_INSERT, rows).rowcount
        self._tally("waiting", n)
        return n

    def known(self, cids: Sequence[str]) -> dict[str, Known]:
        """The prompts of `cids` the store holds."""
        rows = self._among("SELECT cid, seq, file, line, state, fp, CASE WHEN fp IS NULL THEN ep END, "
                           "CASE WHEN fp IS NULL THEN body END FROM prompts WHERE cid IN ({})", cids)
        return {c: Known(s, f, ln, st, fp if fp is not None else fingerprint(ENDPOINTS[ep], body))
                for c, s, f, ln, st, fp, ep, body in rows}

    def replace_requests(self, rows: Sequence[tuple[int, int, bytes, int, int, int, bytes]]) -> list[tuple[int, str]]:
        """`enqueue --rerun-changed`: (seq, ep, body, file, line, cost, fp) replace those prompts' requests.
        A prompt with a result loses it and waits again; a waiting one waits with its new request; a
        FED one stays FED: the result of its old request is refused when it comes (its fingerprint is
        not the new one) and the prompt is fed again then. Every one is listed in `reruns`. Returns
        (seq, cid) of those that had a failed result (their failed job may still be in RQ's registry)."""
        if not rows:
            return []
        seqs = [row[0] for row in rows]
        self.db.executemany("UPDATE prompts SET ep = ?, body = ?, file = ?, line = ?, cost = ?, fp = ? WHERE seq = ?",
                            [(*row[1:], row[0]) for row in rows])
        self.db.executemany("INSERT OR IGNORE INTO reruns (seq) VALUES (?)", [(s,) for s in seqs])
        had = self._among("SELECT r.seq, r.ok, p.cid, p.state FROM results r JOIN prompts p ON p.seq = r.seq "
                          "WHERE r.seq IN ({})", seqs)
        self.db.executemany("DELETE FROM results WHERE seq = ?", [(seq,) for seq, *_ in had])
        self._tally("ok", -sum(ok for _, ok, _, state in had if state == State.DONE))
        for state in (State.DONE, State.CANCELLED):
            self.set_state([seq for seq, _, _, st in had if st == state], state, State.WAITING)
        return [(seq, cid) for seq, ok, cid, _ in had if not ok]

    def record_input(self, file_id: int, path: str, fp: FileFingerprint, at: float) -> None:
        """An enqueue of this file completed: where it was and its requests' fingerprint."""
        self.db.execute("UPDATE files SET path = ?, fp = ?, prompts = ?, enqueued_at = ? WHERE id = ?",
                        (path, fp.hexdigest(), fp.prompts, at, file_id))

    def inputs(self) -> list[Input]:
        """The input files whose enqueue completed, the latest last (none in a schema-2 store read as is)."""
        if self.schema == "2":
            return []
        rows = self.db.execute("SELECT name, path, fp, prompts, enqueued_at FROM files WHERE enqueued_at IS NOT NULL "
                               "ORDER BY enqueued_at, id").fetchall()
        return [Input(*row) for row in rows]

    # --- feed (inside write()) ----------------------------------------------------------------------
    def order_feed_by_input(self) -> None:
        """From now on feed an older input's prompts before a newer one's (inside write()). What
        `batchfleet serve` asks of its store: its batches share the fleet in creation order. The
        index of the other order goes: every insert would pay for both."""
        self.db.execute(_WAITING_BY_INPUT)
        self.db.execute(_FAILED_RESULTS)
        self.db.execute("DROP INDEX IF EXISTS prompts_waiting")
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, 'input')", (FEED_ORDER,))

    def _waiting_order(self) -> str:
        """The ORDER BY of waiting prompts, as this store feeds them (each order has its index)."""
        return "file, cost DESC, seq" if self.get_meta(FEED_ORDER) == "input" else "cost DESC, seq"

    def next_to_feed(self, limit: int) -> list[tuple[int, str, str, bytes, str]]:
        """(seq, cid, url, body, fp) of up to `limit` WAITING prompts: longest expected work first (in a
        store ordered by input: the oldest input's first, longest first within it). `fp` is the
        fingerprint in hex ("" for a row made before fingerprints)."""
        rows = self.db.execute(
            f"SELECT seq, cid, ep, body, fp FROM prompts WHERE state = 0 ORDER BY {self._waiting_order()} LIMIT ?",
            (limit,))
        return [(seq, cid, ENDPOINTS[ep], body, fp.hex() if fp else "") for seq, cid, ep, body, fp in rows]

    def set_state(self, seqs: Sequence[int], old: State, new: State) -> int:
        """Move the prompts `seqs` that are in state `old` to `new`; returns how many moved."""
        n = self.db.executemany("UPDATE prompts SET state = ? WHERE seq = ? AND state = ?",
                                [(int(new), s, int(old)) for s in seqs]).rowcount
        self._tally(old.tally, -n)
        self._tally(new.tally, n)
        return n

    def fed_cids(self, span: Span | None = None) -> list[str]:
        """custom_ids of the FED prompts (of `span`), in seq order."""
        cond, args = _within(span)
        return [c for (c,) in self.db.execute(f"SELECT cid FROM prompts WHERE state = 1{cond} ORDER BY seq", args)]

    def fed(self, *, after: int = 0, limit: int = 5000) -> list[tuple[int, str]]:
        """(seq, cid) of FED prompts with seq > `after`, in seq order (page through them)."""
        return self.db.execute("SELECT seq, cid FROM prompts WHERE state = 1 AND seq > ? ORDER BY seq LIMIT ?",
                               (after, limit)).fetchall()

    # --- collect (inside write()) -------------------------------------------------------------------
    def lookup(self, cids: Sequence[str]) -> dict[str, tuple[int, int, str, bool]]:
        """cid -> (seq, state, fp, rerun) for those of `cids` that were enqueued: `fp` the fingerprint of
        its request in hex ("" in a row made before fingerprints), `rerun` whether `--rerun-changed`
        replaced its request."""
        rows = self._among("SELECT p.cid, p.seq, p.state, p.fp, r.seq IS NOT NULL FROM prompts p "
                           "LEFT JOIN reruns r ON r.seq = p.seq WHERE p.cid IN ({})", cids)
        return {c: (s, st, fp.hex() if fp else "", bool(rerun)) for c, s, st, fp, rerun in rows}

    def stale(self, seqs: Sequence[int]) -> int:
        """A late result of a replaced request was refused for these prompts: those FED wait to be fed
        again with their new request. Returns how many."""
        return self.set_state(list(seqs), State.FED, State.WAITING)

    def store_results(self, rows: Sequence[tuple[int, int, int, bytes, float]]) -> int:
        """(seq, state, ok, line, finished_at). Success wins: a failure never replaces a success;
        otherwise the later result replaces the older. Returns how many prompts got their first result."""
        best: dict[int, tuple[int, int, bytes, float]] = {}  # seq -> (state, ok, line, finished_at)
        for seq, state, ok, line, finished_at in rows:
            have = best.get(seq)
            if have is None or _wins(ok, finished_at, have[1], have[3]):
                best[seq] = (state, ok, line, finished_at)
        if not best:
            return 0
        old = {seq: (ok, at) for seq, ok, at in
               self._among("SELECT seq, ok, finished_at FROM results WHERE seq IN ({})", list(best))}
        # A cancelled prompt's `cancelled` line is no result: a real one replaces it, whenever it comes.
        gone = {seq for seq, (state, *_) in best.items() if state == State.CANCELLED and seq in old}
        new = [(seq, ok, line, at) for seq, (_, ok, line, at) in best.items() if seq not in old]
        better = [(ok, line, at, seq) for seq, (_, ok, line, at) in best.items()
                  if seq in old and (seq in gone or _wins(ok, at, *old[seq]))]
        self.db.executemany("INSERT INTO results (seq, ok, line, finished_at) VALUES (?, ?, ?, ?)", new)
        self.db.executemany("UPDATE results SET ok = ?, line = ?, finished_at = ? WHERE seq = ?", better)
        self._tally("ok", sum(ok for _, ok, _, _ in new) + sum(ok - old[seq][0] for ok, _, _, seq in better))
        for state in (State.WAITING, State.FED, State.CANCELLED):
            # any result ends a prompt's wait, also one fed again (`rq requeue` of a failed job) that had one
            self.set_state([seq for seq, (st, *_) in best.items() if st == state], state, State.DONE)
        return len(new) + len(gone)

    def add_rejected(self, n: int) -> None:
        if n:
            self.db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + ? WHERE key = 'rejected_results'", (n,))

    # --- status / export ----------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        t = dict(self.db.execute("SELECT name, n FROM tally").fetchall())
        cancelled = t.get("cancelled", 0)
        prompts = t["waiting"] + t["fed"] + t["done"] + cancelled
        return {"prompts": prompts, "succeeded": t["ok"], "failed": t["done"] - t["ok"],
                "pending": t["waiting"] + t["fed"], "waiting": t["waiting"], "fed": t["fed"], "cancelled": cancelled}

    def counts_in(self, span: Span, file_id: int) -> dict[str, int]:
        """`counts()` of the prompts of one span, all of input `file_id`, counted from the rows. In a
        store ordered by input each count reads an index of what it counts (waiting, fed, failed or
        cancelled), never the span's rows: a poll of a running batch costs what is in flight and what
        failed, not the batch's size."""
        lo, hi = span
        waiting = self.db.execute("SELECT COUNT(*) FROM prompts WHERE state = 0 AND file = ? AND seq BETWEEN ? AND ?",
                                  (file_id, lo, hi)).fetchone()[0]
        fed = self.db.execute("SELECT COUNT(*) FROM prompts WHERE state = 1 AND seq BETWEEN ? AND ?",
                              span).fetchone()[0]
        # results without success: failures (DONE), cancelled lines (CANCELLED), a failure fed again (refeed)
        other = dict(self.db.execute("SELECT p.state, COUNT(*) FROM results r JOIN prompts p ON p.seq = r.seq "
                                     "WHERE r.ok = 0 AND r.seq BETWEEN ? AND ? GROUP BY p.state", span).fetchall())
        failed, cancelled = other.get(State.DONE, 0), other.get(State.CANCELLED, 0)
        return {"prompts": span.size, "succeeded": span.size - waiting - fed - failed - cancelled, "failed": failed,
                "pending": waiting + fed, "waiting": waiting, "fed": fed, "cancelled": cancelled}

    def span_of(self, prefix: str) -> tuple[Span | None, int]:
        """The span of the prompts whose custom_id starts with `prefix` (a range of the custom_id index)
        and how many they are (None, 0: none); they are contiguous when the count is the span's size."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        lo, hi, n = self.db.execute("SELECT MIN(seq), MAX(seq), COUNT(*) FROM prompts WHERE cid >= ? AND cid < ?",
                                    (prefix, end)).fetchone()
        return (None, 0) if not n else (Span(lo, hi), n)

    def recount(self) -> dict[str, int]:
        """The tally recomputed from the rows (slow on a big store): what `counts` must equal."""
        by_state = dict(self.db.execute("SELECT state, COUNT(*) FROM prompts GROUP BY state").fetchall())
        ok = self.db.execute("SELECT COUNT(*) FROM results r JOIN prompts p ON p.seq = r.seq "
                             "WHERE r.ok = 1 AND p.state = 2").fetchone()[0]
        return {"waiting": by_state.get(0, 0), "fed": by_state.get(1, 0), "done": by_state.get(2, 0), "ok": ok,
                "cancelled": by_state.get(3, 0)}

    def fix_tally(self) -> bool:
        """Rewrite the tally from the rows (inside write()); True when it had drifted."""
        real = self.recount()
        have = dict(self.db.execute("SELECT name, n FROM tally").fetchall())
        if real == {k: have.get(k, 0) for k in real}:
            return False
        self.db.executemany("INSERT INTO tally (name, n) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET n = excluded.n",
                            list(real.items()))
        return True

    # --- ends of a run (inside write()) -------------------------------------------------------------
    def cancel(self, states: Sequence[State], line_for: Callable[[str], bytes], at: float, *,
               span: Span | None = None) -> list[tuple[int, str]]:
        """Mark every prompt in `states` CANCELLED, each with `line_for(cid)` as its export line (a
        result row with ok = 0), and record when the run was cancelled. Returns their (seq, cid). With
        `span`, only the prompts of the span, and the run is not cancelled (the head feeds the rest)."""
        if span is None and self.get_meta("cancelled_at") is None:
            self.db.execute("INSERT INTO meta (key, value) VALUES ('cancelled_at', ?)", (repr(at),))
        cond, args = _within(span)
        out: list[tuple[int, str]] = []
        for state in states:
            rows = self.db.execute(f"SELECT seq, cid FROM prompts WHERE state = ?{cond} ORDER BY seq",
                                   (int(state), *args)).fetchall()
            self.db.executemany("INSERT OR IGNORE INTO results (seq, ok, line, finished_at) VALUES (?, 0, ?, ?)",
                                [(seq, line_for(cid), at) for seq, cid in rows])
            self.set_state([seq for seq, _ in rows], state, State.CANCELLED)
            out += rows
        return out

    def cancelled_at(self) -> float | None:
        value = self.get_meta("cancelled_at")
        return None if value is None else float(value)

    def refeed(self, cids: Sequence[str]) -> int:
        """Prompts of `cids` that have a failed result go back to WAITING (`rq requeue` of a failed
        job whose `data` was trimmed: the head feeds it again from here). Returns how many."""
        rows = self._among("SELECT p.seq FROM prompts p JOIN results r ON r.seq = p.seq "
                           "WHERE p.state = 2 AND r.ok = 0 AND p.cid IN ({})", list(cids))
        return self.set_state([seq for (seq,) in rows], State.DONE, State.WAITING)

    def ever_fed(self) -> bool:
        """Has any prompt of this store ever been put into Redis?"""
        t = dict(self.db.execute("SELECT name, n FROM tally WHERE name IN ('fed', 'done')").fetchall())
        return t["fed"] + t["done"] > 0

    def in_redis(self) -> bool:
        """Has the store prompts in Redis now (FED)? Only then can Redis have lost any of them: a run
        whose prompts all have results (or were cancelled) has nothing there to lose."""
        return self.db.execute("SELECT n FROM tally WHERE name = 'fed'").fetchone()[0] > 0

    def rejected_results(self) -> int:
        return int(self.get_meta("rejected_results") or 0)

    def pending_examples(self, n: int) -> list[str]:
        """Up to `n` custom_ids without a result, those fed first (input order), then waiting ones."""
        fed = self.db.execute("SELECT cid FROM prompts WHERE state = 1 ORDER BY seq LIMIT ?", (n,)).fetchall()
        waiting = self.db.execute(f"SELECT cid FROM prompts WHERE state = 0 ORDER BY {self._waiting_order()} "
                                  "LIMIT ?", (n,)).fetchall()
        return [c for (c,) in fed + waiting][:n]

    def result_lines(self) -> Iterator[bytes]:
        """Every stored result's export line, in input order."""
        for _, line in self.result_rows():
            yield line

    def result_rows(self, span: Span | None = None) -> Iterator[tuple[bool, bytes]]:
        """(ok, export line) of every stored result (of `span`), in input order."""
        cond, args = _within(span)
        for ok, line in self.db.execute(f"SELECT ok, line FROM results WHERE 1{cond} ORDER BY seq", args):
            yield bool(ok), line
