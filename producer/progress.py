"""Progress on stderr: a rich bar with a rate on a terminal, a plain line every few seconds otherwise
(logs of a batch job should not fill with carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

__all__ = ["Reporter"]


class Reporter:
    """`update(lines, nbytes)` as work advances; `message()` for lines that must not break the bar."""

    def __init__(self, label: str, total_bytes: int | None, *, stream: TextIO | None = None,
                 enabled: bool = True, plain_every_s: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.label = label
        self.start = time.monotonic()
        self.plain_every_s = plain_every_s
        self._last_plain = self.start
        self._bar: Progress | None = None
        if enabled and self.stream.isatty():
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                TextColumn("{task.fields[lines]:,} lines  {task.fields[rate]:,.0f}/s"), TimeRemainingColumn(),
                console=Console(file=self.stream), transient=False,
            )
            self._task = self._bar.add_task(label, total=total_bytes, lines=0, rate=0.0)
            self._bar.start()
        self.enabled = enabled

    def update(self, lines: int, nbytes: int) -> None:
        now = time.monotonic()
        rate = lines / max(now - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, completed=nbytes, lines=lines, rate=rate)
        elif self.enabled and now - self._last_plain >= self.plain_every_s:
            self._last_plain = now
            print(f"{self.label}: {lines:,} lines, {rate:,.0f}/s", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
