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

The file itself (its tables, how a new one is made and an old layout migrated) is `storefile.py`'s;
the fingerprints `fingerprint.py`'s. `StoreReads` holds the read-only questions (counts, spans, the
results in export order); `Store` adds what changes the store.

Writers (enqueue, feed, collect, recover) hold SQLite's single writer lock for a whole transaction
(`Store.write()`, BEGIN IMMEDIATE): "is there a result for this prompt?" is serialised against
"result stored, job removed from Redis", so a prompt with a result is never fed again. WAL lets
`status` and `export` read (read-only connections) while the head writes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

from batchfleet.records import ENDPOINTS

from .fingerprint import FileFingerprint, canonical, canonical_request, fingerprint
from .plan import GROUP_BYTES, PlanRow, adapter_group
from .planbuild import BUILD_TABLES, Build
from .storefile import READABLE, SCHEMA_VERSION, connect, create, migrate, writing

__all__ = [
    "DEFAULT_TENANT",
    "UNBOUNDED_COST",
    "FileFingerprint",
    "Input",
    "Known",
    "MissingStore",
    "Shares",
    "Span",
    "State",
    "Store",
    "StoreError",
    "WaitingInput",
    "canonical",
    "canonical_request",
    "fingerprint",
]

DEFAULT_TENANT = "default"  # who owns an input enqueued without an owner
UNBOUNDED_COST = 1 << 30  # no max_tokens: it may run to the context length, so it goes first
_CHUNK = 900  # host parameters per IN (...) query; well under SQLite's limit
FEED_ORDER = "feed_order"  # meta key: "input" feeds older inputs first (see `order_feed_by_input`)
PLAN, PLAN_STALE, PLAN_CURSOR, PLAN_KEYLESS = "plan", "plan_stale", "plan_cursor", "plan_keyless"  # `Plan`'s meta
SETTLED_S = 2.0  # no prompt became WAITING for this long: a stale plan is rebuilt
BACKGROUND_FROM = 100_000  # waiting prompts from which the plan's sorted pass runs beside the feed (planbuild.py)
# `prompts_waiting`'s twin (storefile.py): covering for the plan's sorted pass too
_WAITING_BY_INPUT = ("CREATE INDEX IF NOT EXISTS prompts_waiting_input ON prompts(file, cost DESC, seq, pk, state) "
                     "WHERE state = 0")
_PLAN_BY_INPUT = "CREATE INDEX IF NOT EXISTS plan_file ON plan(file, pos)"  # `Plan.next(file=)`
_FAILED_RESULTS = "CREATE INDEX IF NOT EXISTS results_failed ON results(seq) WHERE ok = 0"  # `counts_in` reads it

_INSERT = "INSERT OR IGNORE INTO prompts (cid, ep, body, file, line, cost, fp, pk) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"

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


