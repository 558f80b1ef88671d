"""Least privilege in Redis: one ACL user per role, generated from the key layout (`batchfleet.keys`).

    python -m batchfleet.acl [--run RUN] [--passwords FILE] [--out users.acl]

writes a file `redis-server --aclfile users.acl` (or `ACL LOAD`) loads. Each role connects as its
own user, `REDIS_URL=redis://worker:PASSWORD@redis.internal:6379/0`:

- producer (`producer enqueue/export/collect/recover`) and head (`producer head`, the collector):
  write RQ's queues, job hashes and registries, the run marker, stats, the results stream and the
  done set, the tenants' figures and the head's wake list (every producer command may feed, collect
  and repair); read the rest of `rq:` and `bf:`.
- worker (`rq worker <host>.gpuN`): write RQ's queues, jobs, registries and its own RQ worker keys;
  leases, strikes, suspects, isolate, done, results, stats, status records, events. Read only the
  control spec (so it cannot change what the fleet runs), the run marker and the fleet's memory. Subscribe to
  `rq:pubsub:*` (RQ's commands), publish nothing.
- supervisor (`supervisor watch/run/restart/report`): write the control spec, history, autopilot
  state, events, the fleet's memory (`bf:memory`, across runs), and drop expired names from the
  workers set; read everything else of the run.
- viewer (`supervisor status`, `watch --view-only`, `producer status`): read everything, write
  nothing (no write command at all). Not `rq info`: it cleans RQ's registries as it counts (a write).
- admin (the operator: `rq info`, `rq requeue`, `rq suspend`, repairs): everything.

The `default` user is turned off. Without `--passwords` every user is written `off` with no password
(the shipped example, docs/batchfleet.acl): turn one on with `ACL SETUSER <role> on ><password>`.
With `--passwords FILE` (lines `role=password`), roles missing from FILE get a random password and
FILE is rewritten (mode 0600); the ACL file holds only SHA-256 hashes of the passwords.

Commands: data commands (`@read`, `@write`) but nothing `@dangerous` (no KEYS, FLUSHALL, CONFIG,
DEBUG, SHUTDOWN, CLIENT KILL, ...), scripts only by EVAL/EVALSHA/SCRIPT LOAD, plus what RQ and
redis-py need to connect (INFO for RQ's version check, CLIENT SETNAME). RQ asks for `CLIENT LIST`
to learn its own address; it is refused (it lists every client) and RQ records the address as
"unknown" with a warning. The viewer has no write command at all.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import rqlayout
from .keys import Keys
from .redact import private_file

__all__ = ["ROLES", "Role", "acl_file", "roles"]

ROLES = ("producer", "head", "worker", "supervisor", "viewer", "admin")

# What every role needs to connect and to run batchfleet's scripts (redis-py's Script: EVALSHA, then
# SCRIPT LOAD when the server does not know it); INFO is how RQ learns the server's version.
_CONNECT = ("+ping", "+hello", "+auth", "+select", "+echo", "+client|setname", "+client|getname", "+client|id",
            "+info", "+time", "+acl|whoami", "+multi", "+exec", "+discard", "+watch", "+unwatch")
_DATA = ("+@read", "+@write", "-@dangerous", "+eval", "+evalsha", "+script|load", "+script|exists", *_CONNECT)
_READ_ONLY = ("+@read", "-@dangerous", *_CONNECT)


@dataclass(frozen=True, slots=True)
class Role:
    name: str
    write: tuple[str, ...]  # key patterns it may read and write (`~`)
    read: tuple[str, ...]  # key patterns it may only read (`%R~`)
    channels: tuple[str, ...]  # pub/sub channel patterns (`&`)
    commands: tuple[str, ...]
    lifetime: tuple[str, ...] = ()  # key patterns whose TTL only it may set or lift (a Redis 7 selector)

    def rules(self) -> list[str]:
        out = ["resetkeys", "resetchannels", *(f"~{p}" for p in self.write), *(f"%R~{p}" for p in self.read),
               *(f"&{c}" for c in self.channels), "-@all", *self.commands]
        if self.lifetime:
            # The head gives a finished run's keys their TTL and `enqueue` lifts it again: EXPIRE/PERSIST on
            # every key of the run (its scripts too), nothing else on the keys it may not write.
            out.append("(" + " ".join([*(f"~{p}" for p in self.lifetime), "-@all", "+expire", "+pexpire",
                                       "+persist", "+ttl", "+pttl", "+exists", "+eval", "+evalsha"]) + ")")
        return out


def roles(run: str = "*") -> dict[str, Role]:
    """Every role's rules for run `run` (`*`: every run sharing this Redis)."""
    k = Keys(run)
    rq_jobs = tuple(p + "*" for p in (rqlayout.QUEUE_PREFIX, rqlayout.JOB_PREFIX, rqlayout.STARTED_PREFIX,
                                      rqlayout.FAILED_PREFIX))
    everything_of_run = (k.prefix + "*", rqlayout.NAMESPACE + "*")
    # `producer cancel` takes jobs out of the strike lists and leases too, flags the cancel, and tells the
    # workers which prompts to drop (`drop`, announced on `signals`)
    feeder = Role("producer", write=(*rq_jobs, rqlayout.QUEUES, rqlayout.RESULTS_PREFIX + "*", k.meta, k.stats, k.done,
                                     k.results, k.cancel, k.refeed, k.leases, k.strikes, k.suspects, k.isolate,
                                     k.drop, k.tenants, k.wake),
                  read=everything_of_run, channels=(k.signals,), commands=(*_DATA, "+publish"),
                  lifetime=(k.prefix + "*",))
    return {
        "producer": feeder,
        "head": Role("head", write=feeder.write, read=feeder.read, channels=feeder.channels, commands=feeder.commands,
                     lifetime=feeder.lifetime),
        "worker": Role(
            "worker",
            write=(*rq_jobs, rqlayout.WORKER_PREFIX + "*", rqlayout.WORKERS, rqlayout.WORKERS + ":*",
                   rqlayout.CLEAN_LOCK_PREFIX + "*", k.leases, k.done, k.results, k.stats, k.strikes, k.suspects,
                   k.isolate, k.workers, k.status("*"), k.events, k.refeed,
                   k.cancel),  # cancel: its acknowledgement field
            read=(k.control, k.retry, k.meta, k.drop, rqlayout.QUEUES, rqlayout.SUSPENDED, Keys.MEMORY),
            channels=(rqlayout.PUBSUB_PREFIX + "*", k.signals),
            commands=(*_DATA, "+subscribe", "+unsubscribe")),
        "supervisor": Role("supervisor", write=(k.control, k.retry, k.history, k.autopilot, k.events, k.workers,
                                                Keys.MEMORY),
                           read=everything_of_run, channels=(), commands=_DATA),
        "viewer": Role("viewer", write=(), read=("*",), channels=(), commands=_READ_ONLY),
        "admin": Role("admin", write=("*",), read=(), channels=("*",), commands=("+@all",)),
    }


