"""`producer enqueue`: validate a JSONL file into the run's store, then feed one window to Redis.

The file is streamed line by line (never loaded whole) and written to the store in big transactions
(executemany): prompt text, url, source line, an expected cost (its max_tokens), the request's
fingerprint (`store.fingerprint`: endpoint and canonical body) and the state WAITING. Idempotent by
custom_id: a custom_id the store already knows with the same request is left as it is, so re-enqueueing
a file adds nothing and a prompt with a result is never run again.

A known custom_id whose line now asks another request (an edited file, or another file of the same
name) is never answered with the stored result. By default the whole file is refused (`ChangedRequests`,
exit 2) and nothing of it is stored: new prompts of a store that already holds some are staged in a
private file beside the store (`_Stage`) until the last line is read, so a head running meanwhile
feeds none of them. With `--rerun-changed` the changed prompts get their new request and run again
(their old results are dropped; `Store.replace_requests`), the rest resume.

Within one file, a custom_id seen again with the same request is a reported duplicate; with another
request it is a rejected line. Memory stays flat however long the file: the first line of a custom_id
is read back from the store (or the stage), and for the prompts the store held before, a flat array
of line numbers by `seq`. Every line read is counted in exactly one of the summary's kinds.

At the end, one feed pass puts a window into Redis (`feed.Feeder`) so a small run starts at once; the
head process (`producer head`) feeds the rest as workers take prompts.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, NamedTuple

import orjson

from batchfleet.records import ENDPOINTS
from batchfleet.redact import private_file

from .inputs import MAX_LINE_BYTES, Lines
from .parse import Reject, parse_line
from .progress import Reporter
from .store import UNBOUNDED_COST, FileFingerprint, Known, State, Store, StoreError, canonical_request

__all__ = ["ChangedRequests", "EmptyInput", "EnqueueSummary", "cost_of", "enqueue_file"]

BATCH = 5000  # prompts per store transaction
MAX_MESSAGES = 100  # reject lines echoed on stderr; all of them go to the rejects file
QUOTE_BYTES = 1024  # of a rejected line, the rejects file quotes this much
_EP = {url: i for i, url in enumerate(ENDPOINTS)}


class EmptyInput(StoreError):
    """The input holds no prompt (it is empty, or only blank lines): nothing to store, so no store and
    no run marker were made."""


class ChangedRequests(StoreError):
    """Lines of the file ask other requests than the store holds for their custom_ids, and
    `--rerun-changed` was not given: nothing of the file was stored (exit 2)."""


@dataclass
class EnqueueSummary:
    # Every line read is one of: blank, new, present, collected, changed, rejected, duplicates.
    lines: int = 0
    blank: int = 0
    new: int = 0  # written to the store now
    present: int = 0  # the same request is already in the store (waiting or in Redis)
    collected: int = 0  # the same request already has a result
    changed: int = 0  # the store holds another request for its custom_id: run again with --rerun-changed
    rejected: int = 0  # not a prompt, or a custom_id already on an earlier line with another request
    duplicates: int = 0  # the same custom_id and request again in this file
    first_change: tuple[int, str] | None = None  # (line, custom_id) of the first changed line
    rejects_path: Path | None = None
    seconds: float = 0.0
    fed: dict[str, int] = field(default_factory=dict)  # put into Redis by the final feed pass, per queue
    waiting: int = 0  # left in the store for the head to feed

    def counts(self) -> str:
        """What became of the lines: the counts add up to `lines`."""
        parts = [f"{self.new:,} new", f"{self.present:,} already in the store", f"{self.collected:,} already finished"]
        if self.changed:
            parts.append(f"{self.changed:,} changed (run again)")
        parts += [f"{self.rejected:,} rejected", f"{self.duplicates:,} duplicates"]
        if self.blank:
            parts.append(f"{self.blank:,} blank")
        return ", ".join(parts)

    def text(self) -> str:
        return f"{self.lines:,} lines: {self.counts()}"


def cost_of(body: dict[str, Any]) -> int:
    """The expected work of a prompt: its max_tokens (or max_completion_tokens); UNBOUNDED_COST without."""
    n = body.get("max_tokens") or body.get("max_completion_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else UNBOUNDED_COST


class _Rejects:
    """The rejects file, created on the first reject and rewritten by each run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh: IO[bytes] | None = None

    def write(self, file: str, line: int, reason: str, raw: bytes, length: int) -> None:
        if self.fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = private_file(self.path, "wb")  # 0600: rejected lines are prompts, maybe private
        rec: dict[str, Any] = {"file": file, "line": line, "reason": reason,
                               "text": raw[:QUOTE_BYTES].decode("utf-8", "replace").rstrip("\r\n")}
        if length > QUOTE_BYTES:  # a huge line is quoted, not copied: its first bytes and its length
            rec["bytes"] = length
        self.fh.write(orjson.dumps(rec) + b"\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        elif self.path.exists():
            self.path.unlink()  # a clean run must not leave the previous run's rejects behind


class _Row(NamedTuple):
    """A valid line as `_Writer.flush` sorts it out: the store's columns first (`row[:7]` is what
    `Store.insert_prompts` takes), then the line itself for a reject."""

    cid: str
    ep: int
    body: bytes
    file: int
    line: int
    cost: int
    fp: bytes
    raw: bytes
    length: int


# _Row from a tuple without NamedTuple's own __new__ (a Python function): one of these a line
_row = partial(tuple.__new__, _Row)


def _line(row: _Row) -> int:
    return row.line


class _FirstLines:
    """The line of this file where each prompt the store held before was first seen (by seq; 0: not
    yet): 4 bytes per prompt, where a set of custom_ids would take ~100."""

    def __init__(self, max_seq: int) -> None:
        self.lines = array("I", bytes(4 * (max_seq + 1)))
        self.extra: dict[int, int] = {}  # prompts another enqueue stored meanwhile

    def get(self, seq: int) -> int:
        return self.lines[seq] if seq < len(self.lines) else self.extra.get(seq, 0)

    def set(self, seq: int, line: int) -> None:
        if seq < len(self.lines):
            self.lines[seq] = line
        else:
            self.extra[seq] = line


class _Stage:
    """The new prompts of a file read into a store that holds prompts already, kept apart until the
    last line is read: a private SQLite file beside the store, unlinked once open (no journal), so
    nothing of it outlives the enqueue, however it ends."""

    def __init__(self, store_path: Path) -> None:
        path = store_path.with_name(f".{store_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.stage")
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        try:
            self.db = sqlite3.connect(path, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=OFF")
            self.db.execute("PRAGMA synchronous=OFF")
            self.db.execute("CREATE TABLE new (n INTEGER PRIMARY KEY, cid TEXT NOT NULL UNIQUE, ep INTEGER NOT NULL, "
                            "body BLOB NOT NULL, line INTEGER NOT NULL, cost INTEGER NOT NULL, fp BLOB NOT NULL)")
        finally:
            path.unlink()

    def add(self, rows: Sequence[_Row]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO new (cid, ep, body, line, cost, fp) VALUES (?, ?, ?, ?, ?, ?)",
                            [(r.cid, r.ep, r.body, r.line, r.cost, r.fp) for r in rows])
        self.db.execute("COMMIT")

    def first(self, cids: Sequence[str]) -> dict[str, tuple[int, bytes]]:
        """cid -> (line, fp) of those of `cids` staged already."""
        out: dict[str, tuple[int, bytes]] = {}
        for i in range(0, len(cids), 900):
            part = cids[i : i + 900]
            q = f"SELECT cid, line, fp FROM new WHERE cid IN ({','.join('?' * len(part))})"
            out.update((c, (line, fp)) for c, line, fp in self.db.execute(q, part))
        return out

    def pages(self, size: int) -> Iterator[list[tuple[str, int, bytes, int, int, bytes]]]:
        after = 0
        while rows := self.db.execute("SELECT n, cid, ep, body, line, cost, fp FROM new WHERE n > ? ORDER BY n "
                                      "LIMIT ?", (after, size)).fetchall():
            after = rows[-1][0]
            yield [row[1:] for row in rows]

    def close(self) -> None:
        self.db.close()


class _Writer:
    """Sorts the valid lines out against the store, in batches: new prompts are stored (or staged),
    those the store holds with the same request are counted, changed ones are counted (and with
    `rerun`, replaced), and repeats in this file are duplicates or rejects."""

    def __init__(self, store: Store, source: Lines, summary: EnqueueSummary, reject: Callable[..., None], *,
                 rerun: bool, take_failed: Callable[[list[tuple[int, str]]], None] | None) -> None:
        self.store = store
        self.source = source
        self.summary = summary
        self.reject = reject
        self.rerun = rerun
        self.take_failed = take_failed
        with store.write():
            self.file_id = store.file_id(source.name)
            self.start_seq = store.max_seq()  # rows above it were written by this run
        # Stored prompts mean a line may differ: then nothing of the file may be stored, so new
        # prompts wait in a stage until the file is read (with --rerun-changed nothing is refused).
        self.stage = _Stage(store.path) if self.start_seq and not rerun else None
        self.first_lines = _FirstLines(self.start_seq)
        self.file_fp = FileFingerprint()
        self.batch: list[_Row] = []

    def add(self, cid: str, url: str, body: dict[str, Any], lineno: int, raw: bytes, length: int) -> None:
        canon, fp = canonical_request(url, body)  # stored so: one encoding serves the store and the fingerprint
        self.batch.append(_row((cid, _EP[url], canon, self.file_id, lineno, cost_of(body), fp, raw, length)))
        if len(self.batch) >= BATCH:
            self.flush()

    def _mine(self, k: Known) -> bool:
        """Was this stored prompt written from an earlier line of this file, by this enqueue?"""
        return self.stage is None and k.seq > self.start_seq and k.file == self.file_id

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if not batch:
            return
        s = self.summary
        repeats: list[tuple[_Row, int, bool]] = []  # (row, line of its first occurrence, same request)
        firsts: list[_Row] = []  # first occurrences in this file: its fingerprint's terms
        fresh: list[_Row] = []  # custom_ids new to the store (as far as this batch knows)
        replace: list[tuple[int, int, bytes, int, int, int, bytes]] = []
        failed: list[tuple[int, str]] = []
        with self.store.write() if self.stage is None else self.store.read():
            cids = list(dict.fromkeys(row.cid for row in batch))
            # A store that held nothing before has nothing to compare with: repeats of earlier batches
            # show when their insert is ignored (below), as in a first enqueue of 10M lines they are rare.
            known = self.store.known(cids) if self.start_seq else {}
            staged = self.stage.first(cids) if self.stage is not None else {}
            here: dict[str, tuple[int, bytes]] = {}  # new custom_ids first seen in this batch: (line, fp)
            changed_here: dict[int, bytes] = {}  # stored prompts whose first line here (this batch) changed
            if not known and not staged and len(cids) == len(batch):
                fresh = batch  # as the loop below finds: no custom_id known, none twice
            for row in batch if fresh is not batch else ():
                k = known.get(row.cid)
                if k is not None and not self._mine(k):  # in the store before this file
                    first = self.first_lines.get(k.seq)
                    if first:
                        repeats.append((row, first, row.fp == changed_here.get(k.seq, k.fp)))
                        continue
                    self.first_lines.set(k.seq, row.line)
                    firsts.append(row)
                    if row.fp == k.fp:
                        if k.state == State.DONE:
                            s.collected += 1
                        else:
                            s.present += 1
                        continue
                    s.changed += 1
                    s.first_change = s.first_change or (row.line, row.cid)
                    changed_here[k.seq] = row.fp
                    replace.append((k.seq, row.ep, row.body, self.file_id, row.line, row.cost, row.fp))
                    continue
                prev = here.get(row.cid) or staged.get(row.cid) or ((k.line, k.fp) if k is not None else None)
                if prev is not None:
                    repeats.append((row, prev[0], row.fp == prev[1]))
                    continue
                here[row.cid] = (row.line, row.fp)
                fresh.append(row)
            if self.stage is None:
                n = self.store.insert_prompts([r[:7] for r in fresh])
                s.new += n
                if n < len(fresh):  # some were stored already: by an earlier line of this file, or meanwhile
                    back = self.store.known([r.cid for r in fresh])
                    stored = fresh
                    fresh = []
                    for r in stored:
                        k = back[r.cid]
                        if not self._mine(k):
                            s.present += 1  # another enqueue stored this custom_id meanwhile
                        elif k.line != r.line:
                            repeats.append((r, k.line, r.fp == k.fp))
                            continue
                        fresh.append(r)
                if self.rerun:
                    failed = self.store.replace_requests(replace)
        if self.stage is not None:
            self.stage.add(fresh)
        # in file order (`fresh` is, and so is `firsts`)
        self.file_fp.add_many((r.cid, r.fp) for r in (sorted(firsts + fresh, key=_line) if firsts else fresh))
        if failed and self.take_failed is not None:
            self.take_failed(failed)  # their failed jobs leave RQ's registry: the feed writes the new ones
        for row, first, same in sorted(repeats, key=lambda rep: rep[0].line):
            if same:
                self.reject(row.line, f"duplicate custom_id {row.cid!r} (first at line {first})", row.raw, row.length,
                            duplicate=True)
            else:
                self.reject(row.line, f"custom_id {row.cid!r} is already on line {first} with a different request",
                            row.raw, row.length)

    def finish(self) -> None:
        """After the last line: refuse the file if a request changed (without `rerun`), else store the
        staged prompts; record the input."""
        self.flush()
        s = self.summary
        if s.changed and not self.rerun:
            assert s.first_change is not None
            line, cid = s.first_change
            others = f"; {s.changed:,} custom_ids differ in all" if s.changed > 1 else ""
            name = self.source.name
            raise ChangedRequests(
                f"{name}:{line}: custom_id {cid!r} is in the store of run {self.store.run} with a different "
                f"request{others}; nothing of {name} was enqueued. Either enqueue it under a new run "
                "name (--run NAME), or rerun only the changed prompts with --rerun-changed (their old results are "
                "replaced; the others resume)")
        if self.stage is not None:
            for page in self.stage.pages(BATCH):
                with self.store.write():
                    n = self.store.insert_prompts([(cid, ep, body, self.file_id, line, cost, fp)
                                                   for cid, ep, body, line, cost, fp in page])
                s.new += n
                s.present += len(page) - n
        with self.store.write():
            self.store.record_input(self.file_id, self.source.path, self.file_fp, time.time())

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()


def enqueue_file(store: Store, source: Lines, *, defaults: dict[str, Any], model: str,
                 rejects_path: Path | None = None, progress: bool = True, rerun_changed: bool = False,
                 take_failed: Callable[[list[tuple[int, str]]], None] | None = None) -> EnqueueSummary:
    """Write every valid line of `source` to the store. Messages and progress go to stderr. Raises
    ChangedRequests (nothing of the file stored) when a known custom_id's request changed and not
    `rerun_changed`; with it, `take_failed((seq, cid)...)` takes their failed jobs out of Redis."""
    name = source.name
    summary = EnqueueSummary(rejects_path=rejects_path or Path(f"{name}.rejects.jsonl"))
    rejects = _Rejects(summary.rejects_path)
    report = Reporter(f"enqueue {name}", source.size, enabled=progress)
    start = time.monotonic()

    def reject(lineno: int, reason: str, raw: bytes, length: int, *, duplicate: bool = False) -> None:
        if len(reason) > QUOTE_BYTES // 2:  # a reason quotes the line (a key, a custom_id): as little of it
            reason = reason[: QUOTE_BYTES // 2] + "..."
        if duplicate:
            summary.duplicates += 1
        else:
            summary.rejected += 1
        if summary.rejected + summary.duplicates <= MAX_MESSAGES:
            report.message(f"{name}:{lineno}: {reason}")
        elif summary.rejected + summary.duplicates == MAX_MESSAGES + 1:
            report.message(f"... further rejects only in {summary.rejects_path}")
        rejects.write(name, lineno, reason, raw, length)

    writer = _Writer(store, source, summary, reject, rerun=rerun_changed, take_failed=take_failed)
    try:
        for lineno, raw, length in source:
            summary.lines += 1
            if lineno % BATCH == 0:
                report.update(summary.lines, source.nbytes)
            if not raw or raw.isspace():
                summary.blank += 1
                continue
            if length > len(raw):
                reject(lineno, f"line of {length:,} bytes is longer than any request may be ({MAX_LINE_BYTES:,})",
                       raw, length)
                continue
            try:
                cid, url, body = parse_line(raw, defaults, model)
            except Reject as exc:
                reject(lineno, str(exc), raw, length)
                continue
            writer.add(cid, url, body, lineno, raw, length)
        writer.finish()
        report.update(summary.lines, source.nbytes)
    finally:
        writer.close()
        report.close()
        rejects.close()
    summary.seconds = time.monotonic() - start
    return summary