class StoreReads:
    """What the store says, read-only (inside `read()` for several at once): counts, spans, inputs, the
    results in export order. `producer status` and `export` read through a read-only connection."""

    db: sqlite3.Connection
    schema: str

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def _waiting_order(self) -> str:
        """The ORDER BY of waiting prompts, as this store feeds them (each order has its index)."""
        return "file, cost DESC, seq" if self.get_meta(FEED_ORDER) == "input" else "cost DESC, seq"

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

    def pending_examples(self, n: int) -> list[str]:
        """Up to `n` custom_ids without a result, those fed first (input order), then waiting ones."""
        fed = self.db.execute("SELECT cid FROM prompts WHERE state = 1 ORDER BY seq LIMIT ?", (n,)).fetchall()
        waiting = self.db.execute(f"SELECT cid FROM prompts WHERE state = 0 ORDER BY {self._waiting_order()} "
                                  "LIMIT ?", (n,)).fetchall()
        return [c for (c,) in fed + waiting][:n]

    def result_rows(self, span: Span | None = None) -> Iterator[tuple[bool, bytes]]:
        """(ok, export line) of every stored result (of `span`), in input order."""
        cond, args = _within(span)
        for ok, line in self.db.execute(f"SELECT ok, line FROM results WHERE 1{cond} ORDER BY seq", args):
            yield bool(ok), line

    def inputs(self) -> list[Input]:
        """The input files whose enqueue completed, the latest last (none in a schema-2 store read as is)."""
        if self.schema == "2":
            return []
        rows = self.db.execute("SELECT name, path, fp, prompts, enqueued_at FROM files WHERE enqueued_at IS NOT NULL "
                               "ORDER BY enqueued_at, id").fetchall()
        return [Input(*row) for row in rows]

    def rejected_results(self) -> int:
        return int(self.get_meta("rejected_results") or 0)

    def in_redis(self) -> bool:
        """Has the store prompts in Redis now (FED)? Only then can Redis have lost any of them: a run
        whose prompts all have results (or were cancelled) has nothing there to lose."""
        return self.db.execute("SELECT n FROM tally WHERE name = 'fed'").fetchone()[0] > 0

    def cancelled_at(self) -> float | None:
        value = self.get_meta("cancelled_at")
        return None if value is None else float(value)

    def counts(self) -> dict[str, int]:
        t = dict(self.db.execute("SELECT name, n FROM tally").fetchall())
        cancelled = t.get("cancelled", 0)
        prompts = t["waiting"] + t["fed"] + t["done"] + cancelled
        return {"prompts": prompts, "succeeded": t["ok"], "failed": t["done"] - t["ok"],
                "pending": t["waiting"] + t["fed"], "waiting": t["waiting"], "fed": t["fed"], "cancelled": cancelled}

    def fed_cids(self, span: Span | None = None) -> list[str]:
        """custom_ids of the FED prompts (of `span`), in seq order."""
        cond, args = _within(span)
        return [c for (c,) in self.db.execute(f"SELECT cid FROM prompts WHERE state = 1{cond} ORDER BY seq", args)]

    def fed(self, *, after: int = 0, limit: int = 5000) -> list[tuple[int, str]]:
        """(seq, cid) of FED prompts with seq > `after`, in seq order (page through them)."""
        return self.db.execute("SELECT seq, cid FROM prompts WHERE state = 1 AND seq > ? ORDER BY seq LIMIT ?",
                               (after, limit)).fetchall()


