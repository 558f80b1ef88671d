"""collect / export / status against a real Redis, with a simulated worker writing results."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import STATUS_TTL_S, Keys
from batchfleet.records import WorkerStatus

from .test_producer_helpers import RUN, Cli, finish, job_prompt, make_cli, queued_ids, simple, write_jsonl


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def enqueue(cli: Cli, tmp_path: Path, n: int, queues: str = "gpu0") -> list[str]:
    f = write_jsonl(tmp_path / "in.jsonl", simple(n))
    assert cli("enqueue", str(f), "--queues", queues, "--no-progress")[0] == 0
    return [f"p{i}" for i in range(n)]


def export_lines(cli: Cli, out: Path, *args: str) -> tuple[int, str, list[dict]]:
    rc, _, err = cli("export", str(out), *args)
    return rc, err, [orjson.loads(x) for x in out.read_bytes().splitlines()]


def test_collect_drains_stream_and_done(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 1500)
    for jid in queued_ids(r, "gpu0")[:1200]:
        finish(r, jid)
    keys = Keys(RUN)
    assert (r.xlen(keys.results), r.scard(keys.done)) == (1200, 1200)
    rc, out, _ = cli("collect")
    assert rc == 0 and "1,200 succeeded" in out
    assert (r.xlen(keys.results), r.scard(keys.done)) == (0, 0)
    assert cli("collect")[1].startswith("collected 0 succeeded")


def test_success_wins_over_failure(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 2)
    a, b = queued_ids(r, "gpu0")
    finish(r, a, ok=False)  # a fails, is requeued (`rq requeue`) and then succeeds
    cli("collect")
    finish(r, a, take=False)
    pb = job_prompt(r, b)
    finish(r, b)  # b succeeds, then a stray later failure arrives
    finish(r, b, ok=False, take=False, prompt=pb)
    cli("collect")
    rc, _, lines = export_lines(cli, tmp_path / "out.jsonl")
    assert rc == 0
    assert [(x["custom_id"], x["error"], x["response"]["status_code"]) for x in lines] == [
        ("p0", None, 200), ("p1", None, 200)]


def test_export_order_shape_and_pending(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    cids = enqueue(cli, tmp_path, 6, "gpu0,gpu1")
    jids = {job_prompt(r, j)[0].cid: j for j in queued_ids(r, "gpu0", "gpu1")}
    for cid in ("p4", "p2", "p0"):  # finishing order differs from input order
        finish(r, jids[cid], ok=cid != "p2")
    out = tmp_path / "out.jsonl"
    rc, err, lines = export_lines(cli, out)
    assert rc == 1
    assert "3 prompts have no result yet, e.g. p1, p3, p5" in err
    assert [x["custom_id"] for x in lines] == ["p0", "p2", "p4"]
    ok, failed = lines[0], lines[1]
    assert set(ok) == {"id", "custom_id", "response", "error"}
    assert ok["id"] == f"batch_req_{jids['p0']}"
    assert ok["response"]["request_id"] == jids["p0"] and ok["response"]["body"]["usage"]["completion_tokens"] == 10
    assert failed["error"] == {"code": "400", "message": "too long"} and failed["response"]["status_code"] == 400

    for cid in ("p1", "p3", "p5"):
        finish(r, jids[cid])
    rc, _, lines = export_lines(cli, out)
    assert rc == 0
    assert [x["custom_id"] for x in lines] == cids  # exactly one line per prompt, input order
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp left


def test_export_wait_gives_up_after_timeout(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 2)
    finish(r, queued_ids(r, "gpu0")[0])
    t0 = time.monotonic()
    rc, err, lines = export_lines(cli, tmp_path / "out.jsonl", "--wait", "--timeout", "0.3")
    assert rc == 1 and len(lines) == 1 and "p1" in err
    assert time.monotonic() - t0 < 5


def test_status_json(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 6, "gpu0,gpu1")
    g0, g1 = queued_ids(r, "gpu0"), queued_ids(r, "gpu1")
    finish(r, g0[0], completion_tokens=100)
    finish(r, g0[1], ok=False)
    r.lrem(Keys.queue("gpu1"), 0, g1[0])
    r.zadd(Keys.started("gpu1"), {g1[0]: time.time() + 60})  # in flight
    keys = Keys(RUN)
    # Records as workers write them (expiring). w1's host clock is an hour behind: still fresh, since
    # freshness is the record's Redis TTL, not its writer's clock. "gone" stopped writing: no record.
    for name, tps, skew in (("w0", 30.0, 0), ("w1", 20.0, -3600)):
        ws = WorkerStatus(worker=name, host="h", queue="gpu0", gpu=0, state="serving", tokens_per_s=tps,
                          ts=time.time() + skew)
        r.set(keys.status(name), ws.to_json(), ex=STATUS_TTL_S)
    r.sadd(keys.workers, "w0", "w1", "gone")
    rc, out, _ = cli("status", "--json")
    assert rc == 0
    st = orjson.loads(out)
    assert st["queues"] == {
        "gpu0": {"queued": 1, "in_flight": 0, "succeeded": 1, "failed": 1, "failed_registry": 1},
        "gpu1": {"queued": 2, "in_flight": 1, "succeeded": 0, "failed": 0, "failed_registry": 0},
    }
    assert st["totals"] == {"prompts": 6, "succeeded": 1, "failed": 1, "pending": 4, "queued": 3,
                            "in_flight": 1, "enqueued": 6}
    assert st["workers"] == {"fresh": 2, "known": 3}
    assert st["fleet_tokens_per_s"] == 50.0
    assert st["mean_completion_tokens"] == 100.0
    assert st["prompts_per_s"] == 0.5 and st["eta_s"] == 8 and st["eta"] == "0m08s"
    assert r.xlen(keys.results) == 0  # status collected first
    rc, out, _ = cli("status")
    assert rc == 0 and "ETA 0m08s" in out and "gpu1" in out


def test_status_eta_unknown_without_workers(cli: Cli, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 2)
    st = orjson.loads(cli("status", "--json")[1])
    assert (st["eta_s"], st["eta"], st["prompts_per_s"]) == (None, "unknown", None)


def test_collect_follow_stops_on_sigterm(redis_url: str, r: redis.Redis, cli: Cli, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 3)
    env = {"BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_STATE_DIR": str(tmp_path / "state"),
           "BATCHFLEET_RUN": RUN}
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "collect", "--follow", "--interval", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    for jid in queued_ids(r, "gpu0"):
        finish(r, jid)
    deadline = time.monotonic() + 20
    while r.xlen(Keys(RUN).results) or r.scard(Keys(RUN).done):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert b"collected 3 succeeded" in out
