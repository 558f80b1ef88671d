"""The export is OpenAI's batch output format for failures too: an HTTP error answer in `response`
(its status and the server's body), `error` only for a request with no answer; `--errors FILE` splits
the lines as OpenAI's error file does. Real Redis, the worker's Ledger, the worker's own dispatcher."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.jobs import parse_job_data
from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from worker.ledger import Ledger

from .test_producer_helpers import RUN, Cli, make_cli, simple, write_jsonl
from .test_records import SERVER_400, openai_shaped


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def finish(redis_url: str, outcome: dict[str, tuple[int, dict | None, dict | None]]) -> None:
    """Claim every job of gpu0 and finish each with (status, body, error) = outcome[custom_id]."""

    async def go() -> None:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys(RUN), worker="w0", lease_ttl_s=600)
        try:
            for c in await ledger.claim(100, ["gpu0"]):
                p = Prompt.from_dict(parse_job_data(c.data)[1][0])
                status, body, error = outcome[p.cid]
                ledger.finish(c, Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=status, body=body, error=error,
                                        fp=p.fp), exc_string="" if error is None else error["code"])
            await ledger.flush()
        finally:
            await client.aclose()

    asyncio.run(go())


def test_errors_file_takes_http_errors_and_unanswered_requests_with_openais_shape(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(4))
    assert cli("enqueue", str(f), "--queues", "gpu0", "--no-progress")[0] == 0
    ok = {"choices": [{"text": "fine"}], "usage": {"completion_tokens": 1}}
    finish(redis_url, {
        "p0": (200, ok, None),
        "p1": (400, SERVER_400, {"code": "invalid_prompt", "message": "HTTP 400: too long"}),
        "p2": (0, None, {"code": "retries_exhausted", "message": "ConnectionRefusedError (after 3 attempts)"}),
        "p3": (200, ok, None),
    })
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    rc, said, err = cli("export", str(out), "--errors", str(errors))
    assert rc == 0, err
    assert "wrote 2 lines" in said and "2 failed prompt(s) to" in said
    good = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    bad = [orjson.loads(x) for x in errors.read_bytes().splitlines()]
    for line in good + bad:
        openai_shaped(line)
    assert [x["custom_id"] for x in good] == ["p0", "p3"] and all(x["response"]["body"] == ok for x in good)
    assert [x["custom_id"] for x in bad] == ["p1", "p2"]
    assert bad[0]["error"] is None and bad[0]["response"]["status_code"] == 400
    assert bad[0]["response"]["body"] == SERVER_400  # the server's own body, as it answered
    assert bad[1]["response"] is None and bad[1]["error"]["code"] == "retries_exhausted"