class Store(StoreReads):
    """One connection to a run's store. Build with `create_or_open` (enqueue) or `open`."""

    def __init__(self, db: sqlite3.Connection, path: Path, *, readonly: bool) -> None:
        self.db = db
        self.path = path
        self.readonly = readonly
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") in READABLE and meta["schema"] != SCHEMA_VERSION and not readonly:
            meta["schema"] = migrate(db, meta["schema"])
        if meta.get("schema") not in READABLE:  # an older layout is read as it is where it cannot be migrated
            db.close()
            raise StoreError(f"{path} was made by another version of batchfleet (store layout "
                             f"{meta.get('schema', '1')}, this one reads {SCHEMA_VERSION})")
        self.schema: str = meta["schema"]
        self.plan = Plan(self)
        self.shares = Shares(self)
        self.id: str = meta["store_id"]
        self.run: str = meta["run"]
        self.created: float = float(meta["created"])

    # --- opening ------------------------------------------------------------------------------------
    @classmethod
    def create_or_open(cls, path: Path, *, run: str) -> Store:
        """Open the store at `path`, creating it (mode 0600, its directory 0700) when missing."""
        path = path.absolute()
        if not path.exists():
            create(path, run)
        store = cls(connect(path, readonly=False), path, readonly=False)
        store._check_run(run)
        return store

    @classmethod
    def open(cls, path: Path, *, run: str, readonly: bool = False) -> Store:
        """Open an existing store; never creates a file or a directory."""
        path = path.absolute()
        if not path.is_file():
            raise MissingStore(f"no store at {path}")
        try:
            db = connect(path, readonly=readonly)
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

    def _check_run(self, run: str) -> None:
        if self.run != run:
            self.db.close()
            raise StoreError(f"{self.path} is the store of run {self.run!r}, not {run!r}")

    def close(self) -> None:
        self.plan.cancel(wait=True)
        self.db.close()

    # --- transactions -------------------------------------------------------------------------------
    def write(self) -> AbstractContextManager[sqlite3.Connection]:
        """One write transaction holding SQLite's writer lock from its first statement."""
        return writing(self.db)

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
            if name == "waiting" and delta > 0:  # prompts the plan does not order yet
                self.plan.stale()

    def _among(self, sql: str, values: Sequence[object]) -> list[tuple]:
        rows: list[tuple] = []
        for i in range(0, len(values), _CHUNK):
            part = values[i : i + _CHUNK]
            rows += self.db.execute(sql.format(",".join("?" * len(part))), part).fetchall()
        return rows

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

    def max_seq(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM prompts").fetchone()[0]

    def endpoints(self) -> set[int]:
        """The endpoints (indices into ENDPOINTS) of the store's prompts: a run holds one kind."""
        return {ep for (ep,) in self.db.execute("SELECT DISTINCT ep FROM prompts")}

    def unfinished_of(self, eps: Sequence[int]) -> list[tuple[int, Span]]:
        """(endpoint, the span of seqs) of each input's prompts without a result asking one of `eps`."""
        marks = ",".join("?" * len(eps))
        rows = self.db.execute(f"SELECT ep, MIN(seq), MAX(seq) FROM prompts WHERE state IN (0, 1) AND ep IN ({marks}) "
                               "GROUP BY file, ep", tuple(eps)).fetchall()
        return [(ep, Span(lo, hi)) for ep, lo, hi in rows]

    def forget_waiting(self, after_seq: int, file: int) -> int:
        """Take back the prompts of `file` above `after_seq` that still wait (an enqueue refused midway
        takes back what it stored); returns how many."""
        n = self.db.execute("DELETE FROM prompts WHERE seq > ? AND file = ? AND state = 0", (after_seq, file)).rowcount
        self._tally("waiting", -n)
        return n

    def insert_prompts(self, rows: Sequence[tuple[str, int, bytes, int, int, int, bytes, bytes | None]]) -> int:
        """(cid, ep, body, file, line, cost, fp, pk), each a new WAITING prompt unless its cid is known
        (then nothing changes); `pk` its plan key (`plan.prefix_key`). Returns how many were inserted."""
        n = self.db.executemany(_INSERT, rows).rowcount
        self._tally("waiting", n)
        return n

    def known(self, cids: Sequence[str]) -> dict[str, Known]:
        """The prompts of `cids` the store holds."""
        rows = self._among("SELECT cid, seq, file, line, state, fp, CASE WHEN fp IS NULL THEN ep END, "
                           "CASE WHEN fp IS NULL THEN body END FROM prompts WHERE cid IN ({})", cids)
        return {c: Known(s, f, ln, st, fp if fp is not None else fingerprint(ENDPOINTS[ep], body))
                for c, s, f, ln, st, fp, ep, body in rows}

    def replace_requests(self, rows: Sequence[tuple[int, int, bytes, int, int, int, bytes, bytes | None]]
                         ) -> list[tuple[int, str]]:
        """`enqueue --rerun-changed`: (seq, ep, body, file, line, cost, fp, pk) replace those prompts' requests.
        A prompt with a result loses it and waits again; a waiting one waits with its new request; a
        FED one stays FED: the result of its old request is refused when it comes (its fingerprint is
        not the new one) and the prompt is fed again then. Every one is listed in `reruns`. Returns
        (seq, cid) of those that had a failed result (their failed job may still be in RQ's registry)."""
        if not rows:
            return []
        seqs = [row[0] for row in rows]
        self.db.executemany("UPDATE prompts SET ep = ?, body = ?, file = ?, line = ?, cost = ?, fp = ?, pk = ? "
                            "WHERE seq = ?", [(*row[1:], row[0]) for row in rows])
        self.plan.stale()  # waiting ones keep their place in the plan under a new key
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

    # --- feed (inside write()) ----------------------------------------------------------------------
    def order_feed_by_input(self) -> None:
        """From now on feed an older input's prompts before a newer one's (inside write()). What
        `batchfleet serve` asks of its store: its batches share the fleet in creation order. The
        index of the other order goes: every insert would pay for both."""
        self.db.execute(_WAITING_BY_INPUT)
        if self.db.execute("SELECT 1 FROM pragma_index_list('plan')").fetchone() is None:  # a pass's own, or none
            self.db.execute(_PLAN_BY_INPUT)
        self.db.execute(_FAILED_RESULTS)
        self.db.execute("DROP INDEX IF EXISTS prompts_waiting")
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, 'input')", (FEED_ORDER,))
        if self.plan.on:
            self.plan.rebuild()

    def next_to_feed(self, limit: int, *, file: int | None = None) -> list[PlanRow]:
        """Up to `limit` WAITING prompts (of input `file` only, when given) in the order this store feeds
        them: the plan's (producer/plan.py), else longest expected work first (in a store ordered by
        input: the oldest input's first, longest first within it)."""
        if self.plan.on:
            planned = self.plan.next(limit, file=file)
            if planned:  # empty: none left in the plan (a newer one may be on its way): by expected work
                return planned
        if file is not None:
            rows = self.db.execute("SELECT seq, cid, ep, body, fp, cost FROM prompts WHERE state = 0 AND file = ? "
                                   "ORDER BY cost DESC, seq LIMIT ?", (file, limit))
        else:
            rows = self.db.execute(f"SELECT seq, cid, ep, body, fp, cost FROM prompts WHERE state = 0 "
                                   f"ORDER BY {self._waiting_order()} LIMIT ?", (limit,))
        return [PlanRow(seq, cid, ENDPOINTS[ep], body, fp.hex() if fp else "", 0, cost)
                for seq, cid, ep, body, fp, cost in rows]

    def fed_rows(self, rows: Sequence[PlanRow], *, file: int | None = None) -> int:
        """These prompts (a prefix of what `next_to_feed` gave, in its order) are in Redis now: FED, and
        the plan goes on after them. Returns how many moved."""
        if rows and self.plan.on and rows[-1].pos:
            self.plan.advance(rows[-1].pos, file=file)
        return self.set_state([row.seq for row in rows], State.WAITING, State.FED)

    def set_state(self, seqs: Sequence[int], old: State, new: State) -> int:
        """Move the prompts `seqs` that are in state `old` to `new`; returns how many moved."""
        n = self.db.executemany("UPDATE prompts SET state = ? WHERE seq = ? AND state = ?",
                                [(int(new), s, int(old)) for s in seqs]).rowcount
        self._tally(old.tally, -n)
        self._tally(new.tally, n)
        return n

    # --- collect (inside write()) -------------------------------------------------------------------
    def lookup(self, cids: Sequence[str]) -> dict[str, tuple[int, int, str, bool, int]]:
        """cid -> (seq, state, fp, rerun, file) for those of `cids` that were enqueued: `fp` the
        fingerprint of its request in hex ("" in a row made before fingerprints), `rerun` whether
        `--rerun-changed` replaced its request, `file` its input."""
        rows = self._among("SELECT p.cid, p.seq, p.state, p.fp, r.seq IS NOT NULL, p.file FROM prompts p "
                           "LEFT JOIN reruns r ON r.seq = p.seq WHERE p.cid IN ({})", cids)
        return {c: (s, st, fp.hex() if fp else "", bool(rerun), f) for c, s, st, fp, rerun, f in rows}

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

    # --- repair (inside write()) ------------------------------------------------------------------
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

    def refeed(self, cids: Sequence[str]) -> int:
        """Prompts of `cids` that have a failed result go back to WAITING (`rq requeue` of a failed
        job whose `data` was trimmed: the head feeds it again from here). Returns how many."""
        rows = self._among("SELECT p.seq FROM prompts p JOIN results r ON r.seq = p.seq "
                           "WHERE p.state = 2 AND r.ok = 0 AND p.cid IN ({})", list(cids))
        return self.set_state([seq for (seq,) in rows], State.DONE, State.WAITING)



