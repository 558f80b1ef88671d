"""Processes on this host, by pid."""

from __future__ import annotations

import contextlib
import os

__all__ = ["pid_alive"]


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running on this host? A zombie (exited, not yet reaped) is not; a
    process of another user is (it exists, even if we may not signal it)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"
    return True
