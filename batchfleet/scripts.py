"""Redis scripts as files, declared by name: the one way batchfleet runs Lua in Redis.

A script is a `.lua` file in its package's `lua/` folder, declared once in the module beside it:

    CLAIM = Script("worker", "claim",
                   keys=("leases", "suspects", "isolate", Each("queues", "queue")),
                   argv=("n", "session", Each("queue_names", "name")),
                   derives=("job_key", "started_key"))

and called with every KEYS and ARGV entry by name (a missing or unknown name raises ScriptCallError):

    await CLAIM.acall(r, keys={"leases": k.leases, ..., "queues": [...]}, args={"n": 8, ...})

What Redis runs is the file with, before it:
- locals named as declared: `local leases, suspects, isolate = KEYS[1], KEYS[2], KEYS[3]`; an `Each`
  (a repeated run of entries, one group of `fields` per item, at the end of KEYS or ARGV) becomes
  `<name>_first` and `<name>_last`, the indexes of its first and last entry (several `Each` in one
  array are told apart by counts the caller never sees);
- the helpers of `batchfleet/rqlayout.lua` it uses (Redis's clock, RQ's timestamp format, the lease
  member, a job key's id), filled in from `batchfleet.rqlayout`;
- the files named in `include` (shared functions of its package, e.g. `lua/requeue.lua`).

**Keys.** Every key a script touches arrives in KEYS, built by `batchfleet.keys`. A script that must
reach keys it only learns inside (a job id popped from a list, a job's origin read from its hash)
declares it in `derives`, naming the key helpers it calls (`job_key`, `queue_key`, `started_key`,
`failed_key`); only those are defined in it, and `Script.derived_patterns` says which keys they can
build (what a Redis ACL user running it must be allowed; a Redis Cluster needs them in one slot).

Each script is loaded once per Redis server: EVALSHA, and SCRIPT LOAD when the server answers that it
does not know it (a new or restarted server).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from . import rqlayout

__all__ = ["KEY_HELPERS", "Each", "Script", "ScriptCallError", "declared", "lua_helpers"]

# The key helpers a declaration may list in `derives`, and the prefix of the keys each builds.
KEY_HELPERS = {"job_key": rqlayout.JOB_PREFIX, "queue_key": rqlayout.QUEUE_PREFIX,
               "started_key": rqlayout.STARTED_PREFIX, "failed_key": rqlayout.FAILED_PREFIX}

_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_LUA_RESERVED = frozenset({"and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in",
                           "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while", "KEYS",
                           "ARGV", "redis"})
_COMMENT = re.compile(r"--[^\n]*")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ScriptCallError(TypeError):
    """A script was called with KEYS or ARGV names that its declaration does not have."""


class Each:
    """A repeated run of entries at the end of KEYS or ARGV, passed as one flat sequence under `name`:
    `Each("jobs", "job", "started")` is a job key then its started registry, for each job."""

    __slots__ = ("fields", "name")

    def __init__(self, name: str, *fields: str) -> None:
        self.name = name
        self.fields = fields or (name,)

    @property
    def stride(self) -> int:
        return len(self.fields)

    def __repr__(self) -> str:
        return f"Each({self.name!r}, {', '.join(map(repr, self.fields))})"


def _lua_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _load_helpers() -> dict[str, str]:
    raw = resources.files("batchfleet").joinpath("rqlayout.lua").read_text(encoding="utf-8")
    fill = {"job_prefix": _lua_string(rqlayout.JOB_PREFIX), "job_prefix_len": str(len(rqlayout.JOB_PREFIX)),
            "queue_prefix": _lua_string(rqlayout.QUEUE_PREFIX), "started_prefix": _lua_string(rqlayout.STARTED_PREFIX),
            "failed_prefix": _lua_string(rqlayout.FAILED_PREFIX)}
    text = re.sub(r"\{\{(\w+)\}\}", lambda m: fill[m.group(1)], raw)
    out: dict[str, str] = {}
    for chunk in re.split(r"(?m)^(?=--- )", text)[1:]:
        name = chunk[4:].split(":", 1)[0]
        out[name] = chunk.rstrip() + "\n"
    return out


_HELPERS = _load_helpers()
_DECLARED: list[Script] = []


def lua_helpers(*names: str) -> str:
    """The Lua text of the named helpers of `batchfleet/rqlayout.lua`, filled in (for a one-off EVAL)."""
    return "".join(_HELPERS[n] for n in names)


def declared() -> list[Script]:
    """Every script declared so far (by the modules imported)."""
    return list(_DECLARED)


def _words(lua: str) -> set[str]:
    return set(_WORD.findall(_COMMENT.sub("", lua)))


class Script:
    """One declared script (see the module doc)."""

    def __init__(self, package: str, name: str, *, keys: Sequence[str | Each], argv: Sequence[str | Each] = (),
                 derives: Sequence[str] = (), include: Sequence[str] = ()) -> None:
        self.name = f"{package}/lua/{name}.lua"
        self.package = package
        self.include = tuple(include)
        folder = resources.files(package).joinpath("lua")
        body = folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        shared = "".join(folder.joinpath(f"{n}.lua").read_text(encoding="utf-8") for n in include)
        self.keys = tuple(keys)
        self.argv = tuple(argv)
        self.derives = tuple(derives)
        self._fixed_keys, self._key_groups = self._split(self.keys, "KEYS")
        self._fixed_args, self._arg_groups = self._split(self.argv, "ARGV")
        names = [*self._fixed_keys, *self._fixed_args, *(g.name for g in (*self._key_groups, *self._arg_groups))]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a name is declared twice in {names}")
        self._key_names = frozenset(e.name if isinstance(e, Each) else e for e in self.keys)
        self._arg_names = frozenset(e.name if isinstance(e, Each) else e for e in self.argv)
        self._hidden = len(self._key_groups[:-1]) + len(self._arg_groups[:-1])

        used = _words(shared + body)
        unknown = [d for d in self.derives if d not in KEY_HELPERS]
        if unknown:
            raise ValueError(f"{self.name}: derives {unknown}, not a key helper ({', '.join(KEY_HELPERS)})")
        undeclared = sorted(h for h in KEY_HELPERS if h in used and h not in self.derives)
        if undeclared:
            raise ValueError(f"{self.name}: builds keys with {undeclared} but does not declare it in `derives`")
        unused = [n for n in [*self._fixed_keys, *self._fixed_args, *self.derives] if n not in used]
        unused += [g.name for g in (*self._key_groups, *self._arg_groups) if f"{g.name}_first" not in used]
        if unused:
            raise ValueError(f"{self.name}: declares {unused} but never uses them")
        helpers = [h for h in _HELPERS if h in used and (h not in KEY_HELPERS or h in self.derives)]
        self.text = (f"-- {self.name}\n" + self._prologue() + "".join(_HELPERS[h] for h in helpers) + shared
                     + body)
        self.sha = hashlib.sha1(self.text.encode()).hexdigest()
        _DECLARED.append(self)

    def _split(self, entries: Sequence[str | Each], array: str) -> tuple[tuple[str, ...], tuple[Each, ...]]:
        fixed = tuple(e for e in entries if not isinstance(e, Each))
        groups = tuple(e for e in entries if isinstance(e, Each))
        if any(isinstance(e, Each) for e in entries[: len(fixed)]):
            raise ValueError(f"{self.name}: {array} has a name after an Each; each Each goes at the end")
        for n in (*fixed, *(g.name for g in groups)):
            if not _NAME.fullmatch(n) or n in _LUA_RESERVED or n in _HELPERS:
                raise ValueError(f"{self.name}: {n!r} cannot name a Lua local")
        return fixed, groups

    @property
    def derived_patterns(self) -> tuple[str, ...]:
        """Glob patterns of the keys this script may build inside (beyond its KEYS)."""
        return tuple(KEY_HELPERS[d] + "*" for d in self.derives)

    def _prologue(self) -> str:
        lines = []
        if self._fixed_keys:
            lines.append(f"local {', '.join(self._fixed_keys)} = "
                         + ", ".join(f"KEYS[{i}]" for i in range(1, len(self._fixed_keys) + 1)))
        hidden = 0  # counts of every Each but the last of each array, first in ARGV
        lines += self._group_lines(self._key_groups, "KEYS", str(len(self._fixed_keys) + 1), hidden)
        hidden += len(self._key_groups[:-1])
        if self._fixed_args:
            lines.append(f"local {', '.join(self._fixed_args)} = "
                         + ", ".join(f"ARGV[{self._hidden + i}]" for i in range(1, len(self._fixed_args) + 1)))
        lines += self._group_lines(self._arg_groups, "ARGV", str(self._hidden + len(self._fixed_args) + 1), hidden)
        return "".join(line + "\n" for line in lines)

    @staticmethod
    def _group_lines(groups: tuple[Each, ...], array: str, first: str, hidden: int) -> list[str]:
        lines = []
        for i, g in enumerate(groups):
            lines.append(f"local {g.name}_first = {first}")
            if i == len(groups) - 1:
                lines.append(f"local {g.name}_last = #{array}")
            else:
                hidden += 1
                lines.append(f"local {g.name}_last = {g.name}_first + tonumber(ARGV[{hidden}]) - 1")
                first = f"{g.name}_last + 1"
        return lines

    def _pack(self, keys: Mapping[str, Any], args: Mapping[str, Any]) -> tuple[int, list[Any]]:
        """(numkeys, KEYS + ARGV) for EVALSHA. On the worker's hot path: keep it lean."""
        if keys.keys() != self._key_names or args.keys() != self._arg_names:
            raise ScriptCallError(self._mismatch(keys, args))
        flat = [*map(keys.__getitem__, self._fixed_keys)]
        if not (self._key_groups or self._arg_groups):
            numkeys = len(flat)
            flat += map(args.__getitem__, self._fixed_args)
            return numkeys, flat
        counts = []
        for g in self._key_groups:
            items = keys[g.name]
            if len(items) % g.stride:
                raise ScriptCallError(self._stride(g, "KEYS", items))
            flat += items
            counts.append(len(items))
        numkeys = len(flat)
        del counts[-1:]
        argv = [*map(args.__getitem__, self._fixed_args)]
        last = len(self._arg_groups) - 1
        for i, g in enumerate(self._arg_groups):
            items = args[g.name]
            if len(items) % g.stride:
                raise ScriptCallError(self._stride(g, "ARGV", items))
            argv += items
            if i < last:
                counts.append(len(items))
        flat += counts
        flat += argv
        return numkeys, flat

    def _stride(self, g: Each, array: str, items: Sequence[Any]) -> str:
        return (f"{self.name}: {array} {g.name} holds {len(items)} entries, not groups of {g.stride} "
                f"({', '.join(g.fields)})")

    def _mismatch(self, keys: Mapping[str, Any], args: Mapping[str, Any]) -> str:
        parts = []
        for what, given, want in (("KEYS", keys.keys(), self._key_names), ("ARGV", args.keys(), self._arg_names)):
            if given - want:
                parts.append(f"{what} {sorted(given - want)} not declared")
            if want - given:
                parts.append(f"{what} {sorted(want - given)} missing")
        return f"{self.name}: " + "; ".join(parts)

    def call(self, client: redis.Redis, *, keys: Mapping[str, Any], args: Mapping[str, Any] | None = None) -> Any:
        """Run it on a synchronous client."""
        numkeys, flat = self._pack(keys, args or {})
        try:
            return client.evalsha(self.sha, numkeys, *flat)
        except NoScriptError:
            client.script_load(self.text)
            return client.evalsha(self.sha, numkeys, *flat)

    async def acall(self, client: aioredis.Redis, *, keys: Mapping[str, Any],
                    args: Mapping[str, Any] | None = None) -> Any:
        """Run it on an asyncio client."""
        numkeys, flat = self._pack(keys, args or {})
        try:
            return await client.evalsha(self.sha, numkeys, *flat)
        except NoScriptError:
            await client.script_load(self.text)
            return await client.evalsha(self.sha, numkeys, *flat)

    def __repr__(self) -> str:
        return f"<Script {self.name} keys={self.keys} argv={self.argv} derives={self.derives}>"
