"""Helpers for the producer tests (no tests here): run the CLI in-process, and play a worker with the
worker's own `Ledger` (claim, finish, hand back: the real Lua bookkeeping), without a server."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.jobs import parse_job_data
from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from producer.cli import main
from worker.ledger import Ledger

RUN = "t"
Cli = Callable[..., tuple[int, str, str]]


def make_cli(redis_url: str, state: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str], *, env: dict[str, str] | None = None) -> Cli:
    for name in list(os.environ):
        if name.startswith("BATCHFLEET_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["--redis-url", redis_url, "--state-dir", str(state), "--run", RUN, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def summary(out: str) -> tuple[int, str]:
    """(lines, counts) of what `producer enqueue` printed: `FILE: N lines in S s (R/s): COUNTS; store P`."""
    m = re.search(r": ([\d,]+) lines in \S+ s \([\d,]+/s\): (.*); store ", out)
    assert m, out
    return int(m.group(1).replace(",", "")), m.group(2)


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


def simple(n: int, prefix: str = "p", **extra: object) -> list[object]:
    return [{"id": f"{prefix}{i}", "prompt": f"text {i}", **extra} for i in range(n)]


def job_prompt(r: redis.Redis, jid: str) -> Prompt:
    _, args, _ = parse_job_data(r.hget(Keys.job(jid), "data"))
    return Prompt.from_dict(args[0])


def work(redis_url: str, queues: list[str], n: int = 10**9, *, fail: Callable[[str], bool] = lambda cid: False,
         keep: Callable[[str], bool] = lambda cid: True, completion_tokens: int = 10, hold: bool = False,
         run: str = RUN) -> list[Result]:
    """Play one worker: claim up to `n` jobs from `queues` with the real Ledger and finish each one whose
    custom_id `keep` selects (a success, or a final failure like HTTP 400 where `fail` says so); the
    others are handed back. `hold`: claim and keep everything in flight (never finish, never renew)."""

    async def go() -> list[Result]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys(run), worker="w0", lease_ttl_s=600)
        try:
            claims = await ledger.claim(n, queues)
            if hold:
                return []
            out, back = [], []
            for c in claims:
                _, args, _ = parse_job_data(c.data)
                p = Prompt.from_dict(args[0])
                if not keep(p.cid):
                    back.append(c)
                    continue
                if fail(p.cid):
                    res = Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=400, worker="w0", fp=p.fp,
                                 error={"code": "invalid_prompt", "message": "too long"})
                else:
                    res = Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=200, worker="w0", fp=p.fp,
                                 body={"id": "cmpl-" + p.cid, "choices": [{"text": "ok"}],
                                       "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}})
                ledger.finish(c, res, exc_string="invalid_prompt: too long" if fail(p.cid) else "")
                out.append(res)
            await ledger.flush()
            await ledger.hand_back(back)
            return out
        finally:
            await client.aclose()

    return asyncio.run(go())


def queued_ids(r: redis.Redis, *queues: str) -> list[str]:
    return [j.decode() for q in queues for j in r.lrange(Keys.queue(q), 0, -1)]
