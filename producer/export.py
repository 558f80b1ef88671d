"""`producer export`: the OpenAI batch output file, one line per prompt that has a result (a prompt of a
cancelled run that had none exports with error code `cancelled`).

With `--errors FILE` the failed prompts' lines go to FILE instead, as the OpenAI Batch API splits
its output and error files: an HTTP error answer (its status and the server's body in `response`)
and a request with no usable answer (`error`) go to FILE, successes to the output; without it every
line is in the one output. The suffix of each file picks
its format: `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (extra `zstd`), `.parquet` (extra `parquet`).

Lines come out in input order (the store's `seq`), each exactly `Result.batch_output_line()` as the
collector stored it; only prompts enqueued into the store can have one (see collect.py). The file is
written next to its destination and renamed into place, so a reader never sees half an export.
With Redis up, results waiting in Redis are collected first; with Redis down, the store alone is
exported (read-only). `write_export` is the writing half alone, also for one `Span` of the store
(a `batchfleet serve` batch: its lines rewritten, its files private).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from batchfleet.keys import Keys

from .collect import collect_once
from .inputs import compression_of, open_output
from .store import Span, Store

__all__ = ["PARQUET_COLUMNS", "ExportError", "ExportSummary", "check_target", "export", "write_empty", "write_export"]


class ExportError(Exception):
    """A destination that cannot be written (a directory, no permission, a missing extra): the
    message says which and why; `producer export` exits 2 with it."""

SHOW_PENDING = 5


@dataclass
class ExportSummary:
    path: Path
    written: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0  # prompts `producer cancel` took back: their lines say error code `cancelled`
    pending: int = 0
    rejected: int = 0  # results dropped over the run because they answered no prompt of it
    first_pending: list[str] = field(default_factory=list)
    errors_path: Path | None = None
    errors_written: int = 0  # lines written to errors_path (failed prompts)


def check_target(path: Path, what: str) -> None:
    """Refuse, before any work, a destination that cannot be written: a directory, or a directory
    that cannot be created or written to."""
    if path.is_dir():
        raise ExportError(f"{what} {path}: is a directory; give a file name")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"{what} {path}: cannot create its directory {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{what} {path}: the directory {parent} is not writable")
    if compression_of(path) == "parquet":
        _pyarrow()


def _pyarrow() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError("writing .parquet needs pyarrow: pip install 'batchfleet[parquet]'") from None
    return pa, pq


class _Target:
    """One destination written next to itself and renamed into place (a reader never sees half)."""

    def __init__(self, path: Path, *, private: bool = False) -> None:
        self.path = path
        fd, self.tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        if not private:  # mkstemp's 0600 would make the export private to this user
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
        self.rows: list[dict[str, Any]] | None = None
        self.stack = contextlib.ExitStack()
        if compression_of(path) == "parquet":
            os.close(fd)
            self.rows = []
            self._parquet: Any = None
        else:
            self.fh = self.stack.enter_context(open_output(fd, path))

    def write(self, line: bytes) -> None:
        if self.rows is not None:
            self.rows.append(_parquet_row(orjson.loads(line)))
            if len(self.rows) >= PARQUET_ROWS:
                self._flush_rows()
        else:
            self.fh.write(line)
            self.fh.write(b"\n")

    def _flush_rows(self) -> None:
        """Parquet in row groups of PARQUET_ROWS: the export holds one group at a time, never the whole
        run (a million embeddings are gigabytes of vectors)."""
        assert self.rows is not None
        pa, pq = _pyarrow()
        schema = pa.schema([(name, pa.int64() if name == "status_code" else pa.string()) for name in PARQUET_COLUMNS])
        if self._parquet is None:
            self._parquet = self.stack.enter_context(pq.ParquetWriter(self.tmp, schema))
        self._parquet.write_table(pa.Table.from_pylist(self.rows, schema=schema))
        self.rows.clear()

    def commit(self) -> None:
        if self.rows is not None and (self.rows or self._parquet is None):
            self._flush_rows()
        self.stack.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.stack.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


PARQUET_ROWS = 10_000  # rows per Parquet row group (what the export holds at once)

# Parquet columns: the batch output line flattened; bodies stay JSON text.
PARQUET_COLUMNS = ("id", "custom_id", "status_code", "request_id", "body", "error_code", "error_message")


def _parquet_row(rec: dict[str, Any]) -> dict[str, Any]:
    resp, err = rec.get("response") or {}, rec.get("error") or {}
    body = resp.get("body")
    return {"id": rec.get("id"), "custom_id": rec.get("custom_id"), "status_code": resp.get("status_code"),
            "request_id": resp.get("request_id"), "body": None if body is None else orjson.dumps(body).decode(),
            "error_code": err.get("code"), "error_message": err.get("message")}


def write_empty(*paths: Path | None) -> None:
    """The export of a run with no prompts: each given file, empty (in its format)."""
    targets = [_Target(p) for p in paths if p is not None]
    try:
        for t in targets:
            t.commit()
    except BaseException:
        for t in targets:
            t.abort()
        raise


def export(r: redis.Redis | None, store: Store, keys: Keys, out: Path, *, wait: bool = False,
           timeout_s: float | None = None, poll_s: float = 2.0, errors: Path | None = None) -> ExportSummary:
    """Collect (unless `r` is None; with `wait`: until nothing is pending or `timeout_s` passes), then
    write `out` (and, with `errors`, the failed prompts' lines there instead of into `out`). The
    suffix picks the format: .jsonl, .jsonl.gz, .jsonl.zst, .parquet. Raises ExportError (before
    collecting anything) when a destination cannot be written."""
    check_target(out, "output")
    if errors is not None:
        check_target(errors, "errors file")
        if errors.absolute() == out.absolute():
            raise ExportError(f"--errors {errors} is the output file itself; give another name")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while r is not None:
        collect_once(r, store, keys)
        with store.read():
            pending = store.counts()["pending"]
        if not wait or pending == 0 or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
    return write_export(store, out, errors=errors)


def write_export(store: Store, out: Path, *, errors: Path | None = None, span: tuple[Span, int] | None = None,
                 rewrite: Callable[[bytes], bytes] | None = None, private: bool = False) -> ExportSummary:
    """Write the store's result lines (only those of `span`, when given: a span and the input it holds)
    to `out`, the failed ones to `errors` when given, each line through `rewrite` when given;
    `private`: the files are 0600. Counts and lines come from one read snapshot."""
    targets: list[_Target] = []
    try:
        main = _Target(out, private=private)
        targets.append(main)
        failed = main
        if errors is not None:
            failed = _Target(errors, private=private)
            targets.append(failed)
        with store.read():
            # one read snapshot: the counts and the lines agree even while a collector writes
            counts = store.counts() if span is None else store.counts_in(*span)
            summary = ExportSummary(path=out, succeeded=counts["succeeded"], failed=counts["failed"],
                                    cancelled=counts["cancelled"],
                                    pending=counts["pending"], rejected=store.rejected_results(),
                                    first_pending=store.pending_examples(SHOW_PENDING) if span is None else [],
                                    errors_path=errors)
            for ok, line in store.result_rows(None if span is None else span[0]):
                if rewrite is not None:
                    line = rewrite(line)
                if errors is not None and not ok:
                    failed.write(line)
                    summary.errors_written += 1
                else:
                    main.write(line)
                    summary.written += 1
        for t in targets:
            t.commit()
    except BaseException:
        for t in targets:
            t.abort()
        raise
    return summary
