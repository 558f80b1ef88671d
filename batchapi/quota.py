"""A tenant's quotas, checked when a batch is created: what it has queued, what the batch adds.

    queued requests       the requests of its unfinished batches without a result yet: a validating
                          batch's file counts whole, an in_progress one its total less its completed and
                          failed (request_counts, at most a second old)
    queued prompt tokens  the same requests' conversations in bytes (counted at upload, `Tally`; a running
                          batch's in proportion to what is left of it) over the bytes per prompt token the
                          fleet measured (`TokenRatio`: the input tokens of the batches that ended over
                          their conversations' bytes; DEFAULT_BYTES_PER_TOKEN until one ended)

A batch over either quota is refused at creation (400, `request_limit_exceeded` or
`token_limit_exceeded`), with the figures. Everything here reads the registry's memory: no disk.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .objects import BatchRecord, BatchStatus, FileRecord
from .tenants import DEFAULT_TENANT, Tenant

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "Queued",
    "Tally",
    "TokenRatio",
    "conversation_bytes",
    "count_file",
    "queued_of",
    "quota_problem",
    "tenant_name",
]

DEFAULT_BYTES_PER_TOKEN = 4.0
CHUNK = 1 << 20
YIELD_EVERY = 256  # lines counted between two offers of the GIL (~1 ms)


_CONVERSATION = (b'"messages"', b'"prompt"', b'"input"')


def conversation_bytes(line: bytes) -> int:
    """Bytes of a request line from its conversation on (its body's `messages`, `prompt` or `input` to
    the end of the line; the whole line when it has none: validation refuses it later). No JSON is
    parsed: what is counted is calibrated by the measured bytes per token (`TokenRatio`), which counts
    the same way."""
    for key in _CONVERSATION:
        at = line.find(key)
        if at >= 0:
            return len(line.rstrip()) - at
    return len(line)


class Tally:
    """An upload's requests (its lines that are not blank) and their conversations' bytes, counted from
    its chunks as they are written."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt_bytes = 0
        self._rest = b""

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        lines = (self._rest + bytes(data)).split(b"\n")
        self._rest = lines.pop()
        for i, line in enumerate(lines, 1):
            self._line(line)
            if i % YIELD_EVERY == 0:
                time.sleep(0)  # the GIL to the API's loop now, not at the next switch interval: polls wait less

    def close(self) -> tuple[int, int]:
        if self._rest:
            self._line(self._rest)
            self._rest = b""
        return self.requests, self.prompt_bytes

    def _line(self, line: bytes) -> None:
        if line.strip():
            self.requests += 1
            self.prompt_bytes += conversation_bytes(line)


def count_file(path: Path) -> tuple[int, int]:
    """(requests, conversation bytes) of a file uploaded before uploads were counted (reads the disk)."""
    tally = Tally()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            tally.feed(chunk)
    return tally.close()


class TokenRatio:
    """The fleet's bytes of conversation per prompt token, from the batches that ended (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes = 0.0
        self.tokens = 0

    def add(self, conversation_bytes: float, prompt_tokens: int) -> None:
        if conversation_bytes > 0 and prompt_tokens > 0:
            with self._lock:
                self.bytes += conversation_bytes
                self.tokens += prompt_tokens

    def add_batch(self, b: BatchRecord, f: FileRecord | None) -> None:
        """A batch that ended: its answered requests' input tokens against their share of its file's bytes."""
        usage: dict[str, Any] = b.usage or {}
        if f is None or not f.requests or not f.prompt_bytes or not b.completed:
            return
        self.add(f.prompt_bytes * min(1.0, b.completed / f.requests), int(usage.get("input_tokens") or 0))

    @property
    def bytes_per_token(self) -> float:
        with self._lock:
            return self.bytes / self.tokens if self.tokens else DEFAULT_BYTES_PER_TOKEN

    def tokens_of(self, conversation_bytes: float) -> int:
        return round(conversation_bytes / self.bytes_per_token)


@dataclass(frozen=True, slots=True)
class Queued:
    requests: int = 0
    prompt_bytes: float = 0.0


def tenant_name(b: BatchRecord) -> str:
    return b.tenant or DEFAULT_TENANT


def left_of(b: BatchRecord, f: FileRecord | None) -> Queued:
    """What of one unfinished batch has no result yet."""
    if b.status is BatchStatus.VALIDATING:
        return Queued(f.requests or 0, f.prompt_bytes or 0) if f is not None else Queued()
    if b.status is not BatchStatus.IN_PROGRESS:
        return Queued()  # finalizing, cancelling: nothing more runs
    left = max(0, b.total - b.completed - b.failed)
    part = left / b.total if b.total else 0.0
    return Queued(left, (f.prompt_bytes or 0) * part if f is not None else 0.0)


def queued_of(unfinished: list[BatchRecord], files: dict[str, FileRecord], tenant: str) -> Queued:
    """The tenant's queued requests and conversation bytes, over the unfinished batches given."""
    requests, size = 0, 0.0
    for b in unfinished:
        if tenant_name(b) == tenant:
            q = left_of(b, files.get(b.input_file_id))
            requests += q.requests
            size += q.prompt_bytes
    return Queued(requests, size)


def quota_problem(tenant: Tenant, queued: Queued, adds: Queued, ratio: TokenRatio) -> tuple[str, str] | None:
    """(code, message) when the batch adding `adds` to `queued` passes one of the tenant's quotas."""
    cap = tenant.max_queued_requests
    if cap is not None and queued.requests + adds.requests > cap:
        return "request_limit_exceeded", (
            f"tenant {tenant.name} has {queued.requests:,} requests queued, this batch adds {adds.requests:,}, "
            f"its quota is {cap:,}: wait for its batches to finish, or cancel one")
    cap = tenant.max_queued_prompt_tokens
    if cap is not None:
        have, more = ratio.tokens_of(queued.prompt_bytes), ratio.tokens_of(adds.prompt_bytes)
        if have + more > cap:
            return "token_limit_exceeded", (
                f"tenant {tenant.name} has {have:,} prompt tokens queued, this batch adds {more:,}, its quota is "
                f"{cap:,} (estimated at {ratio.bytes_per_token:.2f} bytes per token): wait for its batches to "
                "finish, or cancel one")
    return None
