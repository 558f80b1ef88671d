"""The SGLang client every batchfleet process agrees on: requests, errors, capacity, metrics.

Only a worker talks to its own server; the supervisor sees servers through status records.
Error classes follow SGLang 0.5.23 (upstream `sglang/srt/entrypoints/http_server.py` and its OpenAI
serving classes):
400/404/413/422 can never succeed -> PromptError; 408/429/5xx (503 "The request queue is full",
500 "abort") and connection failures -> RetryableError.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from .errors import PromptError, RetryableError
from .http1 import Http1Pool
from .records import ServerMetrics

__all__ = [
    "SGLangClient",
    "Transport",
    "capacity_from_log",
    "effective_capacity",
    "flag_value",
    "get_server_info",
    "is_generation",
    "make_client",
    "parse_metrics",
]

_PERMANENT = {400, 404, 413, 422}


# Requests reuse idle connections for at most this long. Below the keep-alive timeout of SGLang's
# HTTP server (uvicorn, run with timeout_keep_alive=5), so the client gives an idle connection up
# before the server closes it under a request being sent.
GENERATION_KEEPALIVE_S = 4.0


class Transport(Protocol):
    """What carries the client's requests (`http1.Http1Pool`). A request that got no HTTP answer
    raises ConnectionError (`http1.ConnectFailed` when it was never sent) or TimeoutError."""

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]: ...

    async def get(self, path: str, *, timeout_s: float) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class SGLangClient:
    """One client per server, one HTTP stack: generations (`complete`, thousands a second), their
    aborts, and the control plane (`get`: health, metrics, server info) go through one transport
    (`make_client`: an `http1.Http1Pool` with the server's API key, a connection limit, and a timeout
    for no byte from the server). The pool's connections are shared: a health check may reuse a
    generation's."""

    def __init__(self, pool: Transport) -> None:
        self.pool = pool

    async def complete(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one OpenAI-shaped request to `url` (a path); return the reply or raise
        PromptError/RetryableError (see `complete_raw`)."""
        return (await self.complete_raw(url, body))[0]

    async def complete_raw(self, url: str, body: dict[str, Any]) -> tuple[Any, bytes]:
        """`complete`, and the reply's bytes as they came: a caller may carry a large answer on unparsed
        (an embedding's vectors) instead of dumping what it parsed again.

        No HTTP answer -> RetryableError (status None; its cause is `http1.ConnectFailed` when the
        request was never sent); 200 with unreadable JSON -> RetryableError; 400/404/413/422 ->
        PromptError; any other status -> RetryableError. An error answer's body (its JSON, or None) is
        the exception's `body`."""
        try:
            status, content = await self.pool.post(url, orjson.dumps(body))
        except (ConnectionError, TimeoutError) as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        if status == 200:
            try:
                return orjson.loads(content), content
            except orjson.JSONDecodeError as exc:
                raise RetryableError(f"unreadable reply: {content[:200]!r}", status_code=200) from exc
        message = error_message(status, content)
        if status in _PERMANENT:
            raise PromptError(message, status_code=status, body=_json_or_none(content))
        raise RetryableError(message, status_code=status, body=_json_or_none(content))

    async def abort(self, rids: list[str], *, timeout_s: float = 2.0) -> int:
        """Abort these requests in the server, as SGLang 0.5.23 takes it: `POST /abort_request {"rid":
        rid}` (upstream `srt/entrypoints/http_server.py`; the scheduler drops the request whether it runs
        or waits). A client that merely closes its connection is noticed by SGLang only at its next check
        of a non-streaming request (~4 s later), so a cancel says so at once. Returns how many the server
        answered 200; gives up on the rest after `timeout_s` (the caller has closed their connections
        too, so the server aborts them anyway, later)."""
        async def one(rid: str) -> bool:
            try:
                status, _ = await self.pool.post("/abort_request", orjson.dumps({"rid": rid}))
            except (ConnectionError, TimeoutError):
                return False
            return status == 200

        if not rids:
            return 0
        tasks = [asyncio.ensure_future(one(rid)) for rid in rids]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        return sum(1 for t in done if not t.cancelled() and t.exception() is None and t.result())

    async def get(self, path: str, *, timeout_s: float) -> tuple[int, bytes]:
        """GET `path` -> (status, body). No HTTP answer within `timeout_s` of silence raises the
        transport's error: a ConnectionError (`http1.ConnectFailed`, `ServerClosed`, `ReplyError`) or
        TimeoutError."""
        return await self.pool.get(path, timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.aclose()


def make_client(base_url: str, *, api_key: str = "", timeout_s: float, max_connections: int) -> SGLangClient:
    """One shared client per server, for generations and the control plane alike: requests reuse idle
    connections for at most GENERATION_KEEPALIVE_S, a new connection must open within 10 s."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return SGLangClient(Http1Pool(base_url, max_connections=max_connections, timeout_s=timeout_s,
                                  connect_timeout_s=10.0, idle_s=GENERATION_KEEPALIVE_S, headers=headers))


def flag_value(flags: Sequence[str], *names: str) -> str | None:
    """The value of the last of `names` in a server's command line (`--flag V` or `--flag=V`; argparse
    keeps the last), or None."""
    value = None
    for i, token in enumerate(flags):
        flag, eq, inline = token.partition("=")
        if flag in names:
            value = inline if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return value


def error_message(status: int, content: bytes) -> str:
    body = _json_or_none(content)
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if value:
                return f"HTTP {status}: {value}"
    return f"HTTP {status}: {content[:300].decode('utf-8', errors='replace')}"


def _json_or_none(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


async def get_server_info(client: SGLangClient) -> dict[str, Any]:
    """`/server_info` on 0.5.23; `/get_server_info` on releases that only have the old name. Raises
    RetryableError for any other status or a body that is not a JSON object, and the pool's errors."""
    for path in ("/server_info", "/get_server_info"):
        status, content = await client.get(path, timeout_s=10.0)
        if status == 404:
            continue
        if status != 200:
            raise RetryableError(error_message(status, content), status_code=status)
        info = _json_or_none(content)
        if not isinstance(info, dict):
            raise RetryableError(f"{path}: not a JSON object: {content[:200]!r}", status_code=status)
        return info
    raise RetryableError("server has neither /server_info nor /get_server_info")


async def is_generation(client: SGLangClient) -> bool | None:
    """`/model_info`'s `is_generation` (0.5.23, `http_server.py` `get_model_info`): False on a server
    started with `--is-embedding`, which serves `/v1/embeddings` (a generation request would be
    prefilled through its pooler and kill the scheduler at its first decode). None: not said."""
    try:
        status, content = await client.get("/model_info", timeout_s=30.0)
        value = orjson.loads(content).get("is_generation") if status == 200 else None
    except (ConnectionError, TimeoutError, orjson.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def effective_capacity(info: dict[str, Any]) -> int | None:
    """The number of requests the server really runs at once, or None when it does not say.

    The top-level `max_running_requests` is what was REQUESTED (upstream issue #38846: it said 32
    while the mamba cache had capped the server to 9), so it is deliberately not read here.
    """
    states = info.get("internal_states") or []
    values = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if values and all(isinstance(v, int) and v > 0 for v in values):
        return sum(values)
    return None


_LOG_CAPACITY = re.compile(r"max_total_num_tokens=\d+.*?max_running_requests=(\d+)")
_LOG_POST_CAPTURE = re.compile(r"Post-capture KV sizing: max_running_requests \d+ -> (\d+)")


def capacity_from_log(text: str) -> int | None:
    """The effective limit from the start-up log, for releases without the `effective_` key.

    With several DP ranks each logs its own line (prefixed ` DPn`); the last value per rank counts,
    and a post-capture re-sizing overrides the earlier figure."""
    per_rank: dict[str, int] = {}
    for line in text.splitlines():
        m = _LOG_POST_CAPTURE.search(line) or _LOG_CAPACITY.search(line)
        if m:
            rank = re.search(r"\bDP(\d+)\b", line)
            per_rank[rank.group(1) if rank else "0"] = int(m.group(1))
    return sum(per_rank.values()) if per_rank else None


_METRIC = re.compile(r"^(sglang:[a-z_]+)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")
_SUM = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "queued",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:num_retracted_requests_total": "retracted",
    "sglang:generation_tokens_total": "generation_tokens_total",
    "sglang:prompt_tokens_total": "prompt_tokens_total",
}
# Prompt tokens taken from the cache, per finished request, by where they came from (0.5.23:
# `cache_source` device, host, storage, and their sum "total"); older releases have no such label.
_CACHED = "sglang:cached_tokens_total"
_CACHE_SOURCE = re.compile(r'cache_source="([a-z]+)"')
_MAX = {
    "sglang:full_token_usage": "full_kv_usage",
    "sglang:mamba_usage": "mamba_usage",
    "sglang:token_usage": "token_usage",
}
_MEAN = {"sglang:cache_hit_rate": "cache_hit_rate"}


def parse_metrics(text: str) -> ServerMetrics:
    """Prometheus text from `/metrics` -> the gauges batchfleet watches, combined over ranks."""
    seen: dict[str, list[float]] = defaultdict(list)
    cached: dict[str, list[float]] = defaultdict(list)  # cache_source -> values over ranks
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == _CACHED:
                source = _CACHE_SOURCE.search(labels)
                cached[source.group(1) if source else "total"].append(value)
            else:
                seen[name].append(value)
    out: dict[str, float] = {}
    if cached:
        out["cached_tokens_total"] = sum(cached.get("total") or cached.get("device") or [])
    for table, combine in ((_SUM, sum), (_MAX, max), (_MEAN, lambda v: sum(v) / len(v))):
        for metric, name in table.items():
            if seen.get(metric):
                out[name] = combine(seen[metric])
    return ServerMetrics(**out)
