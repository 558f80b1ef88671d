"""Bearer API keys: who may use the API, and whose files and batches are whose.

Keys come from `BATCHFLEET_API_KEYS` (comma-separated) and/or a file (`--api-keys-file`, or
`BATCHFLEET_API_KEYS_FILE`: one key a line, `#` comments; refused when group or others may read it).
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

__all__ = ["ApiKeys", "AuthError", "check_exposure", "is_loopback", "key_hash"]


class AuthError(Exception):
    """The keys cannot be read, or serving would expose an open API: a usage error (exit 2)."""


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        bad = [k for k in keys if any(c.isspace() or ord(c) < 33 for c in k)]
        if bad:
            raise AuthError("an API key holds a space or a control character")
        self._hashes = frozenset(key_hash(k) for k in keys if k)

    @classmethod
    def from_config(cls, config: Config, file: Path | None = None) -> ApiKeys:
        keys = list(config.api_keys)
        path = file or config.api_keys_file
        if path is not None:
            keys += _read_file(Path(path))
        return cls(keys)

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


def _read_file(path: Path) -> list[str]:
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise AuthError(f"API keys file {path}: {exc.strerror or exc}") from None
    if st.st_mode & 0o077:
        raise AuthError(f"API keys file {path} may be read by others (mode {st.st_mode & 0o777:o}): chmod 600 it")
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

