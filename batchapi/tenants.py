"""Who shares the fleet: the tenants file (keys, weights, quotas, priorities), read at start and again
on SIGHUP, and what a batch asks for (`metadata.priority`).

The file is TOML, mode 0600 like the keys file (its content is never logged, nor shown in an error):

    [tenants.team-a]
    keys = ["<sha256 hex of a key>"]            # one or several: `batchfleet serve hash-key` prints one
    weight = 3                                   # its share of the fleet against the others' (default 1)
    max_queued_requests = 200000                 # optional quotas, checked when a batch is created
    max_queued_prompt_tokens = 50000000
    priorities = ["high", "normal", "low"]       # what its batches may ask (default: normal and low)

A plain key (`BATCHFLEET_API_KEYS`, `--api-keys-file`) is a tenant of its own, named after the first 8 hex
digits of its SHA-256, of weight 1, without quotas; without any key every batch is tenant "default"'s.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PRIORITIES", "DEFAULT_TENANT", "PRIORITY_NAMES", "Tenant", "TenantsError", "load_tenants",
           "priority_of", "read_private"]

DEFAULT_TENANT = "default"  # the tenant of a batch made without a key (the store's name for an unowned input)
PRIORITY_NAMES = ("high", "normal", "low")  # metadata.priority, batchfleet's extension; absent: normal
DEFAULT_PRIORITIES = frozenset({"normal", "low"})
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HASH = re.compile(r"[0-9a-f]{64}")
FIELDS = ("keys", "weight", "max_queued_requests", "max_queued_prompt_tokens", "priorities")


class TenantsError(Exception):
    """The tenants file (or a keys file) cannot be used: one line saying why, never its content."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_queued_requests: int | None = None
    max_queued_prompt_tokens: int | None = None
    priorities: frozenset[str] = DEFAULT_PRIORITIES
    keys: frozenset[str] = field(default_factory=frozenset, repr=False)  # SHA-256 hex of its keys


def priority_of(metadata: dict[str, str] | None) -> str:
    """The priority a batch asked for (`metadata.priority`, checked at creation): high, normal or low."""
    return (metadata or {}).get("priority", "normal")


def read_private(path: Path, what: str) -> str:
    """The text of a file only its owner may read (a keys or tenants file), or TenantsError."""
    try:
        st = path.stat()
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise TenantsError(f"{what} {path}: {why}") from None
    if st.st_mode & 0o077:
        raise TenantsError(f"{what} {path} may be read by others (mode {st.st_mode & 0o777:o}): chmod 600 it")
    return text


def load_tenants(path: Path) -> dict[str, Tenant]:
    """The tenants of the file at `path` by name, or TenantsError naming the first thing wrong (by tenant
    name and field; never a value that could be a key or a hash)."""
    what = f"tenants file {path}"
    try:
        doc = tomllib.loads(read_private(path, "tenants file"))
    except tomllib.TOMLDecodeError as exc:  # its message says where, not what is written there
        raise TenantsError(f"{what} is not TOML: {exc}") from None
    extra = [k for k in doc if k != "tenants"]
    if extra:
        raise TenantsError(f"{what}: {_field(extra[0], 'a top-level key')} is not known: the file holds "
                           "[tenants.NAME] tables only")
    tables = doc.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise TenantsError(f"{what} holds no tenant: write one [tenants.NAME] table per tenant (docs/api.md)")
    out: dict[str, Tenant] = {}
    owner: dict[str, str] = {}
    for i, (name, spec) in enumerate(tables.items(), 1):
        if not NAME.fullmatch(name):
            raise TenantsError(f"{what}: tenant {i}'s name must be 1-64 letters, digits, '_', '.' or '-'")
        if name == DEFAULT_TENANT:
            raise TenantsError(f"{what}: the name {DEFAULT_TENANT!r} is taken (the tenant of batches made without "
                               "a key): choose another")
        tenant = _tenant(what, name, spec)
        for h in tenant.keys:
            if h in owner:
                raise TenantsError(f"{what}: tenants {owner[h]!r} and {name!r} share a key")
            owner[h] = name
        out[name] = tenant
    return out


def _tenant(what: str, name: str, spec: Any) -> Tenant:
    where = f"{what}: tenant {name!r}"
    if not isinstance(spec, dict):
        raise TenantsError(f"{where} is not a table ([tenants.{name}])")
    unknown = [k for k in spec if k not in FIELDS]
    if unknown:
        raise TenantsError(f"{where}: {_field(unknown[0], 'a field')} is not known (known: {', '.join(FIELDS)})")
    keys = spec.get("keys")
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not keys:
        raise TenantsError(f"{where}: `keys` must list the SHA-256 of one key or more")
    if not all(isinstance(k, str) and HASH.fullmatch(k) for k in keys):
        raise TenantsError(f"{where}: `keys` holds what is not a SHA-256 hex digest (64 hex digits, lower case): "
                           "the file keeps hashes, never keys (`batchfleet serve hash-key` prints one)")
    weight = spec.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1e6:
        raise TenantsError(f"{where}: `weight` must be a number above 0 (at most 1,000,000)")
    quotas = {}
    for q in ("max_queued_requests", "max_queued_prompt_tokens"):
        v = spec.get(q)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise TenantsError(f"{where}: `{q}` must be a whole number of at least 1 (leave it out: no quota)")
        quotas[q] = v
    priorities = spec.get("priorities", sorted(DEFAULT_PRIORITIES))
    if (not isinstance(priorities, list) or not priorities
            or not all(isinstance(p, str) and p in PRIORITY_NAMES for p in priorities)):
        raise TenantsError(f"{where}: `priorities` must list some of {', '.join(PRIORITY_NAMES)}")
    return Tenant(name=name, weight=float(weight), priorities=frozenset(priorities), keys=frozenset(keys), **quotas)


def _field(name: str, kind: str) -> str:
    """A name read from the file, shown only when it looks like a field name (not a pasted key)."""
    return f"{kind} {name!r}" if re.fullmatch(r"[a-z_]{1,40}", name) else kind
