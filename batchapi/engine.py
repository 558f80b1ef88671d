"""The batches' lives: one thread moves every unfinished batch along, in this order each pass.

    cancelling   its prompts without a result are cancelled in the store, the fed ones dropped by the
                 workers (`producer.api.cancel_prompts` on the batch's span) -> its files -> cancelled
    past window  the same, as OpenAI's `batch_expired` -> its files -> expired
    in_progress  request_counts from the store (`Store.counts_in`: two range scans of the batch's span,
                 at most every COUNT_EVERY_S and only when the store changed) -> nothing pending ->
                 finalizing -> its files -> completed
    validating   the oldest one: its file into the store (`validate`), owned by its tenant at its
                 priority, and the head woken -> in_progress, or failed
    tenants      new weights into the store; the tenants' figures, the batches' ETAs, the metrics
                 (`Tenancy.step`, at most every second)

The thread's store connection never checkpoints inside a commit (`Store.checkpoint_later`): it
checkpoints once a batch is in_progress or ended, when no client waits on it.

Its files are the export of its span (`producer.api.write_export`), split as OpenAI splits them:
successes in the output file, every other line in the error file (HTTP errors with the server's body,
requests with no answer, and those the cancel or the expiry took back: `batch_cancelled`,
`batch_expired`). Each custom_id is given back without its batch prefix. A file with no line is not
made (its id stays null). The files are written when the batch ends and never change after: a result
the store takes later for a prompt the batch cancelled (a worker that did not drop it) never enters
them. Their ids derive from the batch's, so a finalization done again after a crash rewrites the same
files. Every step is safe to repeat: a serve killed anywhere resumes each batch where the store and
the registry say it is.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import redis

from batchfleet.config import Config
from batchfleet.errors import ErrorCode
from batchfleet.keys import Keys
from producer.api import Span, Store, cancel_prompts, cancelled_line, ensure_marker, priority_level, write_export

from .auth import ApiKeys
from .fleet import TenantRow
from .objects import OUTPUT_PURPOSE, BatchRecord, BatchStatus, FileRecord, derived_file_id
from .registry import Registry
from .tenancy import Tenancy
from .tenants import DEFAULT_TENANT, priority_of
from .validate import validate_into

__all__ = ["COUNT_EVERY_S", "Engine", "Limits"]

log = logging.getLogger("batchfleet.serve")

COUNT_EVERY_S = 1.0  # request_counts of a running batch are at most this old (longer for huge batches)


class Limits:
    def __init__(self, *, max_requests: int = 50_000, window_s: float = 24 * 3600.0, model: str = "default") -> None:
        self.max_requests = max_requests
        self.window_s = window_s  # how long the `24h` completion window lasts here
        self.model = model  # body.model of a request without one


class Engine:
    def __init__(self, config: Config, registry: Registry, store_path: Path, r: redis.Redis, limits: Limits, *,
                 queues: tuple[str, ...] = (), interval_s: float = 0.5, keys: ApiKeys | None = None,
                 on_rows: Callable[[list[TenantRow]], None] | None = None) -> None:
        self.config = config
        self.registry = registry
        self.store_path = store_path
        self.r = r
        self.keys = Keys(config.run)
        self.limits = limits
        self.queues = queues
        self.interval_s = interval_s
        self.store: Store | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_count: dict[str, float] = {}
        self._seen_version: dict[str, int] = {}
        self._said: set[str] = set()
        self.ready = threading.Event()  # the thread opened the store
        self.tenancy = Tenancy(r, self.keys, registry, keys or ApiKeys([]), on_rows=on_rows)

    # --- the thread ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batch-engine", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Something changed (a new batch, a cancel): do a pass now."""
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def open(self) -> None:
        """Open the store, in the thread that runs the passes (the thread does it itself)."""
        self.store = Store.open(self.store_path, run=self.config.run)
        self.store.checkpoint_later()  # a batch is in_progress once stored; its checkpoint comes after

    def _run(self) -> None:
        self.open()
        assert self.store is not None
        self.ready.set()
        try:
            while not self._stop.is_set():
                busy = False
                try:
                    busy = self.step()
                except (redis.RedisError, OSError) as exc:
                    self._say_once(f"Redis or disk failed ({type(exc).__name__}: {exc}); retrying")
                except Exception as exc:  # never stop serving on a bug: say it once, try again
                    self._say_once(f"unexpected error, carrying on: {type(exc).__name__}: {exc}\n"
                                   f"{traceback.format_exc()}")
                if not busy:
                    self._wake.wait(self.interval_s)
                self._wake.clear()
        finally:
            self.store.close()

    def _say_once(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            log.warning("%s", text)

    def step(self) -> bool:
        """One pass (see the module doc). True when validations are waiting (pass again at once)."""
        now = time.time()
        todo = self.registry.unfinished()
        for b in todo:
            if b.status is BatchStatus.CANCELLING:
                self._end(b, BatchStatus.CANCELLED)
        for b in todo:
            b = self.registry.batches[b.id]
            if not b.final and b.status is not BatchStatus.FINALIZING and now >= b.expires_at:
                self._end(b, BatchStatus.EXPIRED)
        for b in todo:
            b = self.registry.batches[b.id]
            if b.status is BatchStatus.IN_PROGRESS:
                self._progress(b)
            if self.registry.batches[b.id].status is BatchStatus.FINALIZING:
                self._end(self.registry.batches[b.id], BatchStatus.COMPLETED)
        waiting = [b for b in todo if self.registry.batches[b.id].status is BatchStatus.VALIDATING]
        if waiting:
            self._validate(waiting[0])
        assert self.store is not None
        self.tenancy.step(self.store)  # weights into the store, the fleet's figures and ETAs
        return len(waiting) > 1

    # --- validating -> in_progress | failed -----------------------------------------------------------
    def _validate(self, b: BatchRecord) -> None:
        assert self.store is not None
        now = int(time.time())
        if b.input_file_id not in self.registry.files:
            errors = [{"code": "file_not_found", "line": None, "param": "input_file_id",
                       "message": f"the input file {b.input_file_id} was deleted before the batch was validated"}]
            self.registry.update(b.id, lambda cur: _unless_final(cur, status=BatchStatus.FAILED, failed_at=now,
                                                                  errors=errors))
            return
        level = priority_level(priority_of(b.metadata))
        owner = (b.tenant or DEFAULT_TENANT, 1 if level is None else level)
        v = validate_into(self.store, b.id, b.endpoint, self.registry.file_path(b.input_file_id),
                          max_requests=self.limits.max_requests, model=self.limits.model, owner=owner,
                          adapters=frozenset(self.config.lora_adapters))
        if v.errors or v.span is None:
            log.info("batch %s failed validation: %s", b.id, v.errors[0]["message"] if v.errors else "?")
            self.registry.update(b.id, lambda cur: _unless_final(
                cur, status=BatchStatus.FAILED if cur.status is BatchStatus.VALIDATING else cur.status,
                failed_at=now, errors=v.errors))
            return
        ensure_marker(self.r, self.config, self.store, queues=self.queues)  # the run has work: its keys live
        span = v.span

        def started(cur: BatchRecord) -> BatchRecord | None:
            if cur.final:
                return None
            status = BatchStatus.IN_PROGRESS if cur.status is BatchStatus.VALIDATING else cur.status
            return replace(cur, status=status, in_progress_at=now, input_id=v.input_id, lo=span.lo, hi=span.hi,
                           total=v.prompts, model=v.model or cur.model)

        self.registry.update(b.id, started)
        self.tenancy.stored()
        log.info("batch %s: %d request(s) validated into the store (seqs %d-%d)", b.id, v.prompts, span.lo, span.hi)
        self.store.checkpoint()

    # --- in_progress: live counts, then finalizing ------------------------------------------------------
    def _progress(self, b: BatchRecord) -> None:
        assert self.store is not None
        now = time.monotonic()
        if now < self._next_count.get(b.id, 0.0):
            return
        version = self.store.db.execute("PRAGMA data_version").fetchone()[0]
        if self._seen_version.get(b.id) == version:
            return  # nothing committed since the last count
        span = _span(b)
        t0 = time.monotonic()
        with self.store.read():
            counts = self.store.counts_in(span, b.input_id or 0)
        took = time.monotonic() - t0
        self._seen_version[b.id] = version
        # at most ~2% of a core on counting however big the batch: a slow count waits longer for the next
        self._next_count[b.id] = now + max(COUNT_EVERY_S, 50 * took)
        done = counts["pending"] == 0
        stamp = int(time.time())

        def counted(cur: BatchRecord) -> BatchRecord | None:
            if cur.status is not BatchStatus.IN_PROGRESS:
                return None  # cancelled (or ended) meanwhile: that wins
            if done:
                return replace(cur, status=BatchStatus.FINALIZING, finalizing_at=stamp,
                               completed=counts["succeeded"], failed=counts["failed"])
            return replace(cur, completed=counts["succeeded"], failed=counts["failed"])

        self.registry.update(b.id, counted, persist=done)

    # --- the end: cancelled, expired, completed ----------------------------------------------------------
    def _end(self, b: BatchRecord, final: BatchStatus) -> None:
        assert self.store is not None
        at = time.time()
        where = (_span(b), b.input_id or 0) if b.lo is not None else self._stored_span(b)
        span = None if where is None else where[0]
        if final is not BatchStatus.COMPLETED and span is not None:
            code = ErrorCode.BATCH_CANCELLED if final is BatchStatus.CANCELLED else ErrorCode.BATCH_EXPIRED
            message = ("This request was not executed because the batch was cancelled."
                       if code is ErrorCode.BATCH_CANCELLED
                       else "This request could not be executed before the completion window expired.")
            run = self.config.run

            def line(cid: str) -> bytes:
                return cancelled_line(run, cid, at, code=code, message=message)

            s = cancel_prompts(self.r, self.store, self.keys, line, at, span=span)
            self._seen_version.clear()  # it collected results itself: other batches count again
            removed = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in s.removed.items()) or "none"
            taken = f"; {s.cancelled:,} request(s) taken back (jobs removed from Redis: {removed})"
        else:
            taken = ""
        files: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
        counts: dict[str, int] = {}
        usage = None
        if where is not None:
            files, counts = self._write_files(b, where)
            usage = self._usage(where[0])
        stamp = int(at)
        stamps = {BatchStatus.COMPLETED: "completed_at", BatchStatus.CANCELLED: "cancelled_at",
                  BatchStatus.EXPIRED: "expired_at"}

        changed = []

        def ended(cur: BatchRecord) -> BatchRecord | None:
            if cur.final:
                return None
            changed.append(cur.id)
            return replace(cur, status=final, **{stamps[final]: stamp}, **files, usage=usage,
                           total=counts.get("prompts", cur.total), completed=counts.get("succeeded", 0),
                           failed=counts.get("failed", 0))

        rec = self.registry.update(b.id, ended)
        if changed and rec.status is BatchStatus.COMPLETED:
            self.tenancy.ratio.add_batch(rec, self.registry.files.get(rec.input_file_id))
        self.store.checkpoint()
        log.info("batch %s %s: %d succeeded, %d failed%s", b.id, final, counts.get("succeeded", 0),
                 counts.get("failed", 0), taken)

    def _stored_span(self, b: BatchRecord) -> tuple[Span, int] | None:
        """A batch that ends before its record has a span: stored anyway (serve restarted between the
        store's commit and the record's), or not at all. Its span and input id."""
        assert self.store is not None
        with self.store.read():
            span, n = self.store.span_of(b.prefix)
            row = self.store.db.execute("SELECT id FROM files WHERE name = ?", (b.id,)).fetchone()
        return (span, row[0]) if n and span is not None and row is not None else None

    def _write_files(self, b: BatchRecord, where: tuple[Span, int]) -> tuple[dict[str, Any], dict[str, int]]:
        assert self.store is not None
        out_id, err_id = derived_file_id(b.id, "output"), derived_file_id(b.id, "error")
        out, err = self.registry.file_path(out_id), self.registry.file_path(err_id)
        s = write_export(self.store, out, errors=err, span=where, rewrite=_strip_prefix(b.prefix), private=True)
        now = int(time.time())
        ids: dict[str, Any] = {}
        for key, fid, path, n, name in (("output_file_id", out_id, out, s.written, "output"),
                                        ("error_file_id", err_id, err, s.errors_written, "error")):
            if n:
                self.registry.add_file(FileRecord(id=fid, owner=b.owner, filename=f"{b.id}_{name}.jsonl",
                                                  bytes=path.stat().st_size, purpose=OUTPUT_PURPOSE, created_at=now))
                ids[key] = fid
            else:
                path.unlink(missing_ok=True)
                ids[key] = None
        return ids, {"prompts": s.succeeded + s.failed + s.cancelled + s.pending, "succeeded": s.succeeded,
                     "failed": s.failed}

    def _usage(self, span: Span) -> dict[str, Any]:
        """OpenAI's `usage` of a batch: the tokens of its answered requests, summed by SQLite."""
        assert self.store is not None

        def total(path: str) -> str:
            return f"COALESCE(SUM(json_extract(CAST(line AS TEXT), '$.response.body.usage.{path}')), 0)"

        with self.store.read():
            prompt, completion, cached, reasoning = self.store.db.execute(
                f"SELECT {total('prompt_tokens')}, {total('completion_tokens')}, "
                f"{total('prompt_tokens_details.cached_tokens')}, "
                f"{total('completion_tokens_details.reasoning_tokens')} FROM results WHERE seq BETWEEN ? AND ?",
                span).fetchone()
        return {"input_tokens": int(prompt), "input_tokens_details": {"cached_tokens": int(cached)},
                "output_tokens": int(completion), "output_tokens_details": {"reasoning_tokens": int(reasoning)},
                "total_tokens": int(prompt) + int(completion)}


def _span(b: BatchRecord) -> Span:
    assert b.lo is not None and b.hi is not None
    return Span(b.lo, b.hi)


def _unless_final(cur: BatchRecord, **changes: Any) -> BatchRecord | None:
    return None if cur.final else replace(cur, **changes)


def _strip_prefix(prefix: str) -> Callable[[bytes], bytes]:
    """An export line with its custom_id given back without the batch's prefix. The stored line's
    second key is `custom_id` (after `id`, whose value cannot hold this text): its first occurrence."""
    needle = b'"custom_id":' + orjson.dumps(prefix)[:-1]

    def rewrite(line: bytes) -> bytes:
        if needle in line:
            return line.replace(needle, b'"custom_id":"', 1)
        d = orjson.loads(line)  # a line written some other way: the slow road
        cid = d.get("custom_id")
        if isinstance(cid, str) and cid.startswith(prefix):
            d["custom_id"] = cid[len(prefix):]
        return orjson.dumps(d)

    return rewrite
