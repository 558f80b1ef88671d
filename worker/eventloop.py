"""The worker's event loop: uvloop when it is installed (and not refused), else the standard one.

Nothing in the worker depends on which it is; uvloop only costs less per wakeup, and a worker
wakes once or twice per prompt (~10% less CPU per prompt at 1,000 prompts/s, docs/benchmarks.md).
`BATCHFLEET_EVENT_LOOP`: auto (default), uvloop (an error without it), asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from batchfleet.errors import ConfigError

__all__ = ["loop_factory"]


def loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """For `asyncio.Runner(loop_factory=...)`: uvloop's loop, or None for the standard one."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("BATCHFLEET_EVENT_LOOP=uvloop, but uvloop is not installed "
                              "(pip install uvloop)") from None
        return None
    return uvloop.new_event_loop
