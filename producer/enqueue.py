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

`enqueue_whole` stores a file the other way, whole or not at all (a Batch API batch, `batchapi`): one
new input in one transaction, each custom_id under a prefix, refused with its bad lines' problems.
Both read lines with `read_requests`, so a line is a request, a blank or a reject by the same rules.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from pathlib import Path
from typing import IO, Any, NamedTuple

import orjson

from batchfleet.prompts import EMBEDDINGS, kind_mismatch
from batchfleet.records import ENDPOINTS
from batchfleet.redact import private_file

from .fingerprint import FileFingerprint, canonical_request
from .inputs import MAX_LINE_BYTES, Lines
from .parse import NotJson, Reject, adapter_of, parse_line
from .plan import plan_key
from .progress import Reporter
from .store import UNBOUNDED_COST, Known, Span, State, Store, StoreError

__all__ = ["ChangedRequests", "EmptyInput", "EnqueueSummary", "Fault", "MixedKinds", "Problem", "Request", "Whole",
           "WrongKind", "cost_of", "enqueue_file", "enqueue_whole", "read_requests", "unknown_adapter"]

BATCH = 5000  # prompts per store transaction
MAX_MESSAGES = 100  # reject lines echoed on stderr; all of them go to the rejects file
QUOTE_BYTES = 1024  # of a rejected line, the rejects file quotes this much
_EP = {url: i for i, url in enumerate(ENDPOINTS)}

Request = tuple[str, str, dict[str, Any]]  # (custom_id, url, body) of a valid line


class EmptyInput(StoreError):
    """The input holds no prompt (it is empty, or only blank lines): nothing to store, so no store and
    no run marker were made."""


class ChangedRequests(StoreError):
    """Lines of the file ask other requests than the store holds for their custom_ids, and
    `--rerun-changed` was not given: nothing of the file was stored (exit 2)."""


class WrongKind(StoreError):
    """The run's live workers serve the other kind (their servers' `/model_info` is_generation): an
    embedding file for a generation fleet, or the other way round. Nothing of the file was stored (exit 2)."""


class MixedKinds(StoreError):
    """The file holds embedding lines and generation lines (or the run holds the other kind already):
    a server is one or the other, so a run is too. Nothing of the file was stored (exit 2)."""


_EMBED_EP = ENDPOINTS.index(EMBEDDINGS)


def _kind(ep: int) -> str:
    return "embedding" if ep == _EMBED_EP else "generation"


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


def unknown_adapter(name: str, adapters: frozenset[str]) -> Reject:
    """A line names a LoRA adapter the fleet's servers do not load."""
    have = ", ".join(sorted(adapters)[:20]) if adapters else "none"
    return Reject(f"unknown LoRA adapter {name!r}: the fleet's servers load {have} (BATCHFLEET_LORA_PATHS, "
                  "or --lora-paths in BATCHFLEET_SERVER_ARGS)")


