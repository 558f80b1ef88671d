"""The worker's event loop: uvloop when it is installed (and not refused), else the standard one; and
where a task that does not end waits (`where_it_waits`, for the log).

Nothing in the worker depends on which it is; uvloop only costs less per wakeup, and a worker
wakes once or twice per prompt (~10% less CPU per prompt at 1,000 prompts/s, docs/benchmarks.md).
`BATCHFLEET_EVENT_LOOP`: auto (default), uvloop (an error without it), asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from batchfleet.errors import ConfigError

__all__ = ["loop_factory", "where_it_waits"]


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


def where_it_waits(task: asyncio.Task[object]) -> str:
    """Where a suspended task waits: the innermost coroutines of its await chain, `file:line function`,
    outermost first."""
    frames, coro = [], task.get_coro()
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"
                      for f in frames[-4:]) or "(no frame)"
