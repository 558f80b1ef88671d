"""A batch's input file into the run's store, whole or not at all.

Every line is read as `producer enqueue` reads it (`producer.inputs.Lines`: a byte order mark, CRLF,
a line too long to be a request) and parsed by the same rules (`producer.parse.parse_line`, batch
form only, as OpenAI's input is). A line also fails when its `url` is not the batch's endpoint, when
its `custom_id` is already on an earlier line, or past the request limit. One bad line fails the
batch: `errors.data` lists the bad lines (the first MAX_ERRORS) with their numbers, and nothing of
the file is stored.

The prompts go into the store in ONE write transaction as they are read: a crash leaves the whole
batch or none of it, and its prompts hold consecutive seqs (the batch's `Span`; the store's writer
lock keeps every other writer out meanwhile). Each is stored under `<batch id>:<custom_id>`, so two
batches may use the same custom_ids; the store records the batch as one input (its id, the file's
path and the fingerprint of its requests). A batch whose prompts are in the store already (serve
restarted after the commit) is found there, not stored twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchfleet.records import ENDPOINTS
from producer.enqueue import BATCH, cost_of
from producer.inputs import MAX_LINE_BYTES, Lines
from producer.parse import Reject, parse_line
from producer.store import FileFingerprint, Span, Store, canonical_request

__all__ = ["MAX_ERRORS", "Validated", "validate_into"]

MAX_ERRORS = 100  # errors.data holds at most this many lines
_EP = {url: i for i, url in enumerate(ENDPOINTS)}


@dataclass
class Validated:
    input_id: int | None = None
    span: Span | None = None
    prompts: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)


class _Invalid(Exception):
    """Some line is bad: roll the batch's transaction back."""


def _error(out: Validated, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
    if len(out.errors) < MAX_ERRORS:
        out.errors.append({"code": code, "line": line, "message": message, "param": param})


def validate_into(store: Store, batch_id: str, endpoint: str, path: Path, *, max_requests: int,
                  model: str) -> Validated:
    """Validate the file at `path` as batch `batch_id`'s input and store its prompts (see the module
    doc). `model`: body.model of a line without one."""
    out = Validated()
    prefix = batch_id + ":"
    try:
        with store.write():
            out.input_id = store.file_id(batch_id)
            span, n = store.span_of(prefix)
            if n:  # stored before serve restarted: the same prompts, found again
                out.span, out.prompts = span, n
                out.model = _model_of(store, span)
                return out
            lo = store.max_seq() + 1
            _read(store, out, prefix, endpoint, path, max_requests=max_requests, model=model)
            if out.errors:
                out.errors.sort(key=lambda e: e["line"] or 0)
                raise _Invalid
            if not out.prompts:
                _error(out, "empty_file", "the input file holds no request")
                raise _Invalid
            out.span = Span(lo, store.max_seq())
            if out.span.size != out.prompts:  # the writer lock keeps every other writer out: never
                raise RuntimeError(f"batch {batch_id}: {out.prompts} prompts stored over seqs {out.span}")
    except _Invalid:
        out.span, out.input_id, out.prompts = None, None, 0
    return out


def _read(store: Store, out: Validated, prefix: str, endpoint: str, path: Path, *, max_requests: int,
          model: str) -> None:
    file_fp = FileFingerprint()
    rows: list[tuple[str, int, bytes, int, int, int, bytes]] = []
    assert out.input_id is not None
    ep, input_id, errors, append = _EP[endpoint], out.input_id, out.errors, rows.append
    with Lines(str(path)) as lines:
        for lineno, raw, length in lines:
            if not raw or raw.isspace():
                continue
            if length > len(raw):
                _error(out, "invalid_request", f"line of {length:,} bytes is longer than any request may be "
                       f"({MAX_LINE_BYTES:,})", lineno)
                continue
            try:
                cid, url, body = parse_line(raw, {}, model, batch_only=True)
            except Reject as exc:
                bad_json = str(exc).startswith(("not JSON", "not a JSON object"))
                _error(out, "invalid_json_line" if bad_json else "invalid_request", str(exc), lineno)
                continue
            if url != endpoint:
                _error(out, "invalid_url", f"url {url} is not the batch's endpoint {endpoint}", lineno, "url")
                continue
            out.prompts += 1
            if out.prompts > max_requests:
                _error(out, "too_many_requests", f"the batch holds more than {max_requests:,} requests (the limit: "
                       "batchfleet serve --max-requests)", lineno)
                return
            if out.model is None:
                out.model = body.get("model") if isinstance(body.get("model"), str) else None
            if len(errors) >= MAX_ERRORS:
                return  # the batch fails; enough said
            canon, fp = canonical_request(url, body)
            append((prefix + cid, ep, canon, input_id, lineno, cost_of(body), fp))
            if len(rows) >= BATCH:
                _insert(store, out, rows, prefix, file_fp)
        _insert(store, out, rows, prefix, file_fp)
        if not out.errors:
            store.record_input(out.input_id, lines.path, file_fp, time.time())


def _insert(store: Store, out: Validated, rows: list[tuple[str, int, bytes, int, int, int, bytes]],
            prefix: str, file_fp: FileFingerprint) -> None:
    """Store these rows and add them to the file's fingerprint; a custom_id already stored (an earlier
    line of this batch) is an error."""
    if not rows:
        return
    cut = len(prefix)
    file_fp.add_many((r[0][cut:], r[6]) for r in rows)
    n = store.insert_prompts(rows)  # also once the batch has failed (rolled back at the end): repeats show
    if n < len(rows):
        known = store.known([r[0] for r in rows])
        for cid, _, _, _, line, _, _ in rows:
            first = known[cid].line
            if first != line:
                _error(out, "duplicate_custom_id", f"custom_id {cid[len(prefix):]!r} is already on line {first}", line,
                       "custom_id")
    rows.clear()


def _model_of(store: Store, span: Span | None) -> str | None:
    if span is None:
        return None
    row = store.db.execute("SELECT body FROM prompts WHERE seq = ?", (span.lo,)).fetchone()
    model = orjson.loads(row[0]).get("model") if row else None
    return model if isinstance(model, str) else None
