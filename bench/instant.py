"""Job functions and backends that take no time: for measuring dispatch overhead alone."""

from __future__ import annotations

from typing import Any

REPLY = {"choices": [{"text": "ok", "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}


def instant(prompt: dict[str, Any]) -> dict[str, Any]:
    """What RQ's SimpleWorker runs in the baseline: returns at once."""
    return REPLY


async def instant_backend(prompt: Any) -> dict[str, Any]:
    """What batchfleet's dispatcher calls in place of a server: returns at once."""
    return REPLY