def read_requests(source: Lines, defaults: dict[str, Any], model: str, *, batch_only: bool = False,
                  adapters: frozenset[str] | None = None) -> Iterator[tuple[int, bytes, int, Request | Reject | None]]:
    """Every line of `source` as enqueue reads it: (its number, its bytes, its length, what it is). What it
    is: None (a blank line), the `Reject` saying why it is no request (a line longer than any request
    may be, `NotJson`, a broken rule, a LoRA adapter not in `adapters` when given), or the request,
    (custom_id, url, body) as `parse_line` makes it with `defaults` and `model` (`batch_only`: the simple
    form is refused)."""
    for lineno, raw, length in source:
        if not raw or raw.isspace():
            yield lineno, raw, length, None
            continue
        if length > len(raw):
            yield lineno, raw, length, Reject(f"line of {length:,} bytes is longer than any request may be "
                                              f"({MAX_LINE_BYTES:,})")
            continue
        got: Request | Reject
        try:  # enqueue's call passes no keyword: one costs on every line
            got = parse_line(raw, defaults, model, batch_only=True) if batch_only else parse_line(raw, defaults, model)
        except Reject as exc:
            got = exc
        else:
            if adapters is not None:
                name = adapter_of(got[2])
                if name is not None and name not in adapters:
                    got = unknown_adapter(name, adapters)
        yield lineno, raw, length, got


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
    """A valid line as `_Writer.flush` sorts it out: the store's columns first (`row[:8]` is what
    `Store.insert_prompts` takes), then the line itself for a reject."""

    cid: str
    ep: int
    body: bytes
    file: int
    line: int
    cost: int
    fp: bytes
    pk: bytes | None  # its plan key (producer/plan.py); None when the run is fed without a plan
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
                            "body BLOB NOT NULL, line INTEGER NOT NULL, cost INTEGER NOT NULL, fp BLOB NOT NULL, "
                            "pk BLOB)")
        finally:
            path.unlink()

    def add(self, rows: Sequence[_Row]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("INSERT INTO new (cid, ep, body, line, cost, fp, pk) VALUES (?, ?, ?, ?, ?, ?, ?)",
                            [(r.cid, r.ep, r.body, r.line, r.cost, r.fp, r.pk) for r in rows])
        self.db.execute("COMMIT")

    def first(self, cids: Sequence[str]) -> dict[str, tuple[int, bytes]]:
        """cid -> (line, fp) of those of `cids` staged already."""
        out: dict[str, tuple[int, bytes]] = {}
        for i in range(0, len(cids), 900):
            part = cids[i : i + 900]
            q = f"SELECT cid, line, fp FROM new WHERE cid IN ({','.join('?' * len(part))})"
            out.update((c, (line, fp)) for c, line, fp in self.db.execute(q, part))
        return out

    def pages(self, size: int) -> Iterator[list[tuple[str, int, bytes, int, int, bytes, bytes | None]]]:
        after = 0
        while rows := self.db.execute("SELECT n, cid, ep, body, line, cost, fp, pk FROM new WHERE n > ? ORDER BY n "
                                      "LIMIT ?", (after, size)).fetchall():
            after = rows[-1][0]
            yield [row[1:] for row in rows]

    def close(self) -> None:
        self.db.close()


class _Sorted:
    """A batch of valid lines sorted out against the store (`_Writer._sort`)."""

    __slots__ = ("firsts", "fresh", "repeats", "replace")

    def __init__(self) -> None:
        self.repeats: list[tuple[_Row, int, bool]] = []  # (row, line of its first occurrence, same request)
        self.firsts: list[_Row] = []  # first lines in this file of prompts stored before: the fingerprint's terms
        self.fresh: list[_Row] = []  # custom_ids new to the store (as far as this batch knows)
        self.replace: list[tuple[int, int, bytes, int, int, int, bytes]] = []  # changed: the new requests


class _Writer:
    """Sorts the valid lines out against the store, in batches: new prompts are stored (or staged),
    those the store holds with the same request are counted, changed ones are counted (and with
    `rerun`, replaced), and repeats in this file are duplicates or rejects."""

    def __init__(self, store: Store, source: Lines, summary: EnqueueSummary, reject: Callable[..., None], *,
                 rerun: bool, take_failed: Callable[[list[tuple[int, str]]], None] | None,
                 generates: bool | None = None) -> None:
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
        self.planned = store.plan.on  # each prompt's plan key, unless the run is fed without a plan
        with store.read():
            held = {ep == _EMBED_EP for ep in store.endpoints()}
        # The run's kind (embedding or not): the store's, else this file's first line's. A store that
        # holds both kinds (made before this rule) is never refused.
        self.held = bool(held)
        self.embed: bool | None = next(iter(held)) if len(held) == 1 else None
        self.mixed_ok = len(held) > 1
        self.generates = generates  # what the run's live workers serve (None: unknown, or checked already)

    def add(self, cid: str, url: str, body: dict[str, Any], lineno: int, raw: bytes, length: int) -> None:
        canon, fp = canonical_request(url, body)  # stored so: one encoding serves the store and the fingerprint
        pk = plan_key(canon, body) if self.planned else None
        ep = _EP[url]
        if self.generates is not None:  # the first request: can the fleet run it?
            reason = kind_mismatch(url, self.generates)
            self.generates = None
            if reason:
                name = self.source.name
                raise WrongKind(f"{name}:{lineno}: {reason} (the run's live workers said so); nothing of {name} "
                                "was enqueued")
        if (ep == _EMBED_EP) is not self.embed and not self.mixed_ok:
            self._other_kind(ep, lineno)
        self.batch.append(_row((cid, ep, canon, self.file_id, lineno, cost_of(body), fp, pk, raw, length)))
        if len(self.batch) >= BATCH:
            self.flush()

    def _other_kind(self, ep: int, lineno: int) -> None:
        if self.embed is None:  # the first line: the run's kind
            self.embed = ep == _EMBED_EP
            return
        name, run = self.source.name, self.store.run
        where = f"run {run} holds" if self.held else f"the lines before it in {name} are"
        self.batch.clear()
        if self.stage is None:
            with self.store.write():
                self.store.forget_waiting(self.start_seq, self.file_id)
        raise MixedKinds(f"{name}:{lineno}: a {_kind(ep)} request ({ENDPOINTS[ep]}), but {where} "
                         f"{_kind(_EMBED_EP if self.embed else 0)} requests; a server either embeds or generates, "
                         f"so a run holds one kind: nothing of {name} was enqueued (split the file, one run each)")

    def _mine(self, k: Known) -> bool:
        """Was this stored prompt written from an earlier line of this file, by this enqueue?"""
        return self.stage is None and k.seq > self.start_seq and k.file == self.file_id

    def flush(self) -> None:
        """Sort the lines added since the last flush out against the store (see the class doc)."""
        batch, self.batch = self.batch, []
        if not batch:
            return
        failed: list[tuple[int, str]] = []
        with self.store.write() if self.stage is None else self.store.read():
            out = self._sort(batch)
            if self.stage is None:
                self._insert(out)
                if self.rerun:
                    failed = self.store.replace_requests(out.replace)
        if self.stage is not None:
            self.stage.add(out.fresh)
        # in file order (`fresh` is, and so is `firsts`)
        fresh, firsts = out.fresh, out.firsts
        self.file_fp.add_many((r.cid, r.fp) for r in (sorted(firsts + fresh, key=_line) if firsts else fresh))
        if failed and self.take_failed is not None:
            self.take_failed(failed)  # their failed jobs leave RQ's registry: the feed writes the new ones
        self._report(out.repeats)

    def _sort(self, batch: list[_Row]) -> _Sorted:
        """Within the caller's transaction: which rows of `batch` are new, which the store holds already
        (counted as present, collected or changed), which repeat an earlier line of this file."""
        s, out = self.summary, _Sorted()
        cids = list(dict.fromkeys(row.cid for row in batch))
        # A store that held nothing before has nothing to compare with: repeats of earlier batches
        # show when their insert is ignored (`_insert`), as in a first enqueue of 10M lines they are rare.
        known = self.store.known(cids) if self.start_seq else {}
        staged = self.stage.first(cids) if self.stage is not None else {}
        if not known and not staged and len(cids) == len(batch):
            out.fresh = batch  # as the loop below finds: no custom_id known, none twice
            return out
        repeats, firsts, fresh, replace = out.repeats, out.firsts, out.fresh, out.replace
        here: dict[str, tuple[int, bytes]] = {}  # new custom_ids first seen in this batch: (line, fp)
        changed_here: dict[int, bytes] = {}  # stored prompts whose first line here (this batch) changed
        for row in batch:
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
                replace.append((k.seq, row.ep, row.body, self.file_id, row.line, row.cost, row.fp, row.pk))
                continue
            prev = here.get(row.cid) or staged.get(row.cid) or ((k.line, k.fp) if k is not None else None)
            if prev is not None:
                repeats.append((row, prev[0], row.fp == prev[1]))
                continue
            here[row.cid] = (row.line, row.fp)
            fresh.append(row)
        return out

    def _insert(self, out: _Sorted) -> None:
        """Store the new prompts of `out`. Those the store took meanwhile are found again: written by an
        earlier line of this file (a repeat) or by another enqueue (present)."""
        s = self.summary
        n = self.store.insert_prompts([r[:8] for r in out.fresh])
        s.new += n
        if n == len(out.fresh):
            return
        back = self.store.known([r.cid for r in out.fresh])
        stored, out.fresh = out.fresh, []
        for r in stored:
            k = back[r.cid]
            if not self._mine(k):
                s.present += 1  # another enqueue stored this custom_id meanwhile
            elif k.line != r.line:
                out.repeats.append((r, k.line, r.fp == k.fp))
                continue
            out.fresh.append(r)

    def _report(self, repeats: list[tuple[_Row, int, bool]]) -> None:
        """Each repeated custom_id of the batch, in file order: a duplicate, or a reject when its request
        differs from its first line's."""
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
                    n = self.store.insert_prompts([(cid, ep, body, self.file_id, line, cost, fp, pk)
                                                   for cid, ep, body, line, cost, fp, pk in page])
                s.new += n
                s.present += len(page) - n
        with self.store.write():
            self.store.record_input(self.file_id, self.source.path, self.file_fp, time.time())

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()


def enqueue_file(store: Store, source: Lines, *, defaults: dict[str, Any], model: str,
                 rejects_path: Path | None = None, progress: bool = True, rerun_changed: bool = False,
                 take_failed: Callable[[list[tuple[int, str]]], None] | None = None,
                 adapters: frozenset[str] | None = None, generates: bool | None = None) -> EnqueueSummary:
    """Write every valid line of `source` to the store (a line naming a LoRA adapter outside `adapters`,
    when given, is rejected). Messages and progress go to stderr. Raises
    ChangedRequests (nothing of the file stored) when a known custom_id's request changed and not
    `rerun_changed`; with it, `take_failed((seq, cid)...)` takes their failed jobs out of Redis.
    MixedKinds when embedding and generation requests meet in the file or the run, WrongKind when the
    run's servers are of the other kind (`generates`: their `/model_info` is_generation, None unknown):
    nothing of the file stored."""
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

    writer = _Writer(store, source, summary, reject, rerun=rerun_changed, take_failed=take_failed,
                     generates=generates)
    try:
        for lineno, raw, length, got in read_requests(source, defaults, model, adapters=adapters):
            summary.lines += 1
            if lineno % BATCH == 0:
                report.update(summary.lines, source.nbytes)
            if type(got) is tuple:
                cid, url, body = got
                writer.add(cid, url, body, lineno, raw, length)
            elif got is None:
                summary.blank += 1
            else:
                reject(lineno, str(got), raw, length)
        writer.finish()
        report.update(summary.lines, source.nbytes)
    finally:
        writer.close()
        report.close()
        rejects.close()
    summary.seconds = time.monotonic() - start
    return summary


# --- an input stored whole: a Batch API batch ---------------------------------------------------------
class Fault(Enum):
    """Why an input stored whole (`enqueue_whole`) was refused, line by line."""

    NOT_JSON = "not_json"  # the line is not a JSON object
    INVALID = "invalid"  # it breaks a rule of a request (or is longer than any request may be)
    URL = "url"  # it asks another endpoint than the input's
    DUPLICATE = "duplicate"  # it repeats the custom_id of an earlier line
    TOO_MANY = "too_many"  # it is past the most requests the input may hold
    EMPTY = "empty"  # (no line) the input holds no request


class Problem(NamedTuple):
    """A line that refused an input stored whole, and why (its message names what to change)."""

    line: int | None  # None: the input as a whole
    fault: Fault
    message: str


@dataclass
class Whole:
    """What `enqueue_whole` stored: the input's id and span, or the problems that refused it (then
    nothing was stored and `input_id`, `span` are None)."""

    input_id: int | None = None
    span: Span | None = None
    prompts: int = 0
    model: str | None = None  # body.model of the first request
    problems: list[Problem] = field(default_factory=list)  # by line, at most `max_problems`


class _Refused(Exception):
    """Some line is bad: roll the input's transaction back."""


def enqueue_whole(store: Store, path: Path, *, name: str, prefix: str, url: str, model: str, max_requests: int,
                  max_problems: int = 100, owner: tuple[str, int] | None = None,
                  adapters: frozenset[str] | None = None) -> Whole:
    """Store every request of the batch-form file at `path` as ONE new input named `name`, all of them or
    none: read as `enqueue_file` reads a file (`read_requests`), each stored under `prefix + custom_id`,
    in one write transaction (a crash leaves the whole input or none of it; its prompts hold consecutive
    seqs, its `Span`: the writer lock keeps every other writer out meanwhile). A line that is no
    request, asks another `url`, repeats a custom_id, or is past `max_requests` refuses the input with
    its problem; so does a file without a request. Prompts already stored under `prefix` (a caller that
    restarted after the commit) are found there, not stored twice. `model`: body.model of a line
    without one. `owner`: (tenant, priority: 0 high, 1 normal, 2 low) of the input, recorded in the same
    transaction (`Store.shares`): the head shares the fleet between owners from its first feed of it.
    `adapters`: the LoRA adapters a line may name (None: any)."""
    out = Whole()
    try:
        with store.write():
            out.input_id = store.file_id(name)
            if owner is not None:
                store.shares.own(out.input_id, *owner)
            span, n = store.span_of(prefix)
            if n:
                out.span, out.prompts, out.model = span, n, _model_of(store, span)
                return out
            lo = store.max_seq() + 1
            _store_whole(store, out, path, prefix=prefix, url=url, model=model, max_requests=max_requests,
                         max_problems=max_problems, adapters=adapters)
            if out.problems:
                out.problems.sort(key=lambda e: e.line or 0)
                raise _Refused
            if not out.prompts:
                out.problems.append(Problem(None, Fault.EMPTY, "the input file holds no request"))
                raise _Refused
            out.span = Span(lo, store.max_seq())
            if out.span.size != out.prompts:  # the writer lock keeps every other writer out: never
                raise RuntimeError(f"input {name}: {out.prompts} prompts stored over seqs {out.span}")
    except _Refused:
        out.span, out.input_id, out.prompts = None, None, 0
    return out


def _store_whole(store: Store, out: Whole, path: Path, *, prefix: str, url: str, model: str, max_requests: int,
                 max_problems: int, adapters: frozenset[str] | None = None) -> None:
    file_fp = FileFingerprint()
    rows: list[tuple[str, int, bytes, int, int, int, bytes, bytes | None]] = []
    assert out.input_id is not None
    ep, input_id, problems, append = _EP[url], out.input_id, out.problems, rows.append
    planned = store.plan.on

    def problem(line: int, fault: Fault, message: str) -> None:
        if len(problems) < max_problems:
            problems.append(Problem(line, fault, message))

    with Lines(str(path)) as lines:
        for lineno, _, _, got in read_requests(lines, {}, model, batch_only=True, adapters=adapters):
            if got is None:
                continue
            if type(got) is not tuple:
                problem(lineno, Fault.NOT_JSON if isinstance(got, NotJson) else Fault.INVALID, str(got))
                continue
            cid, u, body = got
            if u != url:
                problem(lineno, Fault.URL, f"url {u} is not the batch's endpoint {url}")
                continue
            out.prompts += 1
            if out.prompts > max_requests:
                problem(lineno, Fault.TOO_MANY, f"the batch holds more than {max_requests:,} requests")
                return
            if out.model is None:
                out.model = body.get("model") if isinstance(body.get("model"), str) else None
            if len(problems) >= max_problems:
                return  # the input is refused; enough said
            canon, fp = canonical_request(u, body)
            pk = plan_key(canon, body) if planned else None
            append((prefix + cid, ep, canon, input_id, lineno, cost_of(body), fp, pk))
            if len(rows) >= BATCH:
                _insert_whole(store, rows, prefix, file_fp, problem)
        _insert_whole(store, rows, prefix, file_fp, problem)
        if not problems:
            store.record_input(input_id, lines.path, file_fp, time.time())


def _insert_whole(store: Store, rows: list[tuple[str, int, bytes, int, int, int, bytes, bytes | None]], prefix: str,
                  file_fp: FileFingerprint, problem: Callable[[int, Fault, str], None]) -> None:
    """Store these rows and add them to the input's fingerprint; a custom_id stored already (by an
    earlier line of this input) is a problem."""
    if not rows:
        return
    cut = len(prefix)
    file_fp.add_many((r[0][cut:], r[6]) for r in rows)
    n = store.insert_prompts(rows)  # also once the input is refused (rolled back at the end): repeats show
    if n < len(rows):
        known = store.known([r[0] for r in rows])
        for cid, _, _, _, line, _, _, _ in rows:
            first = known[cid].line
            if first != line:
                problem(line, Fault.DUPLICATE, f"custom_id {cid[cut:]!r} is already on line {first}")
    rows.clear()


def _model_of(store: Store, span: Span | None) -> str | None:
    if span is None:
        return None
    row = store.db.execute("SELECT body FROM prompts WHERE seq = ?", (span.lo,)).fetchone()
    model = orjson.loads(row[0]).get("model") if row else None
    return model if isinstance(model, str) else None
