"""collect / export / status / recover against a real Redis, with the worker's own Ledger finishing jobs."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.config import Config
from batchfleet.jobs import job_id_for
from batchfleet.keys import FAILURE_TTL_S, STATUS_TTL_S, Keys
from batchfleet.records import Result, WorkerStatus
from producer.head import Head
from producer.store import Store

from .conftest import RedisServer
from .test_producer_helpers import RUN, Cli, make_cli, queued_ids, simple, work, write_jsonl


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def enqueue(cli: Cli, tmp_path: Path, n: int, queues: str = "gpu0", **extra: object) -> list[str]:
    f = write_jsonl(tmp_path / "in.jsonl", simple(n, **extra))
    assert cli("enqueue", str(f), "--queues", queues, "--no-progress")[0] == 0
    return [f"p{i}" for i in range(n)]


def export_lines(cli: Cli, out: Path, *args: str) -> tuple[int, str, list[dict]]:
    rc, _, err = cli("export", str(out), *args)
    return rc, err, [orjson.loads(x) for x in out.read_bytes().splitlines()]


def producer_env(redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_") and k != "REDIS_URL"}
    return {**env, "BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_RUN": RUN, **extra}


def test_collect_drains_stream_and_done(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 900)
    work(redis_url, ["gpu0"], 700)
    keys = Keys(RUN)
    assert (r.xlen(keys.results), r.scard(keys.done)) == (700, 700)
    rc, out, _ = cli("collect")
    assert rc == 0 and "700 succeeded" in out
    assert (r.xlen(keys.results), r.scard(keys.done)) == (0, 0)
    assert cli("collect")[1].startswith("collected 0 succeeded")


def test_export_order_shape_and_pending(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    cids = enqueue(cli, tmp_path, 6, "gpu0,gpu1")
    work(redis_url, ["gpu0", "gpu1"], keep=lambda c: c in ("p4", "p2", "p0"), fail=lambda c: c == "p2")
    out = tmp_path / "out.jsonl"
    rc, err, lines = export_lines(cli, out)
    assert rc == 1
    assert "3 prompts have no result yet, e.g. p1, p3, p5" in err
    assert [x["custom_id"] for x in lines] == ["p0", "p2", "p4"]
    ok, failed = lines[0], lines[1]
    assert set(ok) == {"id", "custom_id", "response", "error"}
    jid = job_id_for(RUN, "p0")
    assert ok["id"] == f"batch_req_{jid}" and ok["response"]["request_id"] == jid
    assert ok["response"]["body"]["usage"]["completion_tokens"] == 10
    # an HTTP error answer: its status and the server's body in `response`, `error` null (OpenAI's shape)
    assert failed["error"] is None and failed["response"] == {
        "status_code": 400, "request_id": job_id_for(RUN, "p2"), "body": {"error": {"message": "too long"}}}

    work(redis_url, ["gpu0", "gpu1"])
    rc, _, lines = export_lines(cli, out)
    assert rc == 0
    assert [x["custom_id"] for x in lines] == cids  # exactly one line per prompt, input order
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp left


def test_export_wait_gives_up_after_timeout(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 2)
    work(redis_url, ["gpu0"], 1)
    t0 = time.monotonic()
    rc, err, lines = export_lines(cli, tmp_path / "out.jsonl", "--wait", "--timeout", "0.3")
    assert rc == 1 and len(lines) == 1 and "p1" in err
    assert time.monotonic() - t0 < 10


def test_a_forged_result_is_never_exported(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 3)
    keys = Keys(RUN)
    forged = [
        Result(cid="nobody-sent-this", jid=job_id_for(RUN, "nobody-sent-this"), seq=1, status_code=200, body={}),
        Result(cid="p0", jid="bf-000000000000000000000000", seq=1, status_code=200, body={"forged": True}),
    ]
    for res in forged:
        r.xadd(keys.results, {"r": res.to_json()})
    r.xadd(keys.results, {"r": b"{not a record"})
    r.xadd(keys.results, {"x": b"1"})
    work(redis_url, ["gpu0"])
    rc, out, err = cli("collect")
    assert rc == 0 and "collected 3 succeeded" in out and "dropped 4 result(s)" in out
    rc, err, lines = export_lines(cli, tmp_path / "out.jsonl")
    assert rc == 0
    assert [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    assert all("forged" not in x["response"]["body"] for x in lines)
    assert "4 result(s) answered no prompt of this run" in err
    assert r.xlen(keys.results) == 0


def test_status_tells_where_every_prompt_is(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHFLEET_WINDOW_DEFAULT", "5")
    enqueue(cli, tmp_path, 14, "gpu0,gpu1")  # 10 fed (5 per queue), 4 wait in the store
    keys = Keys(RUN)
    work(redis_url, ["gpu0"], 2, completion_tokens=100)  # 2 done, not collected yet
    cli("collect")  # ... now collected
    work(redis_url, ["gpu0"], 1, fail=lambda c: True)  # 1 failed for good (collected below)
    cli("collect")
    work(redis_url, ["gpu1"], 1, completion_tokens=100)  # 1 done, not collected
    work(redis_url, ["gpu1"], 2, hold=True)  # 2 in flight
    lost = queued_ids(r, "gpu1")[0]
    r.lrem(Keys.queue("gpu1"), 0, lost)
    r.delete(Keys.job(lost))  # 1 lost: nowhere in Redis
    foreign = queued_ids(r, "gpu0")[0]  # 1 failed by a stock RQ worker, as `rq worker` leaves it
    r.lrem(Keys.queue("gpu0"), 0, foreign)
    r.hset(Keys.job(foreign), mapping={"status": "failed", "worker_name": "stock-1"})
    r.zadd(Keys.failed("gpu0"), {foreign: time.time() + FAILURE_TTL_S})
    # Records as workers write them (expiring). w1's host clock is an hour behind: still fresh, since
    # freshness is the record's Redis TTL, not its writer's clock. "gone" stopped writing: no record.
    for name, queue, tps, skew in (("w0", "gpu0", 30.0, 0), ("w1", "gpu1", 20.0, -3600)):
        ws = WorkerStatus(worker=name, host="h", queue=queue, gpu=0, state="serving", tokens_per_s=tps,
                          effective_max=4, ts=time.time() + skew)
        r.set(keys.status(name), ws.to_json(), ex=STATUS_TTL_S)
    r.sadd(keys.workers, "w0", "w1", "gone")

    before = (r.xlen(keys.results), r.scard(keys.done))
    rc, out, _ = cli("status", "--json")
    assert rc == 0
    st = orjson.loads(out)
    t = st["totals"]
    assert t == {"prompts": 14, "succeeded": 2, "failed": 1, "pending": 11, "waiting": 4, "queued": 2, "in_flight": 2,
                 "done_not_collected": 1, "failed_foreign": 1, "lost": 1, "in_redis": 7,
                 "cancelled": 0}
    assert t["waiting"] + t["queued"] + t["in_flight"] + t["done_not_collected"] + t["failed_foreign"] + t["lost"] \
        == t["pending"]
    assert st["foreign_failures"] == [{"queue": "gpu0", "worker": "stock-1", "count": 1}]
    assert st["repair"] == f"producer --run {RUN} --state-dir {tmp_path / 'state'} recover"
    assert list(st["queues"]) == ["gpu0", "gpu1"]
    assert st["queues"]["gpu0"]["failed_registry"] == 2 and st["queues"]["gpu0"]["workers_capacity"] == 4
    assert st["workers"] == {"live": 2, "known": 3, "silent": 0, "unreadable": 0, "not_serving": []}
    assert st["fleet_tokens_per_s"] == 50.0 and st["mean_completion_tokens"] == 100.0
    assert st["prompts_per_s"] == 0.5 and st["eta_s"] == 22 and st["eta"] == "0m22s"
    assert (r.xlen(keys.results), r.scard(keys.done)) == before  # status collects nothing
    rc, out, _ = cli("status")
    assert rc == 0 and "1 prompt(s) on queue gpu0 were failed by worker stock-1" in out and "1 LOST" in out
    assert st["repair"] in out and "ETA 0m22s" in out

    # recover requeues exactly the lost and the foreign-failed prompt, through the window
    rc, out, _ = cli("recover")
    assert rc == 0 and "requeued 2 prompt(s) (1 that were nowhere in Redis, 1 failed by a non-batchfleet" in out
    assert r.zscore(Keys.failed("gpu0"), foreign) is None
    t = orjson.loads(cli("status", "--json")[1])["totals"]
    assert (t["lost"], t["failed_foreign"], t["in_flight"], t["done_not_collected"]) == (0, 0, 2, 1)
    assert t["waiting"] + t["queued"] == 8


def test_no_phantom_default_queue(cli: Cli, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 2, "jobA.gpu3")
    st = orjson.loads(cli("status", "--json")[1])
    assert list(st["queues"]) == ["jobA.gpu3"]


def test_status_from_another_directory_reads_the_runs_store_and_creates_nothing(
        cli: Cli, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 5)
    work(redis_url, ["gpu0"], 2)
    cli("collect")
    work(redis_url, ["gpu0"], 1)  # a result left in Redis: status must not collect it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store_file = tmp_path / "state" / f"{RUN}.sqlite"
    before = Store.open(store_file, run=RUN, readonly=True).counts()
    done = subprocess.run([str(Path(sys.executable).parent / "producer"), "status", "--json"], cwd=elsewhere,
                          env=producer_env(redis_url), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    st = orjson.loads(done.stdout)
    assert st["store"]["path"] == str(store_file) and st["totals"]["succeeded"] == 2
    assert st["totals"]["done_not_collected"] == 1
    assert list(elsewhere.iterdir()) == []  # no .batchfleet, no store
    assert Store.open(store_file, run=RUN, readonly=True).counts() == before


def test_collect_into_another_store_is_refused(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    enqueue(cli, tmp_path, 3)
    work(redis_url, ["gpu0"])
    right = tmp_path / "state" / f"{RUN}.sqlite"
    other = make_cli(redis_url, tmp_path / "other", monkeypatch, capsys)
    for cmd in (("collect",), ("export", str(tmp_path / "x.jsonl")), ("status",), ("head",)):
        rc, _, err = other(*cmd)
        assert rc == 2, cmd
        assert f"store is {right} on " in err and f"--state-dir {tmp_path / 'state'}" in err, err
    assert not (tmp_path / "other").exists() and r.xlen(Keys(RUN).results) == 3
    # a marker naming another host
    r.hset(Keys(RUN).meta, "host", "gpuhost-7")
    rc, _, err = cli("collect")
    assert rc == 2 and f"store is on host gpuhost-7 at {right}" in err
    assert r.xlen(Keys(RUN).results) == 3


def test_status_and_export_work_from_the_store_with_redis_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        cli = make_cli(server.url, tmp_path / "state", monkeypatch, capsys)
        enqueue(cli, tmp_path, 4)
        work(server.url, ["gpu0"], 3)
        cli("collect")
        server.stop()
        rc, out, _ = cli("status")
        assert rc == 0 and "is DOWN" in out and "prompts 4: 3 succeeded, 0 failed, 1 pending" in out
        st = orjson.loads(cli("status", "--json")[1])
        assert st["redis_up"] is False and st["totals"]["in_redis"] == 1 and st["totals"]["lost"] is None
        rc, err, lines = export_lines(cli, tmp_path / "out.jsonl")
        assert rc == 1 and "is down" in err and [x["custom_id"] for x in lines] == ["p0", "p1", "p2"]
    finally:
        server.stop()


def test_head_stops_on_sigterm(redis_url: str, r: redis.Redis, cli: Cli, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 3)
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "collect", "--follow", "--interval", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=producer_env(redis_url, BATCHFLEET_STATE_DIR=str(tmp_path / "state")))
    try:
        work(redis_url, ["gpu0"])
        deadline = time.monotonic() + 30
        while r.xlen(Keys(RUN).results) or r.scard(Keys(RUN).done):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert b"stopped: collected 3 succeeded, 0 failed" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_head_waits_for_enqueue_creates_nothing_and_rewrites_a_malformed_marker(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    config = Config(run=RUN, redis_url=redis_url, state_dir=tmp_path / "state")
    log = io.StringIO()
    head = Head(config, explicit=True, interval_s=0.05, log=log, r=r)
    assert head.run(until=time.monotonic() + 0.5) == 0
    assert log.getvalue().count("waiting for `producer enqueue`") == 1 and not (tmp_path / "state").exists()
    enqueue(cli, tmp_path, 3)
    log = io.StringIO()
    head = Head(config, explicit=True, interval_s=0.05, log=log, r=r)
    head.step()  # opens the run's store
    r.hset(Keys(RUN).meta, "path", "relative/not/allowed")  # a bad record in Redis: never a reason to exit
    work(redis_url, ["gpu0"], 2)
    head.step()
    head.step()
    assert "run marker: unexpected values" in log.getvalue() and "rewriting the run marker" in log.getvalue()
    assert r.hget(Keys(RUN).meta, "path").decode() == str(tmp_path / "state" / f"{RUN}.sqlite")
    assert "+2 ok" in log.getvalue()
    assert head.run(until=time.monotonic() + 0.3) == 0
