"""A batch's input file into the run's store, whole or not at all (`producer.api.enqueue_whole`).

Every line is read and parsed as `producer enqueue` reads a file (a byte order mark, CRLF, a line too
long to be a request, the same request rules; batch form only, as OpenAI's input is). A line also
fails when its `url` is not the batch's endpoint, when its `custom_id` is already on an earlier line,
or past the request limit. One bad line fails the batch: `errors.data` lists the bad lines (the first
MAX_ERRORS) with their numbers and OpenAI's codes, and nothing of the file is stored.

The prompts go into the store in ONE write transaction: a crash leaves the whole batch or none of
it, and its prompts hold consecutive seqs (the batch's `Span`). Each is stored under
`<batch id>:<custom_id>`, so two batches may use the same custom_ids; the store records the batch as
one input (its id, the file's path and the fingerprint of its requests), owned by its tenant at its
priority (`Store.shares`, in the same transaction). A batch whose prompts are in the store already
(serve restarted after the commit) is found there, not stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.api import Fault, Problem, Span, Store, enqueue_whole

__all__ = ["MAX_ERRORS", "Validated", "validate_into"]

MAX_ERRORS = 100  # errors.data holds at most this many lines
# OpenAI's code of each problem, and the field it names
_CODES: dict[Fault, tuple[str, str | None]] = {
    Fault.NOT_JSON: ("invalid_json_line", None),
    Fault.INVALID: ("invalid_request", None),
    Fault.URL: ("invalid_url", "url"),
    Fault.DUPLICATE: ("duplicate_custom_id", "custom_id"),
    Fault.TOO_MANY: ("too_many_requests", None),
    Fault.EMPTY: ("empty_file", None),
}


@dataclass
class Validated:
    input_id: int | None = None
    span: Span | None = None
    prompts: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)


def validate_into(store: Store, batch_id: str, endpoint: str, path: Path, *, max_requests: int,
                  model: str, owner: tuple[str, int] | None = None,
                  adapters: frozenset[str] | None = None) -> Validated:
    """Validate the file at `path` as batch `batch_id`'s input and store its prompts (see the module
    doc). `model`: body.model of a line without one. `owner`: (tenant, priority) of the batch, stored
    with its prompts: the head shares the fleet between tenants from its first feed of them. `adapters`:
    the LoRA adapters a line may name (the fleet's)."""
    whole = enqueue_whole(store, path, name=batch_id, prefix=batch_id + ":", url=endpoint, model=model,
                          max_requests=max_requests, max_problems=MAX_ERRORS, owner=owner, adapters=adapters)
    return Validated(input_id=whole.input_id, span=whole.span, prompts=whole.prompts, model=whole.model,
                     errors=[_error(p) for p in whole.problems])


def _error(p: Problem) -> dict[str, Any]:
    code, param = _CODES[p.fault]
    message = p.message
    if p.fault is Fault.TOO_MANY:
        message += " (the limit: batchfleet serve --max-requests)"
    return {"code": code, "line": p.line, "message": message, "param": param}
