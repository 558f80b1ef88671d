"""Which runs a Redis holds, and the one-line refusal of a command on a run it does not hold.

A run exists in Redis while any of its fixed keys (`Keys.run_keys`: its marker, counters, workers,
events, control...) does. A one-shot command on a run that does not exist must not create it (a
typo in `--run` would otherwise leave keys with no expiry behind): it asks `require_run` first.
"""

from __future__ import annotations

import difflib

import redis

from .keys import Keys

__all__ = ["UnknownRun", "require_run", "run_exists", "runs_in", "unknown_run_message"]

SCAN_PAGE = 1000
SHOWN = 8  # runs named in a refusal


class UnknownRun(Exception):
    """A command named a run that does not exist (exit 2; the message says which runs do)."""


def run_exists(r: redis.Redis, run: str) -> bool:
    """Does Redis hold any key of `run`? One round trip."""
    return bool(r.exists(*Keys(run).run_keys()))


def runs_in(r: redis.Redis) -> list[str]:
    """The names of the runs Redis holds any batchfleet key of, sorted (one SCAN of `bf:*`)."""
    names: set[str] = set()
    for key in r.scan_iter(match="bf:*", count=SCAN_PAGE):
        text = key.decode(errors="replace") if isinstance(key, bytes) else key
        parts = text.split(":")
        if len(parts) >= 3 and parts[1]:
            names.add(parts[1])
    return sorted(names)


def unknown_run_message(run: str, known: list[str], *, where: str) -> str:
    """One line: the run does not exist `where`; the closest names ("did you mean") and the others."""
    close = difflib.get_close_matches(run, known, n=3, cutoff=0.5)
    text = f"run {run!r} does not exist {where}"
    if close:
        text += "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    if not known:
        return text + "; it holds no run (start one with `producer enqueue` or `batchfleet run`)"
    shown = ", ".join(known[:SHOWN]) + (f" and {len(known) - SHOWN} more" if len(known) > SHOWN else "")
    return f"{text} (runs there: {shown}; `producer runs` lists them)"


def require_run(r: redis.Redis, run: str, *, where: str) -> None:
    """Raise UnknownRun (its message names the runs that do exist) unless Redis holds `run`."""
    if not run_exists(r, run):
        raise UnknownRun(unknown_run_message(run, runs_in(r), where=where))
