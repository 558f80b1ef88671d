"""One worker per server per host: a second `rq worker gpu0` on the same host refuses to start, and so
does a worker on a group of GPUs (`gpu0-3`) that overlaps another worker's GPU or group.

The lock is an abstract unix socket (Linux) named after the server address the worker owns,
`batchfleet/127.0.0.1:30000`: binding it succeeds for exactly one process per network namespace,
and the kernel releases it when that process dies, even by `kill -9` — no file to go stale, no pid
to trust. Why this and not a file lock in the state dir:

- Its scope is the host (the network namespace), whatever directory or state dir a worker was
  started from; the multi-host test harness makes each "host" its own namespace, so hosts on one
  machine do not see each other's locks, exactly like real hosts.
- It is named by the server's address (host and port = base + GPU index), the resource two workers
  for one GPU would fight over (the port and the pid file of the server on it). Test fleets that each
  pick their own free ports can run side by side on one machine.

A worker on a group takes the lock of every GPU of its group (`GroupLock`: the address base + N of
each GPU N, in order), so `gpu2-3` beside a live `gpu0-3` exits 3 as `gpu2` does.

The socket is created close-on-exec, so the server a worker starts does not inherit (and keep) it.
A worker that finds the lock held asks the holder's pid from the kernel (SO_PEERCRED) for its message.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys

from batchfleet.errors import BatchfleetError

__all__ = ["GroupLock", "ServerLock", "ServerTaken"]


class ServerTaken(BatchfleetError):
    """Another live worker on this host owns this server (and so its GPU)."""

    def __init__(self, message: str, *, holder_pid: int | None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid


class ServerLock:
    def __init__(self, host: str, port: int, *, gpu: int) -> None:
        self.name = f"batchfleet/{host}:{port}"
        self.gpu = gpu
        self.sock: socket.socket | None = None

    def acquire(self) -> None:
        """Take the lock or raise ServerTaken. Held until `release()` or the process ends."""
        if not sys.platform.startswith("linux"):
            return  # abstract sockets are Linux's; elsewhere the port check at server start remains
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + self.name)
        except OSError:
            sock.close()
            holder = self._holder_pid()
            who = f"pid {holder}" if holder else "another process"
            raise ServerTaken(f"gpu{self.gpu}: another batchfleet worker ({who}) already owns {self.name[11:]} on "
                              "this host; refusing to start a second worker for the same GPU",
                              holder_pid=holder) from None
        sock.listen(8)  # lets a refused worker ask who holds it (SO_PEERCRED), nothing else
        self.sock = sock

    def _holder_pid(self) -> int | None:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect("\0" + self.name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, _uid, _gid = struct.unpack("3i", creds)
            return pid or None
        return None

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class GroupLock:
    """The locks of every GPU of a server's group (one `ServerLock` per GPU, named by base + index): all
    of them or none."""

    def __init__(self, host: str, ports: dict[int, int]) -> None:
        self.locks = [ServerLock(host, port, gpu=gpu) for gpu, port in ports.items()]

    def acquire(self) -> None:
        """Take every GPU's lock or raise ServerTaken (for the first GPU another worker holds), holding none."""
        taken: list[ServerLock] = []
        try:
            for lock in self.locks:
                lock.acquire()
                taken.append(lock)
        except ServerTaken:
            for lock in taken:
                lock.release()
            raise

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
