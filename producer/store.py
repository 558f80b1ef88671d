"""The results store: one SQLite file per run on the producer host (`Config.results_db`).

    prompts(cid PRIMARY KEY, seq, jid, src)              every prompt ever enqueued in this run
    results(cid PRIMARY KEY, jid, ok, line, finished_at) its final result, as the export line

Enqueue and collect both write inside `BEGIN IMMEDIATE` (`Store.write()`): SQLite's single writer
lock serialises "is there a result for this cid?" (enqueue) against "result stored, job id removed
from Redis" (collect), so a prompt whose result was just collected is never enqueued again.
WAL lets `status` and `export` read while a collector writes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["Store"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (
    cid TEXT PRIMARY KEY, seq INTEGER NOT NULL, jid TEXT NOT NULL, src TEXT NOT NULL DEFAULT ''
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS prompts_seq ON prompts(seq);
CREATE TABLE IF NOT EXISTS results (
    cid TEXT PRIMARY KEY, jid TEXT NOT NULL, ok INTEGER NOT NULL, line BLOB NOT NULL,
    finished_at REAL NOT NULL
) WITHOUT ROWID;
"""

# Success wins: a failure never replaces a success; otherwise the later result replaces the older.
_UPSERT = """
INSERT INTO results (cid, jid, ok, line, finished_at) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (cid) DO UPDATE SET jid = excluded.jid, ok = excluded.ok, line = excluded.line,
    finished_at = excluded.finished_at
WHERE excluded.ok > results.ok OR (excluded.ok = results.ok AND excluded.finished_at >= results.finished_at)
"""

_CHUNK = 900  # host parameters per IN (...) query; well under SQLite's limit


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # autocommit mode: transactions are explicit (BEGIN IMMEDIATE), never implicit
        self.db = sqlite3.connect(path, isolation_level=None, timeout=60.0)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes; WAL-safe
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

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

    # --- enqueue -------------------------------------------------------------------------------
    def _among(self, sql: str, cids: Sequence[str]) -> list[tuple]:
        rows: list[tuple] = []
        for i in range(0, len(cids), _CHUNK):
            part = cids[i : i + _CHUNK]
            rows += self.db.execute(sql.format(",".join("?" * len(part))), part).fetchall()
        return rows

    def with_results(self, cids: Sequence[str]) -> set[str]:
        return {c for (c,) in self._among("SELECT cid FROM results WHERE cid IN ({})", cids)}

    def seqs(self, cids: Sequence[str]) -> dict[str, int]:
        return dict(self._among("SELECT cid, seq FROM prompts WHERE cid IN ({})", cids))

    def max_seq(self) -> int:
        return self.db.execute("SELECT COALESCE(MAX(seq), -1) FROM prompts").fetchone()[0]

    def add_prompts(self, rows: Iterable[tuple[str, int, str, str]]) -> None:
        """(cid, seq, jid, src); an existing cid keeps its row (and its seq)."""
        self.db.executemany("INSERT OR IGNORE INTO prompts (cid, seq, jid, src) VALUES (?, ?, ?, ?)", rows)

    # --- collect -------------------------------------------------------------------------------
    def upsert_results(self, rows: Iterable[tuple[str, str, int, bytes, float]]) -> None:
        """(cid, jid, ok, line, finished_at), applied in order, success winning."""
        self.db.executemany(_UPSERT, rows)

    # --- status / export -----------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        prompts = self.db.execute("SELECT COUNT(*) FROM prompts").fetchone()[0]
        ok, failed = self.db.execute(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results r "
            "WHERE EXISTS (SELECT 1 FROM prompts p WHERE p.cid = r.cid)"
        ).fetchone()
        return {"prompts": prompts, "succeeded": ok, "failed": failed, "pending": prompts - ok - failed}

    def pending(self, limit: int) -> list[str]:
        """The first `limit` custom_ids (input order) without a result."""
        rows = self.db.execute(
            "SELECT cid FROM prompts p WHERE NOT EXISTS (SELECT 1 FROM results r WHERE r.cid = p.cid) "
            "ORDER BY seq LIMIT ?",
            (limit,),
        )
        return [c for (c,) in rows]

    def result_lines(self) -> Iterator[bytes]:
        """Every stored result's export line, in input order."""
        for (line,) in self.db.execute(
            "SELECT r.line FROM prompts p JOIN results r ON r.cid = p.cid ORDER BY p.seq, p.cid"
        ):
            yield line
