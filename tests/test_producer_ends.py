"""`producer cancel` and `producer purge` against a real Redis, with the worker's own Ledger playing the
workers (no processes): what Redis holds afterwards, what the export says, exit codes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.jobs import trimmed_data
from batchfleet.keys import STATUS_TTL_S, Keys
from batchfleet.records import WorkerStatus
from producer.ends import run_jobs

from .test_producer_helpers import RUN, Cli, make_cli, queued_ids, simple, work, write_jsonl


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def test_cancel_removes_every_job_without_a_result_and_exports_one_line_per_prompt(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(10))), "--queues", "gpu0",
               "--no-progress")[0] == 0
    keys = Keys(RUN)
    work(redis_url, ["gpu0"], 4, fail=lambda cid: cid == "p3")  # p0-p2 succeed, p3 fails: results in Redis
    work(redis_url, ["gpu0"], 2, hold=True)  # p4, p5 in flight (leased, RQ's started registry)
    assert len(queued_ids(r, "gpu0")) == 4 and r.zcard(keys.leases) == 2

    rc, out, err = cli("cancel", "--wait", "0")
    assert rc == 0, err
    assert "6 prompt(s) cancelled (jobs removed from Redis: 4 queued, 2 in flight)" in out
    assert "4 collected just now" in out
    assert queued_ids(r, "gpu0") == [] and r.zcard(keys.leases) == 0 and r.zcard(Keys.started("gpu0")) == 0
    assert set(run_jobs(r, RUN)) == {j.decode() for j in r.zrange(Keys.failed("gpu0"), 0, -1)}  # only p3's
    assert r.hget(keys.cancel, "at") is not None
    # the run has ended: its keys expire (BATCHFLEET_FINISHED_TTL_S, default 7 days), the marker says so
    assert r.hget(keys.meta, "finished") is not None
    assert all(0 < r.ttl(k) <= 7 * 24 * 3600 for k in (keys.meta, keys.stats, keys.cancel))

    out_file = tmp_path / "out.jsonl"
    rc, out, _ = cli("export", str(out_file))
    lines = [orjson.loads(x) for x in out_file.read_bytes().splitlines()]
    assert rc == 0 and "6 line(s) are prompts the run's cancel took back" in out
    assert [x["custom_id"] for x in lines] == [f"p{i}" for i in range(10)]
    assert Counter(x["error"]["code"] if x["error"] else x["response"]["status_code"] for x in lines) == {
        200: 3, 400: 1, "cancelled": 6}
    st = orjson.loads(cli("status", "--json")[1])
    assert st["totals"]["cancelled"] == 6 and st["totals"]["pending"] == 0
    assert "6 cancelled, 0 pending" in cli("status")[1]
    # a second cancel changes nothing
    assert cli("cancel", "--wait", "0")[0] == 0
    assert len(out_file.read_bytes().splitlines()) == 10


def test_collected_failures_keep_a_stub_that_names_the_prompt(cli: Cli, r: redis.Redis, redis_url: str,
                                                              tmp_path: Path) -> None:
    rows = [{"id": "big", "prompt": "x" * 200_000}, {"id": "ok", "prompt": "y"}]
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--queues", "gpu0", "--no-progress")[0] == 0
    work(redis_url, ["gpu0"], fail=lambda cid: cid == "big")
    (jid,) = run_jobs(r, RUN)
    assert r.hstrlen(Keys.job(jid), "data") > 200_000
    assert cli("collect")[0] == 0
    assert r.hget(Keys.job(jid), "data") == trimmed_data(RUN, "big", 1)
    assert int(r.hget(Keys.job(jid), "trimmed")) > 200_000
    assert r.ttl(Keys.job(jid)) > 0  # a failed job's hash no longer lives forever


def _live(r: redis.Redis, run: str, name: str) -> None:
    k = Keys(run)
    r.sadd(k.workers, name)
    r.set(k.status(name), WorkerStatus(worker=name, host="h", queue="gpu0", gpu=0, state="serving").to_json(),
          ex=STATUS_TTL_S)


def test_purge_needs_yes_refuses_live_workers_and_then_leaves_nothing_of_the_run(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(8))), "--queues", "gpu0,gpu1",
               "--no-progress")[0] == 0
    work(redis_url, ["gpu0"], 2, fail=lambda cid: True)  # two in RQ's failed registry
    work(redis_url, ["gpu1"], 1, hold=True)
    _live(r, RUN, "w1")
    # another run on its own queue: untouched by the purge
    other = Keys("other")
    r.hset(other.stats, "enqueued", 1)
    r.rpush(Keys.queue("other.gpu0"), "bf-x")
    before = sorted(r.scan_iter(match="*"))

    rc, _, err = cli("purge", RUN)
    assert rc == 2 and "--yes" in err and sorted(r.scan_iter(match="*")) == before
    rc, _, err = cli("purge", RUN, "--yes")
    assert rc == 2 and "1 live worker(s)" in err and sorted(r.scan_iter(match="*")) == before
    rc, out, err = cli("purge", RUN, "--yes", "--force")
    assert rc == 0, err
    assert "purged run t: 8 RQ job(s)" in out
    left = sorted(k.decode() for k in r.scan_iter(match="*"))
    assert left == sorted([other.stats, Keys.queue("other.gpu0"), "rq:queues"]) or \
        left == sorted([other.stats, Keys.queue("other.gpu0")])
    assert not any(k.startswith(f"bf:{RUN}:") for k in left)
    assert run_jobs(r, RUN) == {}
    assert {m.decode() for m in r.smembers("rq:queues")} <= {Keys.queue("other.gpu0")}
