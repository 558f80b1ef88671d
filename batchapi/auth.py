"""Bearer API keys: who may use the API, and whose files and batches are whose.

Keys come from `BATCHFLEET_API_KEYS` (comma-separated) and/or a file (`--api-keys-file`, or
`BATCHFLEET_API_KEYS_FILE`: one key a line, `#` comments; refused when group or others may read it),
and from the tenants file (`--tenants`, `BATCHFLEET_TENANTS_FILE`: their hashes, batchapi/tenants.py).
Each key belongs to a tenant (`tenant_of`), whose weight, quotas and priorities its batches get.
Only the SHA-256 of a key is kept, in memory and on every file and batch it makes (`owner`): a key
never reaches a disk, a log or a response. A request without a valid key is answered 401 in
OpenAI's error shape. Without any key the API is open, and serve refuses a `--host` other than
loopback then (`check_exposure`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from pathlib import Path

from batchfleet.config import Config

from .tenants import DEFAULT_TENANT, Tenant, TenantsError, load_tenants, read_private

__all__ = ["ApiKeys", "AuthError", "check_exposure", "is_loopback", "key_hash"]


class AuthError(Exception):
    """The keys or the tenants file cannot be used, or serving would expose an open API: a usage error
    (exit 2) at start; on SIGHUP, the tenants loaded before stay."""


DEFAULT = Tenant(name=DEFAULT_TENANT)  # every batch's tenant when the API runs without keys


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The keys serve accepts and each one's tenant: those of the tenants file (`tenants_file`, read again
    by `reloaded`) and the plain keys (each a tenant of its own, named after its hash's first 8 hex digits)."""

    def __init__(self, keys: list[str], tenants: dict[str, Tenant] | None = None, *,
                 tenants_file: Path | None = None) -> None:
        bad = [k for k in keys if any(c.isspace() or ord(c) < 33 for c in k)]
        if bad:
            raise AuthError("an API key holds a space or a control character")
        self._build(frozenset(key_hash(k) for k in keys if k), tenants or {}, tenants_file)

    def _build(self, plain: frozenset[str], tenants: dict[str, Tenant], tenants_file: Path | None) -> None:
        self._plain = plain
        self.tenants_file = tenants_file
        self._of: dict[str, Tenant] = {h: t for t in tenants.values() for h in t.keys}
        self.by_name: dict[str, Tenant] = dict(tenants)
        for h in sorted(plain):
            if h in self._of:
                raise AuthError(f"a plain API key (BATCHFLEET_API_KEYS, --api-keys-file) is also a key of tenant "
                                f"{self._of[h].name!r} in the tenants file: keep it in one place")
            name = h[:8]
            if name in self.by_name:
                raise AuthError(f"tenant name {name!r} of the tenants file is also the name of a plain API key's "
                                "tenant (the first 8 hex digits of its SHA-256): choose another")
            self._of[h] = self.by_name[name] = Tenant(name=name, keys=frozenset({h}))
        self._hashes = frozenset(self._of)
        if not self._hashes:
            self.by_name = {DEFAULT_TENANT: DEFAULT}

    @classmethod
    def from_config(cls, config: Config, file: Path | None = None, tenants_file: Path | None = None) -> ApiKeys:
        keys = list(config.api_keys)
        path = file or config.api_keys_file
        if path is not None:
            keys += _read_file(Path(path))
        tenants_file = tenants_file or config.tenants_file
        return cls(keys, _load(tenants_file), tenants_file=tenants_file)

    def reloaded(self) -> ApiKeys:
        """The same plain keys with the tenants file read again (AuthError when it cannot be used)."""
        new = ApiKeys.__new__(ApiKeys)
        new._build(self._plain, _load(self.tenants_file), self.tenants_file)
        return new

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def owner(self, authorization: str | None) -> str | None:
        """The owner id of a request's `Authorization` header: the key's hash; "" when the API is open;
        None when keys are required and the header holds no valid one."""
        if not self._hashes:
            return ""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = key_hash(token.strip())
        # compare digests, not keys: a lookup leaks nothing about a key's text
        return digest if any(hmac.compare_digest(digest, h) for h in self._hashes) else None

    def tenant_of(self, owner: str) -> Tenant:
        """The tenant of an owner id (`owner`); a key no longer known (the tenants file changed) is a tenant
        of its own, as a plain key is."""
        if not owner:
            return DEFAULT
        return self._of.get(owner) or Tenant(name=owner[:8], keys=frozenset({owner}))

    def weights(self) -> dict[str, float]:
        """Every tenant's weight, for the store (a tenant not named weighs 1)."""
        return {name: t.weight for name, t in self.by_name.items() if t.weight != 1.0}


def _load(path: Path | None) -> dict[str, Tenant]:
    if path is None:
        return {}
    try:
        return load_tenants(Path(path))
    except TenantsError as exc:
        raise AuthError(str(exc)) from None


def _read_file(path: Path) -> list[str]:
    try:
        text = read_private(path, "API keys file")
    except TenantsError as exc:
        raise AuthError(str(exc)) from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise AuthError(f"API keys file {path} holds no key (one a line)")
    return keys


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, keys: ApiKeys) -> None:
    """An API reachable from other machines must require keys."""
    if not is_loopback(host) and not keys.enabled:
        raise AuthError(f"--host {host} would open the API to other machines without keys: set BATCHFLEET_API_KEYS "
                        "(comma-separated) or --api-keys-file, or serve on 127.0.0.1 (TLS: put a reverse proxy in "
                        "front, see docs/api.md)")

