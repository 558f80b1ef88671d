"""Why a server could not start, in one line a person can act on, read from what SGLang printed and
from the kernel's socket table.

- `fatal_line`: the first start-up line after which waiting longer cannot help (CUDA out of memory,
  the HTTP port in use: uvicorn prints asyncio's lower-case "address already in use").
- `start_failure_reason`: that line, shortened: `CUDA out of memory ... Tried to allocate 2.00 GiB
  (GPU 0 ...)`, `port 30000 in use by pid 4242 (python -m http.server)`, else the last exception line
  of a traceback, else the exit status.
- `port_holder`: the pid listening on a TCP port, from /proc/net/tcp{,6} (the socket's inode) and
  /proc/*/fd (which process holds that inode); None when it cannot be found (another user's process,
  another network namespace).

Pure reading: nothing here starts, stops or signals anything.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["FATAL_MARKERS", "describe_pid", "fatal_line", "port_holder", "port_in_use_reason",
           "start_failure_reason"]

# Lower-cased: matched against the lower-cased line (SGLang's OOM is torch's wording; a busy port is
# asyncio's "[Errno 98] ... address already in use", lower case, through uvicorn).
FATAL_MARKERS = ("cuda out of memory", "outofmemoryerror", "address already in use")
_TRIED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]iB)")
_GPU_HAS = re.compile(r"(GPU \d+ has a total capacity of [\d.]+ [KMGT]iB of which [\d.]+ [KMGT]iB is free)")
_EXC_LINE = re.compile(r"^(?:\[[^\]]*\] )?(?:[\w.]+(?:Error|Exception|Exit)|AssertionError|OSError)\b.*$")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def fatal_line(log_text: str) -> str | None:
    for line in log_text.splitlines()[-300:]:
        low = line.lower()
        if any(marker in low for marker in FATAL_MARKERS):
            return line.strip()
    return None


def port_holder(port: int) -> int | None:
    """The pid of a process listening on `port` (any local address), or None when none is found."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    if os.readlink(fd.path) in wanted:
                        return int(entry.name)
                except OSError:
                    continue
        except OSError:
            continue
    return None


def describe_pid(pid: int) -> str:
    """`pid N (its command line, shortened)`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    cmd = " ".join(argv)
    cmd = cmd if len(cmd) <= 80 else cmd[:77] + "..."
    return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"


def port_in_use_reason(port: int, *, holder: int | None = None) -> str:
    holder = port_holder(port) if holder is None else holder
    return f"port {port} is already in use by " + (describe_pid(holder) if holder else "another process")


def start_failure_reason(log_text: str, *, port: int, exit_status: int | None = None) -> str:
    """One line: why the server's start failed, from its log since the start."""
    line = fatal_line(log_text)
    if line is not None:
        low = line.lower()
        if "address already in use" in low:
            return port_in_use_reason(port)
        if "out of memory" in low or "outofmemoryerror" in low:
            tried = _TRIED.search(line)
            gpu = _GPU_HAS.search(line)
            return ("CUDA out of memory" + (f" ... Tried to allocate {tried.group(1)}" if tried else "")
                    + (f" ({gpu.group(1)})" if gpu else ""))
        return line[:300]
    for raw in reversed(log_text.splitlines()[-300:]):
        m = _EXC_LINE.match(raw.strip())
        if m:
            return m.group(0)[:300]
    return f"server exited with status {exit_status}" if exit_status is not None else "server failed to start"