def acl_file(passwords: Mapping[str, str] | None = None, *, run: str = "*") -> str:
    """The ACL file: the default user off, then one user per role. A role with a password is `on`
    with the password's SHA-256; a role without one is `off` (no one can log in as it)."""
    passwords = passwords or {}
    lines = ["user default off resetkeys resetchannels -@all"]  # Redis 7.0 allows no comment in an ACL file
    for name, role in roles(run).items():
        pw = passwords.get(name)
        auth = ["on", "#" + hashlib.sha256(pw.encode()).hexdigest()] if pw else ["off", "nopass"]
        lines.append(" ".join(["user", name, "reset", *auth, *role.rules()]))
    return "\n".join(lines) + "\n"


def _read_passwords(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if path.exists():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            role, eq, pw = line.partition("=")
            if not eq or role.strip() not in ROLES or not re.fullmatch(r"[!-~]+", pw.strip()):
                raise SystemExit(f"{path}:{n}: expected role=password (roles: {', '.join(ROLES)}; no spaces)")
            out[role.strip()] = pw.strip()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batchfleet.acl", description=__doc__.split("\n")[0])
    p.add_argument("--run", default="*", help="limit batchfleet's keys to this run (default: every run)")
    p.add_argument("--passwords", type=Path, metavar="FILE",
                   help="role=password lines; missing roles get a random password, FILE is rewritten 0600")
    p.add_argument("--out", type=Path, help="write the ACL file here (0600) instead of stdout")
    args = p.parse_args(argv)
    passwords: dict[str, str] = {}
    if args.passwords is not None:
        passwords = _read_passwords(args.passwords)
        missing = [r for r in ROLES if r not in passwords]
        if missing:
            passwords.update({r: secrets.token_urlsafe(24) for r in missing})
            with private_file(args.passwords, "w") as f:
                f.write("".join(f"{r}={passwords[r]}\n" for r in ROLES))
    text = acl_file(passwords, run=args.run)
    if args.out is None:
        sys.stdout.write(text)
    else:
        with private_file(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
