"""One live launcher (`batchfleet run` or `batchfleet serve`) per run, on every host that shares its Redis.

The live one holds a lease in Redis, `bf:<run>:launcher` (its command, host, pid, start time and a
token), with a TTL of LAUNCHER_TTL_S that a thread renews every third of it. A second `batchfleet run`
or `batchfleet serve` of the same run finds the lease and stops before it starts anything: "another
batchfleet run of R is active (host, pid)". One killed with -9 stops renewing, so its lease lapses
within LAUNCHER_TTL_S; on its own host it is taken over at once, as soon as its pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace

import orjson
import redis

from batchfleet.keys import LAUNCHER_TTL_S, Keys
from batchfleet.procs import pid_alive

__all__ = ["RUN", "SERVE", "Holder", "LaunchLease", "RunActive"]

HOST = socket.gethostname()


RUN, SERVE = "batchfleet run", "batchfleet serve"  # the launchers


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float
    token: str
    command: str = RUN  # which launcher holds it

    def to_json(self) -> bytes:
        return orjson.dumps({"host": self.host, "pid": self.pid, "started": self.started, "token": self.token,
                             "command": self.command})

    @classmethod
    def from_json(cls, raw: bytes) -> Holder | None:
        """None when the record is not one (it is data from Redis: anything may be there)."""
        try:
            d = orjson.loads(raw)
            holder = cls(host=d["host"], pid=d["pid"], started=d["started"], token=d["token"],
                         command=d.get("command", RUN))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None
        ok = (isinstance(holder.host, str) and isinstance(holder.pid, int) and not isinstance(holder.pid, bool)
              and isinstance(holder.started, int | float) and isinstance(holder.token, str))
        if ok and holder.command not in (RUN, SERVE):  # a launcher this version does not know: still a holder
            holder = replace(holder, command="batchfleet launcher")
        return holder if ok else None

    def gone(self) -> bool:
        """Verifiably not running: on this host, and its pid is not alive."""
        return self.host == HOST and not pid_alive(self.pid)


class RunActive(Exception):
    """Another `batchfleet run` or `batchfleet serve` of this run holds the lease."""

    def __init__(self, run: str, holder: Holder) -> None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started))
        super().__init__(f"another {holder.command} of {run} is active ({holder.host}, pid {holder.pid}, since "
                         f"{since}): nothing was started. Wait for it, or stop it (Ctrl-C drains it); if it was "
                         f"killed, its lease ({Keys(run).launcher}) lapses within {LAUNCHER_TTL_S} s")
        self.holder = holder


class LaunchLease:
    """`acquire()` before starting anything (raises RunActive), `release()` at the end."""

    def __init__(self, r: redis.Redis, keys: Keys, *, ttl_s: float = LAUNCHER_TTL_S, command: str = RUN) -> None:
        self.r = r
        self.key = keys.launcher
        self.run = keys.run
        self.ttl_ms = int(ttl_s * 1000)
        self.me = Holder(host=HOST, pid=os.getpid(), started=time.time(), token=uuid.uuid4().hex, command=command)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        mine = self.me.to_json()
        for _ in range(5):
            if self.r.set(self.key, mine, nx=True, px=self.ttl_ms):
                break
            raw = self.r.get(self.key)
            if raw is None:
                continue  # it lapsed just now: try again
            holder = Holder.from_json(raw)
            if holder is not None and not holder.gone():
                raise RunActive(self.run, holder)
            if self._swap(raw, mine):  # unreadable, or a dead process on this host: take it over
                break
        else:
            raise RuntimeError(f"could not take the lease {self.key} (it kept changing)")
        self._thread = threading.Thread(target=self._renew_loop, name="launch-lease", daemon=True)
        self._thread.start()

    def _swap(self, expected: bytes | None, new: bytes | None) -> bool:
        """Set (or with `new` None, delete) the key only if it still holds `expected`."""
        with self.r.pipeline() as p:
            try:
                p.watch(self.key)
                if p.get(self.key) != expected:
                    return False
                p.multi()
                if new is None:
                    p.delete(self.key)
                else:
                    p.set(self.key, new, px=self.ttl_ms)
                p.execute()
                return True
            except redis.WatchError:
                return False

    def _renew_loop(self) -> None:
        mine = self.me.to_json()
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                # not ours any more: it lapsed (Redis away longer than the TTL) and is taken again, unless
                # another run took it meanwhile (then that one is the live one)
                if not self._swap(mine, mine) and not self.r.set(self.key, mine, nx=True, px=self.ttl_ms):
                    return
            except (redis.RedisError, OSError):
                continue  # Redis away for a moment: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with contextlib.suppress(redis.RedisError, OSError):
            self._swap(self.me.to_json(), None)
