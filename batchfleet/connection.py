"""Redis connections from a URL: password, ACL user, database and TLS (`rediss://`) honoured."""

from __future__ import annotations

import redis

from .redact import redact_url

__all__ = ["CONNECT_TIMEOUT_S", "SOCKET_TIMEOUT_S", "async_client_like", "connect", "redacted", "with_timeouts"]

# For a worker on another host than Redis: a command that gets no answer for this long fails (and
# its connection is dropped) instead of waiting for TCP to give up (minutes) or to retransmit after
# a partition heals (tens of seconds); the worker's loops retry it on a fresh connection. No command
# a worker sends blocks on purpose, and each takes milliseconds.
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0


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


def with_timeouts(conn: redis.Redis) -> redis.Redis:
    """Bound how long a client waits on Redis, for the connections it opens from now on: reads at most
    SOCKET_TIMEOUT_S, connects at most CONNECT_TIMEOUT_S, TCP keepalive on. RQ's CLI builds its client
    without timeouts and RQ's worker raises the read timeout to ~7 minutes for its blocking dequeue,
    which batchfleet's worker never calls. Returns `conn`."""
    pool = conn.connection_pool
    kwargs = pool.connection_kwargs
    before = dict(kwargs)
    for key, cap in (("socket_timeout", SOCKET_TIMEOUT_S), ("socket_connect_timeout", CONNECT_TIMEOUT_S)):
        if kwargs.get(key) is None or kwargs[key] > cap:
            kwargs[key] = cap
    kwargs["socket_keepalive"] = True
    if kwargs != before:
        pool.disconnect()  # connections made before keep their old settings: drop them
        pool.reset()
    return conn


def redacted(url: str) -> str:
    """The URL with its password hidden (userinfo and `?password=`), for logs and status lines."""
    return redact_url(url)


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
