"""SGLang-style log lines on stderr: `[YYYY-mm-dd HH:MM:SS] message` (` DPn`/` TPn` when >1)."""

from __future__ import annotations

import sys
import time

__all__ = ["log"]


def log(message: str, *, dp_rank: int | None = None, tp_rank: int | None = None) -> None:
    """Write one line; ranks are printed only when the caller says the server has several."""
    tags = ""
    if dp_rank is not None:
        tags += f" DP{dp_rank}"
    if tp_rank is not None:
        tags += f" TP{tp_rank}"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    sys.stderr.write(f"[{stamp}{tags}] {message}\n")
    sys.stderr.flush()