class Plan:
    """The store's feed order (producer/plan.py): the `plan` table holds the waiting prompts' seqs in
    the order they are fed (its `pos`), built in one sorted pass by SQLite whenever prompts became
    WAITING since (`stale`: an enqueue, a rerun, a refeed), and read on from a cursor (`advance`). The
    pass runs inside the feed's transaction for fewer than BACKGROUND_FROM waiting prompts (`rebuild`),
    else beside the feed (`planbuild.Build`), which meanwhile goes on from the plan it has, or by
    expected work. `batchfleet run --no-plan` (meta `plan` = off) feeds by expected work alone."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db
        self._build: Build | None = None  # a sorted pass beside the feed, not installed yet
        # passes beside the feed are started here (a process that feeds once, `producer enqueue`, says
        # no: a large store then feeds by expected work, and the head plans it)
        self.beside = True

    @property
    def on(self) -> bool:
        return self.store.schema == SCHEMA_VERSION and self.store.get_meta(PLAN) != "off"

    @property
    def building(self) -> Build | None:
        """The sorted pass running beside the feed, until it is installed."""
        return self._build

    def turn(self, on: bool) -> None:
        """Feed by the plan or not, from now on (inside write())."""
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (PLAN, "on" if on else "off"))
        if on:
            self.rebuild()

    def stale(self) -> None:
        """Prompts became WAITING that the plan does not order (now). The mark only grows: a build
        compares it with what its snapshot read (`_install`)."""
        if self.store.schema == SCHEMA_VERSION:
            now = max(time.time(), float(self.store.get_meta(PLAN_STALE) or 0) + 1e-6)
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (PLAN_STALE, repr(now)))

    def _select(self) -> tuple[str, str, bool]:
        """The plan's order as (the SELECT of the waiting prompts' (seq, file) in it, the query finding a
        waiting prompt with a key, by input?): by LoRA adapter (the base model's first), longest
        expected work first (a family of prompts with one key at its longest's place), then by plan key
        (prompts that share a prefix side by side), then input order; a store ordered by input keeps its
        inputs in order first (each input's prompts side by side: read on per input, `next(file=)`)."""
        by_input = self.store.get_meta(FEED_ORDER) == "input"
        # a LoRA adapter's prompts together (producer/plan.py: its group starts a key of odd length)
        group = f"CASE WHEN length(pk) % 2 THEN substr(pk, 1, {GROUP_BYTES}) END"
        # longest expected work first per family (prompts of one key: a document's questions), so a
        # family asking for several lengths is not cut into bands; a prompt without a key is its own
        family = "CASE WHEN length(pk) > 0 THEN MAX(cost) OVER (PARTITION BY pk) ELSE cost END"
        order = f"{'file, ' if by_input else ''}{group}, {family} DESC, pk, seq"
        return (f"SELECT seq, file FROM prompts WHERE state = 0 ORDER BY {order}",
                "SELECT 1 FROM prompts WHERE state = 0 AND length(pk) > 0 LIMIT 1", by_input)

    def rebuild(self) -> int:
        """Order the waiting prompts anew, now, in one sorted pass (inside write(); `_select`). When no
        waiting prompt has a key (all shorter than the first anchor) there is nothing to group: the plan
        is the feed's own order and no sorted pass is made. Returns how many are planned."""
        self.cancel(wait=False)  # a pass beside the feed would install an older order
        self.db.execute("DELETE FROM plan")
        self.db.execute("DELETE FROM plan_cursors")
        select, keyed_sql, _ = self._select()
        keyed = self.db.execute(keyed_sql).fetchone()
        n = 0
        if keyed is not None:
            n = self.db.execute(f"INSERT INTO plan (seq, file) {select}").rowcount
        self.db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                            [(PLAN_CURSOR, "0"), (PLAN_STALE, "0"), (PLAN_KEYLESS, "0" if keyed else "1")])
        return n

    def cancel(self, *, wait: bool) -> None:
        """Stop a sorted pass running beside the feed (`Store.close`: `wait` for its thread)."""
        build, self._build = self._build, None
        if build is not None:
            build.cancel(wait=wait)
            if build.done.is_set() and not self.store.readonly:  # it finished: its table is left
                self.db.execute(f"DROP TABLE IF EXISTS {build.table}")

    def next(self, limit: int, *, file: int | None = None) -> list[PlanRow] | None:
        """Up to `limit` WAITING prompts after the cursor (of input `file`, or of the whole plan), in plan
        order; None when the plan is the feed's own order (no waiting prompt has a key). A stale plan
        is ordered again once no prompt became WAITING for SETTLED_S, or when it has nothing left: a
        run of 10M prompts is fed while an enqueue still stores it, by a plan of what was there (built
        again when that runs dry, not at every feed pass over all that waits), and planned whole once
        the enqueue is done. A pass beside the feed is installed here when it has finished; until then
        this reads on in the plan there is (nothing left: the store feeds by expected work)."""
        since = float(self.store.get_meta(PLAN_STALE) or 0)  # when prompts last became WAITING unplanned
        stale = since > 0
        if self._build is not None and self._build.done.is_set():
            stale = self._install()
        if stale and self._build is None and time.time() - since > SETTLED_S:
            stale = self._order_again()
        if not stale and self.store.get_meta(PLAN_KEYLESS) == "1":
            return None
        rows = self._after(self._cursor(file), limit, file)
        if not rows and stale and self._build is None:
            stale = self._order_again()
            if not stale and self.store.get_meta(PLAN_KEYLESS) == "1":
                return None
            rows = self._after(self._cursor(file), limit, file)
        return rows

    def _order_again(self) -> bool:
        """Rebuild now (few waiting) or start a pass beside the feed (many). Returns: still stale?"""
        if self.store.counts()["waiting"] < BACKGROUND_FROM:
            self.rebuild()
            return False
        if not self.beside:
            return True
        select, keyed, by_input = self._select()
        self._build = Build(self.store.path, select=select, keyed=keyed, by_input=by_input, stale_key=PLAN_STALE)
        return True

    def _install(self) -> bool:
        """A finished pass becomes the plan (inside write()). Returns: still stale? (prompts became
        WAITING after its snapshot). One that failed, or that a newer order overtook, is dropped and the
        plan rebuilt here as before."""
        build, self._build = self._build, None
        assert build is not None
        now = self.store.get_meta(PLAN_STALE) or "0"
        by_input = self.store.get_meta(FEED_ORDER) == "input"
        for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name GLOB ? "
                                       "AND name != ?", (f"{BUILD_TABLES}*", build.table)).fetchall():
            self.db.execute(f"DROP TABLE {name}")  # a pass a killed head left
        made = self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                               (build.table,)).fetchone() is not None
        if build.error is not None or not made or build.by_input != by_input or (now == "0" != build.seen_stale):
            if made:
                self.db.execute(f"DROP TABLE {build.table}")
            if now == "0":  # a rebuild came after its snapshot: the plan is newer than the pass
                return False
            self.rebuild()
            return False
        self.db.execute("DROP TABLE plan")
        self.db.execute(f"ALTER TABLE {build.table} RENAME TO plan")
        self.db.execute("DELETE FROM plan_cursors")
        still = now != build.seen_stale
        self.db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                            [(PLAN_CURSOR, "0"), (PLAN_STALE, now if still else "0"),
                             (PLAN_KEYLESS, "1" if build.keyless else "0")])
        return still

    def _cursor(self, file: int | None) -> int:
        if file is None:
            return int(self.store.get_meta(PLAN_CURSOR) or 0)
        row = self.db.execute("SELECT pos FROM plan_cursors WHERE file = ?", (file,)).fetchone()
        return 0 if row is None else row[0]

    def _after(self, cursor: int, limit: int, file: int | None) -> list[PlanRow]:
        where = "plan.pos > ?" if file is None else "plan.file = ? AND plan.pos > ?"
        args = (cursor, limit) if file is None else (file, cursor, limit)
        rows = self.db.execute(
            "SELECT p.seq, p.cid, p.ep, p.body, p.fp, plan.pos, p.cost, p.pk FROM plan "
            f"JOIN prompts p ON p.seq = plan.seq WHERE {where} AND p.state = 0 ORDER BY plan.pos LIMIT ?", args)
        return [PlanRow(seq, cid, ENDPOINTS[ep], body, fp.hex() if fp else "", pos, cost, adapter_group(pk))
                for seq, cid, ep, body, fp, pos, cost, pk in rows]

    def advance(self, pos: int, *, file: int | None = None) -> None:
        """The prompts up to `pos` (of input `file`) are fed: the next read starts after it."""
        if file is None:
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (PLAN_CURSOR, str(pos)))
        else:
            self.db.execute("INSERT OR REPLACE INTO plan_cursors (file, pos) VALUES (?, ?)", (file, pos))


