"""Redis connections from a URL: password, ACL user, database and TLS (`rediss://`) honoured."""

from __future__ import annotations

import redis

__all__ = ["connect", "redacted"]


def connect(url: str, *, decode: bool = False, socket_timeout_s: float | None = None) -> redis.Redis:
    """A client for `url`; `rediss://` turns TLS on, `redis://user:pass@host/db` authenticates.

    A health check every 30 s and a socket timeout keep a long-lived worker from hanging on a dead
    connection (RQ's blocking reads use their own timeouts). `socket_timeout_s` bounds every command
    for a process that never blocks on purpose (the supervisor): a Redis that stops answering is then
    an error it can ride out, not a hang."""
    return redis.Redis.from_url(
        url,
        decode_responses=decode,
        health_check_interval=30,
        socket_connect_timeout=10,
        socket_timeout=socket_timeout_s,
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


def async_client_like(conn: redis.Redis) -> redis.asyncio.Redis:
    """An asyncio client to the same server, credentials and TLS as `conn` (the connection RQ's CLI
    built from `--url`/`REDIS_URL`), so the worker never needs the URL twice."""
    import redis.asyncio as aioredis

    kwargs = dict(conn.connection_pool.connection_kwargs)
    ssl = issubclass(conn.connection_pool.connection_class, redis.SSLConnection)
    connection_class = aioredis.SSLConnection if ssl else aioredis.Connection
    if issubclass(conn.connection_pool.connection_class, redis.UnixDomainSocketConnection):
        connection_class = aioredis.UnixDomainSocketConnection
    kwargs.pop("retry", None)
    pool = aioredis.ConnectionPool(connection_class=connection_class, **kwargs)
    return aioredis.Redis(connection_pool=pool)
