"""`producer enqueue`: stream a JSONL file into RQ jobs, one per prompt, idempotent by custom_id.

The file is read line by line and enqueued in batches (never loaded whole). Per batch, inside one
SQLite write transaction (the collector takes the same lock):
  1. drop custom_ids that already have a result in the store (collected: never run again);
  2. give new custom_ids the next `seq` (an already known custom_id keeps its own);
  3. one EVALSHA (`lua.ENQUEUE_LUA`) writes each job hash and queues its id, skipping jobs that
     exist or are done-but-not-collected in Redis;
  4. INSERT OR IGNORE the prompts rows, then COMMIT.
A crash between 3 and 4 leaves jobs in Redis without rows: the next run finds them present and
adds the rows. Prompts go round-robin over the queues; workers steal from other queues when theirs
runs dry, so the spread need not be perfect.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import orjson
import redis

from batchfleet.config import Config
from batchfleet.jobs import GENERATE
from batchfleet.keys import FAILURE_TTL_S, RQ_QUEUES, Keys
from batchfleet.records import Prompt, job_id_for

from .lua import ENQUEUE_LUA
from .parse import Reject, parse_line
from .progress import Reporter
from .store import Store

__all__ = ["EnqueueSummary", "Enqueuer", "enqueue_file"]

BATCH = 1000
MAX_MESSAGES = 100  # reject lines echoed on stderr; all of them go to the rejects file
_RQ_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"  # rq.utils.utcformat


@dataclass
class EnqueueSummary:
    lines: int = 0
    new: int = 0  # queued now
    present: int = 0  # already queued, running, failed (requeueable) or done in Redis
    collected: int = 0  # already have a result in the store
    rejected: int = 0
    duplicates: int = 0  # same custom_id twice in this file
    rejects_path: Path | None = None
    seconds: float = 0.0
    per_queue: dict[str, int] = field(default_factory=dict)  # new jobs per queue


class Enqueuer:
    """Batches prompts and writes each batch with one Lua call inside one store transaction."""

    def __init__(self, config: Config, r: redis.Redis, store: Store, *, queues: tuple[str, ...],
                 summary: EnqueueSummary) -> None:
        self.keys = Keys(config.run)
        self.run = config.run
        self.store = store
        self.queues = queues
        self.summary = summary
        self.timeout = str(int(config.request_timeout_s))
        self.script = r.register_script(ENQUEUE_LUA)
        self.batch: list[tuple[str, str, dict[str, Any], str]] = []
        self.rr = 0

    def add(self, cid: str, url: str, body: dict[str, Any], src: str) -> None:
        self.batch.append((cid, url, body, src))
        if len(self.batch) >= BATCH:
            self.flush()

    def flush(self) -> None:
        batch, self.batch = self.batch, []
        if not batch:
            return
        s, k, nq = self.summary, self.keys, len(self.queues)
        cids = [b[0] for b in batch]
        ts = datetime.now(UTC).strftime(_RQ_TIME)
        with self.store.write():
            have_result = self.store.with_results(cids)
            known = self.store.seqs(cids)
            seq = self.store.max_seq()
            job_keys: list[list[str]] = [[] for _ in range(nq)]  # grouped by queue, as the script wants
            blobs: list[list[bytes]] = [[] for _ in range(nq)]
            rows = []
            for cid, url, body, src in batch:
                if cid in have_result:
                    s.collected += 1
                    continue
                own = known.get(cid)
                if own is None:
                    seq += 1
                    own = seq
                jid = job_id_for(self.run, cid)
                qi = self.rr % nq
                self.rr += 1
                data = orjson.dumps([GENERATE, None, [Prompt(cid, own, url, body, src, self.run).to_dict()], {}])
                job_keys[qi].append(Keys.job(jid))
                blobs[qi].append(b"%s\0generate(%s)" % (data, cid.encode()))
                rows.append((cid, own, jid, src))
            if rows:
                keys = [k.done, k.stats, RQ_QUEUES, *(Keys.queue(q) for q in self.queues)]
                args: list[Any] = [nq, len(Keys.job("")), ts, self.timeout, 0, FAILURE_TTL_S, *self.queues]
                args += [len(b) for b in blobs]
                for qi in range(nq):
                    keys += job_keys[qi]
                    args += blobs[qi]
                added, present, *per_queue = self.script(keys=keys, args=args)
                s.new += added
                s.present += present
                for q, n in zip(self.queues, per_queue, strict=True):
                    s.per_queue[q] = s.per_queue.get(q, 0) + n
                self.store.add_prompts(rows)


class _Rejects:
    """The rejects file, created on the first reject and rewritten by each run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh: IO[bytes] | None = None

    def write(self, file: str, line: int, reason: str, raw: bytes) -> None:
        if self.fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fh = open(self.path, "wb")  # noqa: SIM115 (held open across calls)
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        self.fh.write(orjson.dumps({"file": file, "line": line, "reason": reason, "text": text}) + b"\n")

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        elif self.path.exists():
            self.path.unlink()  # a clean run must not leave the previous run's rejects behind


def enqueue_file(config: Config, r: redis.Redis, store: Store, path: str, *, queues: tuple[str, ...],
                 defaults: dict[str, Any], model: str, rejects_path: Path | None = None,
                 progress: bool = True) -> EnqueueSummary:
    """Enqueue every valid line of `path` (`-` = stdin). Messages and progress go to stderr."""
    name = "stdin" if path == "-" else path
    summary = EnqueueSummary(rejects_path=rejects_path or Path(f"{name}.rejects.jsonl"))
    rejects = _Rejects(summary.rejects_path)
    fh: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    size = None if path == "-" or not Path(path).is_file() else Path(path).stat().st_size
    report = Reporter(f"enqueue {name}", size, enabled=progress)
    enq = Enqueuer(config, r, store, queues=queues, summary=summary)
    first_line: dict[str, int] = {}  # custom_id -> line, for duplicates inside this file
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
            first = first_line.setdefault(cid, lineno)
            if first != lineno:
                reject(lineno, f"duplicate custom_id {cid!r} (first at line {first})", raw, duplicate=True)
                continue
            enq.add(cid, url, body, f"{name}:{lineno}")
            if lineno % BATCH == 0:
                report.update(summary.lines, nbytes)
        enq.flush()
        report.update(summary.lines, nbytes)
    finally:
        report.close()
        rejects.close()
        if fh is not sys.stdin.buffer:
            fh.close()
    summary.seconds = time.monotonic() - start
    return summary
