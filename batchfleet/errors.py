"""Exceptions say what to do about them.

    BatchfleetError
    ├── ConfigError          fix the configuration; nothing will work until then
    ├── RetryableError       transient (connection reset, 5xx, 503 queue full): retry with backoff
    ├── PromptError          this prompt can never succeed (HTTP 400, too long): fail it once, keep going
    ├── JobRefused           the job is not ours (function not on the allow-list): fail it, never run it
    ├── RecordError          a record read from Redis is malformed or not allowed: skip it, keep what you had
    └── ServerError          the SGLang server is unusable: stop taking work, restart the server
        ├── ServerStartError     it did not become ready (exited, out of memory, timed out)
        └── ServerDied           it was ready and then went away or stopped generating

A prompt that fails for good gets a result whose error names one `ErrorCode` (the export's
`error.code`).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "BatchfleetError",
    "ConfigError",
    "ErrorCode",
    "JobRefused",
    "PromptError",
    "RecordError",
    "RetryableError",
    "ServerDied",
    "ServerError",
    "ServerStartError",
]


class ErrorCode(StrEnum):
    """The `code` of a failed prompt's error, in its result and its export line."""

    INVALID_PROMPT = "invalid_prompt"  # PromptError: the server refused it for good (HTTP 400, too long)
    RETRIES_EXHAUSTED = "retries_exhausted"  # RetryableError, max_attempts times
    SERVER_CRASH = "server_crash"  # quarantined: its server died with it inside, the last time alone
    CANCELLED = "cancelled"  # `producer cancel` took it back before it had a result
    # a /v1/embeddings request on a generation fleet, or a generation request on an embedding one: never sent
    WRONG_KIND = "wrong_endpoint_kind"
    # a `batchfleet serve` batch's request that never ran, in OpenAI's words (its error file's lines)
    BATCH_CANCELLED = "batch_cancelled"  # the batch was cancelled before it had a result
    BATCH_EXPIRED = "batch_expired"  # the batch's completion window ended before it had a result


class BatchfleetError(Exception):
    """Root of every error batchfleet raises on purpose."""


class ConfigError(BatchfleetError):
    """The configuration is wrong: fix it and start again."""


class RetryableError(BatchfleetError):
    """A transient failure: the same request may succeed later."""

    def __init__(self, message: str, *, status_code: int | None = None, body: object = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body  # the server's answer (its JSON), when it gave one


class PromptError(BatchfleetError):
    """The server refused this prompt for good (e.g. longer than the context): fail it once."""

    def __init__(self, message: str, *, status_code: int, body: object = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class JobRefused(BatchfleetError):
    """The job names a function that batchfleet does not run."""


class RecordError(BatchfleetError, ValueError):
    """A record read from Redis (written by another process, maybe another version or a forger) is
    malformed or asks for something not allowed. Skip it with a warning; never exit on it."""


class ServerError(BatchfleetError):
    """The SGLang server cannot serve: hand work back and restart it."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- server log (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class ServerStartError(ServerError):
    """The server never became ready."""


class ServerDied(ServerError):
    """The server was ready, then exited or stopped generating."""