class WaitingInput(NamedTuple):
    """An input with prompts waiting in the store, as the feed shares the fleet between owners."""

    file: int
    tenant: str
    priority: int  # 0 high, 1 normal, 2 low


class Shares:
    """Who owns each input and at what priority (`owners`), and each owner's weight (`tenants`): what
    `batchfleet serve` records for its tenants' batches, and the head reads to share the fleet."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.db = store.db

    def own(self, file: int, tenant: str, priority: int) -> None:
        """Input `file` is `tenant`'s, at `priority` (inside write())."""
        self.db.execute("INSERT OR REPLACE INTO owners (file, tenant, priority) VALUES (?, ?, ?)",
                        (file, tenant, priority))

    def set_weights(self, weights: dict[str, float]) -> None:
        """The tenants' weights, all of them (inside write()); one not named weighs 1."""
        self.db.execute("DELETE FROM tenants")
        self.db.executemany("INSERT INTO tenants (name, weight) VALUES (?, ?)", list(weights.items()))

    def weights(self) -> dict[str, float]:
        return dict(self.db.execute("SELECT name, weight FROM tenants").fetchall())

    def any(self) -> bool:
        """Does any input have an owner (a store `batchfleet serve` writes)?"""
        if self.store.schema != SCHEMA_VERSION:
            return False
        return self.db.execute("SELECT 1 FROM owners LIMIT 1").fetchone() is not None

    def waiting(self) -> list[WaitingInput]:
        """The inputs with prompts waiting in the store, the oldest first; one without an owner is
        DEFAULT_TENANT's, at normal priority."""
        if self.store.schema != SCHEMA_VERSION:
            return []
        rows = self.db.execute(
            "SELECT f.id, COALESCE(o.tenant, ?), COALESCE(o.priority, 1) FROM files f LEFT JOIN owners o "
            "ON o.file = f.id WHERE EXISTS (SELECT 1 FROM prompts p WHERE p.state = 0 AND p.file = f.id) "
            "ORDER BY f.id", (DEFAULT_TENANT,))
        return [WaitingInput(*row) for row in rows]

    def in_redis(self) -> dict[str, int]:
        """Tenant -> its prompts FED (in Redis, no result yet): what a head that starts finds."""
        rows = self.db.execute("SELECT COALESCE(o.tenant, ?), COUNT(*) FROM prompts p LEFT JOIN owners o "
                               "ON o.file = p.file WHERE p.state = 1 GROUP BY 1", (DEFAULT_TENANT,))
        return dict(rows.fetchall())

    def owner(self, file: int) -> tuple[str, int]:
        """(tenant, priority) of input `file`."""
        row = self.db.execute("SELECT tenant, priority FROM owners WHERE file = ?", (file,)).fetchone()
        return (DEFAULT_TENANT, 1) if row is None else (row[0], row[1])
