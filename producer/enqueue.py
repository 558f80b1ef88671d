"""`producer enqueue`: validate a JSONL file into the run's store, then feed one window to Redis.

The file is streamed line by line (never loaded whole) and written to the store in big transactions
(executemany): prompt text, url, source line, an expected cost (its max_tokens) and the state WAITING.
Idempotent by custom_id: a custom_id the store already knows is left as it is (`INSERT OR IGNORE`), so
re-enqueueing a file adds nothing and a prompt with a result is never run again; a custom_id seen twice
in this file is rejected with the line of its first occurrence (read back from the store, so memory
stays flat however long the file). Ctrl-C loses at most the batch in progress, and running the same
command again completes the run.

At the end, one feed pass puts a window into Redis (`feed.Feeder`) so a small run starts at once; the
head process (`producer head`) feeds the rest as workers take prompts.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from batchfleet.records import ENDPOINTS
from batchfleet.redact import private_file

from .inputs import compression_of, open_input
from .parse import Reject, parse_line
from .progress import Reporter
from .store import UNBOUNDED_COST, State, Store

__all__ = ["EnqueueSummary", "cost_of", "enqueue_file"]

BATCH = 5000  # prompts per store transaction
MAX_MESSAGES = 100  # reject lines echoed on stderr; all of them go to the rejects file
_EP = {url: i for i, url in enumerate(ENDPOINTS)}


@dataclass
class EnqueueSummary:
    lines: int = 0
    new: int = 0  # written to the store now
    present: int = 0  # already in the store (waiting or in Redis)
    collected: int = 0  # already have a result
    rejected: int = 0
    duplicates: int = 0  # same custom_id twice in this file
    rejects_path: Path | None = None
    seconds: float = 0.0
    fed: dict[str, int] = field(default_factory=dict)  # put into Redis by the final feed pass, per queue
    waiting: int = 0  # left in the store for the head to feed


def cost_of(body: dict[str, Any]) -> int:
    """The expected work of a prompt: its max_tokens (or max_completion_tokens); UNBOUNDED_COST without."""
    n = body.get("max_tokens") or body.get("max_completion_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else UNBOUNDED_COST


class _Rejects:
    """The rejects file, created on the first reject and rewritten by each run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh: IO[bytes] | None = None

    def write(self, file: str, line: int, reason: str, raw: bytes) -> None:
        if self.fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = private_file(self.path, "wb")  # 0600: rejected lines are prompts, maybe private
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        self.fh.write(orjson.dumps({"file": file, "line": line, "reason": reason, "text": text}) + b"\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        elif self.path.exists():
            self.path.unlink()  # a clean run must not leave the previous run's rejects behind


class _Writer:
    """Batches valid lines into store transactions and sorts out the custom_ids the store knew."""

    def __init__(self, store: Store, name: str, summary: EnqueueSummary, reject: Any) -> None:
        self.store = store
        self.summary = summary
        self.reject = reject
        with store.write():
            self.file_id = store.file_id(name)
            self.start_seq = store.max_seq()  # rows above it were written by this run
        self.batch: list[tuple[str, int, bytes, int, int, int]] = []
        self.raw: list[bytes] = []

    def add(self, cid: str, url: str, body: dict[str, Any], lineno: int, raw: bytes) -> None:
        self.batch.append((cid, _EP[url], orjson.dumps(body), self.file_id, lineno, cost_of(body)))
        self.raw.append(raw)
        if len(self.batch) >= BATCH:
            self.flush()

    def flush(self) -> None:
        batch, raws, self.batch, self.raw = self.batch, self.raw, [], []
        if not batch:
            return
        s = self.summary
        dups: list[tuple[int, str, bytes]] = []
        with self.store.write():
            n = self.store.insert_prompts(batch)
            if n < len(batch):
                known = self.store.known([row[0] for row in batch])
                for (cid, _, _, file_id, lineno, _), raw in zip(batch, raws, strict=True):
                    seq, f, first, state = known[cid]
                    if seq <= self.start_seq:
                        if state == State.DONE:
                            s.collected += 1
                        else:
                            s.present += 1
                    elif (f, first) != (file_id, lineno):
                        dups.append((lineno, f"duplicate custom_id {cid!r} (first at line {first})", raw))
        s.new += n
        for lineno, reason, raw in dups:
            self.reject(lineno, reason, raw, duplicate=True)


def enqueue_file(store: Store, path: str, *, defaults: dict[str, Any], model: str, rejects_path: Path | None = None,
                 progress: bool = True) -> EnqueueSummary:
    """Write every valid line of `path` (`-` = stdin) to the store. Messages and progress go to stderr."""
    name = "stdin" if path == "-" else path
    summary = EnqueueSummary(rejects_path=rejects_path or Path(f"{name}.rejects.jsonl"))
    rejects = _Rejects(summary.rejects_path)
    fh: IO[bytes] = sys.stdin.buffer if path == "-" else open_input(path)
    plain = path != "-" and Path(path).is_file() and not compression_of(path)
    size = Path(path).stat().st_size if plain else None  # a compressed file's size is not the bytes read
    report = Reporter(f"enqueue {name}", size, enabled=progress)
    start, nbytes = time.monotonic(), 0

    def reject(lineno: int, reason: str, raw: bytes, *, duplicate: bool = False) -> None:
        if duplicate:
            summary.duplicates += 1
        else:
            summary.rejected += 1
        if summary.rejected + summary.duplicates <= MAX_MESSAGES:
            report.message(f"{name}:{lineno}: {reason}")
        elif summary.rejected + summary.duplicates == MAX_MESSAGES + 1:
            report.message(f"... further rejects only in {summary.rejects_path}")
        rejects.write(name, lineno, reason, raw)

    writer = _Writer(store, name, summary, reject)
    try:
        for lineno, raw in enumerate(fh, 1):
            nbytes += len(raw)
            if not raw.strip():
                continue
            summary.lines += 1
            try:
                cid, url, body = parse_line(raw, defaults, model)
            except Reject as exc:
                reject(lineno, str(exc), raw)
                continue
            writer.add(cid, url, body, lineno, raw)
            if lineno % BATCH == 0:
                report.update(summary.lines, nbytes)
        writer.flush()
        report.update(summary.lines, nbytes)
    finally:
        report.close()
        rejects.close()
        if fh is not sys.stdin.buffer:
            fh.close()
    summary.seconds = time.monotonic() - start
    if summary.lines == 0:
        print(f"producer: warning: {name} holds no prompts (it is empty or only blank lines)", file=sys.stderr)
    return summary
