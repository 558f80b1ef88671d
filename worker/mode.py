"""What holds a worker's claim loop back (`Mode`), and the one object that changes it (`ModeGate`).

The parts have their own causes and ends, so several can hold at once (a cancelled run whose server
restarts is PAUSED | CANCELLED). Only the gate's methods change the mode; whoever waits for a mode
waits on the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from enum import Flag

__all__ = ["HELD", "STOPPED", "Mode", "ModeGate"]


class Mode(Flag):
    """RUNNING (none of the parts): the loop claims."""

    RUNNING = 0
    # The server does not serve (not started yet, dead, restarting, at fault) or the worker stops: no
    # claims, prompts waiting to retry wait too. `pause`; ended by `resume`.
    PAUSED = 1
    # A request got no answer: is the server still there? No claims until the keeper has looked
    # (`server_checked`, or `resume` after a restart), so a dead server does not swallow a stream of
    # new claims. `report_trouble`.
    TROUBLE = 2
    # A drain is under way (with PAUSED): prompts waiting to retry go back at once. `begin_drain`.
    DRAINING = 4
    # The run was cancelled: claim nothing of it. `cancel`; ended by `uncancel` (its flag went away).
    CANCELLED = 8


HELD = Mode.PAUSED | Mode.TROUBLE | Mode.DRAINING  # no claims; CANCELLED drops what a claim brings
STOPPED = Mode.PAUSED | Mode.DRAINING


class ModeGate:
    """The claim loop's mode, its changes, and the waits on it. It starts PAUSED: the keeper resumes
    it once its server serves."""

    def __init__(self) -> None:
        self._mode = Mode.PAUSED
        self._changed = asyncio.Event()  # set, and replaced, at each change of mode

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def cancelled(self) -> bool:
        return bool(self._mode & Mode.CANCELLED)

    @property
    def draining(self) -> bool:
        return bool(self._mode & Mode.DRAINING)

    @property
    def paused(self) -> bool:
        return bool(self._mode & Mode.PAUSED)

    def _set(self, mode: Mode) -> None:
        if mode is not self._mode:
            self._mode = mode
            self._changed.set()
            self._changed = asyncio.Event()

    async def until(self, ready: Callable[[Mode], bool], timeout_s: float | None = None) -> bool:
        """Wait until `ready(mode)`, at most `timeout_s` (None: no limit); return `ready(mode)`."""
        if not ready(self._mode):
            with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel
                async with asyncio.timeout(timeout_s):
                    while not ready(self._mode):
                        await self._changed.wait()
        return ready(self._mode)

    def pause(self) -> None:
        """Claim nothing, and let prompts waiting to retry wait: the server is not serving, or the
        worker stops."""
        self._set(self._mode | Mode.PAUSED)

    def resume(self) -> None:
        """The server serves (again): claims go on, unless a drain is under way or the run is cancelled.
        A request's trouble before it is over: the server was just (re)started."""
        self._set(self._mode & ~(Mode.PAUSED | Mode.TROUBLE))

    def report_trouble(self) -> None:
        """A request got no answer: claim nothing more until the keeper has looked at the server."""
        self._set(self._mode | Mode.TROUBLE)

    def server_checked(self) -> None:
        """The keeper looked after TROUBLE and the server is alive: claims may go on."""
        self._set(self._mode & ~Mode.TROUBLE)

    async def until_trouble(self, timeout_s: float) -> bool:
        """For the keeper: wait up to `timeout_s` for a request to get no answer; True while TROUBLE
        holds (until `server_checked` or `resume`)."""
        return await self.until(_in_trouble, timeout_s)

    def begin_drain(self) -> None:
        self._set(self._mode | Mode.PAUSED | Mode.DRAINING)

    def end_drain(self) -> None:
        self._set(self._mode & ~Mode.DRAINING)

    def cancel(self) -> None:
        """The run was cancelled: claim nothing of it."""
        self._set(self._mode | Mode.CANCELLED)

    def uncancel(self) -> None:
        """The run's cancel flag went away (purged): claim from it again."""
        self._set(self._mode & ~Mode.CANCELLED)


def _in_trouble(mode: Mode) -> bool:
    return bool(mode & Mode.TROUBLE)
