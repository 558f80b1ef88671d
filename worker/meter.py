"""The worker's tokens/s: the slope of its server's `generation_tokens_total` counter over ~10 s
(smooth, known before the first prompt finishes); completions over time for servers without it. And
what its server prefilled and took from its radix cache (`PrefillCounter`), for the run's figures."""

from __future__ import annotations

import time
from collections import deque

__all__ = ["PrefillCounter", "ThroughputMeter"]


class ThroughputMeter:
    def __init__(self, *, window_s: float = 10.0, completions_window_s: float = 30.0) -> None:
        self.window_s = window_s
        self.completions_window_s = completions_window_s
        self._generated: deque[tuple[float, float]] = deque()  # (monotonic s, generation_tokens_total)
        self._completions: deque[tuple[float, int]] = deque()  # (monotonic s, completion tokens)

    def note_counter(self, total: float | None) -> None:
        now = time.monotonic()
        if total is None or (self._generated and total < self._generated[-1][1]):
            self._generated.clear()  # no counter, or a new server process: start over
        if total is not None:
            self._generated.append((now, total))
        while len(self._generated) > 2 and self._generated[0][0] < now - self.window_s:
            self._generated.popleft()

    def note_completion(self, tokens: int) -> None:
        self._completions.append((time.monotonic(), tokens))

    def tokens_per_s(self) -> float:
        if len(self._generated) >= 2:
            (t0, n0), (t1, n1) = self._generated[0], self._generated[-1]
            if t1 > t0:
                return (n1 - n0) / (t1 - t0)
        now = time.monotonic()
        while self._completions and self._completions[0][0] < now - self.completions_window_s:
            self._completions.popleft()
        if not self._completions:
            return 0.0
        span = max(now - self._completions[0][0], min(self.completions_window_s, 1.0))
        return sum(t for _, t in self._completions) / span


class PrefillCounter:
    """Prompt tokens the server prefilled and, of them, those its radix cache gave (its counters
    `sglang:prompt_tokens_total`, `sglang:cached_tokens_total`), as the increase since the last scrape;
    a counter that went back is a new server process, counting from 0. The increases wait in `pending`
    until they are added to the run's stats (`taken`), so an outage loses none."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None
        self.pending = [0, 0]  # prompt tokens, cached tokens

    def note(self, prompt_total: float | None, cached_total: float | None) -> None:
        if prompt_total is None:
            return
        now = (prompt_total, cached_total or 0.0)
        last = self._last
        for i in (0, 1):
            before = last[i] if last is not None and now[i] >= last[i] else 0.0
            self.pending[i] += int(now[i] - before)
        self._last = now

    def taken(self, prompt: int, cached: int) -> None:
        """These were added to the run's stats."""
        self.pending[0] -= prompt
        self.pending[1] -= cached
