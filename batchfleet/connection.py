"""Redis connections from a URL: password, ACL user, database and TLS (`rediss://`) honoured."""

from __future__ import annotations

import redis

__all__ = ["connect", "redacted"]


def connect(url: str, *, decode: bool = False) -> redis.Redis:
    """A client for `url`; `rediss://` turns TLS on, `redis://user:pass@host/db` authenticates.

    A health check every 30 s and a socket timeout keep a long-lived worker from hanging on a dead
    connection (RQ's blocking reads use their own timeouts)."""
    return redis.Redis.from_url(
        url,
        decode_responses=decode,
        health_check_interval=30,
        socket_connect_timeout=10,
        socket_keepalive=True,
    )


def redacted(url: str) -> str:
    """The URL with its password hidden, for logs and status lines."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(":" + parts.password + "@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url
