"""Helpers for the producer tests (no tests here): run the CLI in-process, and play a worker that
finishes a job exactly as the worker contract says (one MULTI: XADD result, SADD done, HINCRBY stats;
DEL the job on success, RQ's failed registry on failure)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis
from rq.job import Job

from batchfleet.keys import FAILURE_TTL_S, Keys
from batchfleet.records import Prompt, Result
from batchfleet.serializer import OrjsonSerializer
from producer.cli import main

RUN = "t"
Cli = Callable[..., tuple[int, str, str]]


def make_cli(redis_url: str, state: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> Cli:
    for name in list(os.environ):
        if name.startswith("BATCHFLEET_") or name == "REDIS_URL":
            monkeypatch.delenv(name)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(["--redis-url", redis_url, "--state-dir", str(state), "--run", RUN, *args])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows))
    return path


def simple(n: int, prefix: str = "p") -> list[object]:
    return [{"id": f"{prefix}{i}", "prompt": f"text {i}"} for i in range(n)]


def job_prompt(r: redis.Redis, jid: str) -> tuple[Prompt, str]:
    job = Job.fetch(jid, connection=r, serializer=OrjsonSerializer)
    return Prompt.from_dict(job.args[0]), job.origin


def finish(r: redis.Redis, jid: str, *, ok: bool = True, completion_tokens: int = 10,
           take: bool = True, prompt: tuple[Prompt, str] | None = None) -> Result:
    """Play a worker finishing job `jid` for good (success, or a final failure like HTTP 400).
    `prompt` (from `job_prompt`) stands in for a job hash that a success already deleted."""
    (p, q), keys = prompt or job_prompt(r, jid), Keys(RUN)
    if ok:
        body = {"id": "cmpl-" + p.cid, "choices": [{"text": "ok"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}}
        res = Result(cid=p.cid, jid=jid, seq=p.seq, status_code=200, body=body, worker="w0")
    else:
        res = Result(cid=p.cid, jid=jid, seq=p.seq, status_code=400,
                     error={"code": "400", "message": "too long"}, worker="w0")
    outcome = "succeeded" if ok else "failed"
    pipe = r.pipeline(transaction=True)
    if take:
        pipe.lrem(Keys.queue(q), 0, jid)
    pipe.xadd(keys.results, {"r": res.to_json()})
    pipe.sadd(keys.done, jid)
    pipe.hincrby(keys.stats, outcome, 1)
    pipe.hincrby(keys.stats, f"{outcome}:{q}", 1)
    pipe.hincrby(keys.stats, "prompt_tokens", 3)
    pipe.hincrby(keys.stats, "completion_tokens", completion_tokens if ok else 0)
    if ok:
        pipe.delete(Keys.job(jid))
    else:
        pipe.zadd(Keys.failed(q), {jid: time.time() + FAILURE_TTL_S})
        pipe.hset(Keys.job(jid), "status", "failed")
    pipe.execute()
    return res


def queued_ids(r: redis.Redis, *queues: str) -> list[str]:
    return [j.decode() for q in queues for j in r.lrange(Keys.queue(q), 0, -1)]
