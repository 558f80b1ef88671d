"""The API's objects as OpenAI documents them (`openai.types.FileObject`, `openai.types.Batch`), and
their records here.

A `FileRecord` is an uploaded input file or an output/error file a batch wrote; a `BatchRecord` is a
batch with its status, its timestamps and, once validated, where its prompts are in the store (the
store's input id and the `Span` of seqs its prompts hold). Both belong to the key that made them
(`owner`: the SHA-256 of that key, "" when the API runs without keys); nobody else sees them. A batch
also records its key's tenant (`tenant`), whose share of the fleet it runs in; its API object does not
show it (OpenAI's `Batch`, field by field).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import orjson

from batchfleet.records import ENDPOINTS

__all__ = ["BATCH_PURPOSE", "ENDPOINTS", "FINAL", "OUTPUT_PURPOSE", "BatchRecord", "BatchStatus", "FileRecord",
           "derived_file_id", "new_batch_id", "new_file_id"]

BATCH_PURPOSE = "batch"  # what an input file is uploaded for
OUTPUT_PURPOSE = "batch_output"  # the output and error files a batch writes
WINDOWS = ("24h",)  # completion windows OpenAI takes (serve's length of it is configurable)


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    """`batch_` and 24 hex digits: fixed length and no ':' (the store's custom_ids are `<batch id>:<custom_id>`)."""
    return "batch_" + secrets.token_hex(12)


def derived_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: derived from the batch, so a finalization done again
    after a crash writes the same file, not a second one."""
    return "file-" + hashlib.blake2b(f"{batch_id}:{kind}".encode(), digest_size=12).hexdigest()


@dataclass(slots=True)
class FileRecord:
    id: str
    owner: str  # SHA-256 of the API key that made it ("" without keys)
    filename: str
    bytes: int
    purpose: str
    created_at: int
    # Counted at upload, for the quotas: its lines that may be requests, and the bytes of their
    # conversations (each body's `messages` or `prompt` as JSON). None: not counted (an older upload).
    requests: int | None = None
    prompt_bytes: int | None = None

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> FileRecord:
        """A stored record; a field this serve does not know (a newer one wrote it) is ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def to_api(self) -> dict[str, Any]:
        """`openai.types.FileObject`."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass(slots=True)
class BatchRecord:
    id: str
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    metadata: dict[str, str] | None = None
    status: BatchStatus = BatchStatus.VALIDATING
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None  # validation errors: {code, line, message, param}
    total: int = 0
    completed: int = 0
    failed: int = 0
    usage: dict[str, Any] | None = None
    model: str | None = None
    # Where its prompts are in the store, once validated: the input's id and its span of seqs.
    input_id: int | None = None
    lo: int | None = None
    hi: int | None = None
    tenant: str | None = None  # its key's tenant when it was created (None: made before tenants, "default")
    extra: dict[str, Any] = field(default_factory=dict)  # fields a newer serve wrote: kept, not shown

    @property
    def final(self) -> bool:
        return self.status in FINAL

    @property
    def prefix(self) -> str:
        """What its custom_ids are stored under: `<batch id>:`."""
        return self.id + ":"

    def to_api(self) -> dict[str, Any]:
        """`openai.types.Batch`."""
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
            "errors": None if self.errors is None else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": str(self.status), "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": self.created_at, "in_progress_at": self.in_progress_at, "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at, "completed_at": self.completed_at, "failed_at": self.failed_at,
            "expired_at": self.expired_at, "cancelling_at": self.cancelling_at, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "usage": self.usage, "metadata": self.metadata,
        }

    def to_json(self) -> bytes:
        d = asdict(self)
        d.update(d.pop("extra"))
        return orjson.dumps(d)

    @classmethod
    def from_json(cls, raw: bytes | str) -> BatchRecord:
        d = orjson.loads(raw)
        known = {f.name for f in fields(cls)} - {"extra"}
        rec = cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})
        rec.status = BatchStatus(rec.status)
        return rec
