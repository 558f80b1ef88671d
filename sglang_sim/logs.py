"""SGLang-style log lines on stderr: `[YYYY-mm-dd HH:MM:SS<prefix>] message`.

The prefix names the scheduler process that logs (` DP0 TP1`, see parallel.Rank.prefix); the
launching process logs without one. Uvicorn's own lines carry its level, padded: `INFO:     ...`.
"""

from __future__ import annotations

import sys
import time

__all__ = ["log", "uvicorn_log"]


def log(message: str, *, prefix: str = "") -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"[{stamp}{prefix}] {message}\n")
    sys.stderr.flush()


def uvicorn_log(level: str, message: str) -> None:
    """A line of uvicorn's loggers as SGLang formats them (`[%(asctime)s] %(levelprefix)s %(message)s`)."""
    log(f"{(level + ':').ljust(9)} {message}")
