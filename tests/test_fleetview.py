"""One reading of the fleet (batchfleet/fleetview.py) and everything that shows it: `producer status`,
the head's window, `supervisor status`/`watch`, Prometheus and `batchfleet run`'s progress line, each
driven for real over one Redis state (a real redis-server, the real store, the worker's own Ledger)."""

from __future__ import annotations

import io
import logging
import re
import time
from pathlib import Path

import orjson
import pytest
import redis
from prometheus_client import generate_latest

from batchfleet.config import Config
from batchfleet.fleetview import FleetView, eta_text, read_fleet_view
from batchfleet.keys import STATUS_TTL_S, Keys
from batchfleet.records import ServerMetrics, WorkerStatus
from fleetrun.cli import Screen
from producer.head import Head
from producer.status import gather_progress
from producer.store import Store
from supervisor.autopilot import PilotState
from supervisor.cli import main as supervisor
from supervisor.fleet import read_fleet
from supervisor.prom import FleetMetrics

from .test_producer_helpers import RUN, Cli, make_cli, simple, work, write_jsonl

K = Keys(RUN)


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys, env={"BATCHFLEET_WINDOW_DEFAULT": "5"})


def publish(r: redis.Redis, ws: WorkerStatus, *, age_s: float = 0.0, raw: bytes | None = None) -> None:
    """A worker's status record as a worker writes it (with its TTL), written `age_s` seconds ago."""
    r.set(K.status(ws.worker), raw or ws.to_json(), px=int((STATUS_TTL_S - age_s) * 1000))
    r.sadd(K.workers, ws.worker)


def worker(name: str, queue: str, **kw: object) -> WorkerStatus:
    return WorkerStatus(**{"worker": name, "host": "h", "queue": queue, "gpu": 0, "state": "serving", **kw})


def head_pass(redis_url: str, tmp_path: Path, r: redis.Redis) -> None:
    """One pass of the real head: collect, audit, feed the window, publish the store's figures."""
    head = Head(Config.from_env(run=RUN, redis_url=redis_url, state_dir=tmp_path / "state"), explicit=True,
                log=io.StringIO(), r=r)
    try:
        head.step()
    finally:
        assert head.store is not None
        head.store.close()


def test_the_newest_record_of_each_queue_counts_judged_on_redis_clock_and_a_silent_one_counts_for_nothing(
        r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    hour = 3600.0
    # gpu0: a worker killed and restarted under a new name. The old record, written 20 s ago by a host
    # whose clock is an hour ahead, must lose to the new one, whose host's clock is an hour behind.
    publish(r, worker("old", "gpu0", effective_max=37, tokens_per_s=500.0, ts=time.time() + hour), age_s=20)
    publish(r, worker("new", "gpu0", effective_max=72, tokens_per_s=900.0, ts=time.time() - hour), age_s=1)
    # gpu1: its worker stopped writing 15 s ago (killed, or stuck): silent, shown, counted for nothing.
    publish(r, worker("quiet", "gpu1", effective_max=40, tokens_per_s=700.0, in_flight=40), age_s=15)
    # gpu2: starting its server; its last measure (99 tok/s) is not the fleet's.
    publish(r, worker("starting", "gpu2", state="starting", effective_max=12, tokens_per_s=99.0), age_s=2)
    # unreadable: not JSON, and a queue name that is no queue name; "gone": its record expired.
    r.set(K.status("junk"), b"{not json", ex=STATUS_TTL_S)
    publish(r, worker("evil", "../x", effective_max=10), age_s=1)
    r.sadd(K.workers, "junk", "gone")

    for _ in range(2):
        view = read_fleet_view(r, K)
        assert [w.worker for w in view.workers] == ["new", "quiet", "starting"]
        assert [w.worker for w in view.live] == ["new", "starting"] and view.silent == {"quiet"}
        assert view.capacity == {"gpu0": 72, "gpu2": 12}
        assert view.tokens_per_s == 900.0 and view.in_flight == 0
        assert view.not_serving == [("starting", "gpu2", "starting", "")]
        assert (view.known, view.unreadable, view.gone) == (7, 2, ("gone",))
    said = [rec.getMessage() for rec in caplog.records if rec.name == "batchfleet.fleetview"]
    assert len(said) == 2 and all("this version cannot read it" in s for s in said)  # once each, two reads


def test_the_eta_is_one_formula_with_its_lower_bound_and_its_text() -> None:
    serving = worker("w0", "gpu0", tokens_per_s=50.0, in_flight=4,
                     metrics=ServerMetrics(generation_tokens_total=800.0))
    view = FleetView(workers=[serving], stats={"succeeded": 4, "failed": 1, "completion_tokens": 400})
    assert view.mean_completion_tokens == 100 and view.prompts_per_s == 0.5
    assert (view.eta(35).seconds, view.eta(35).text) == (70.0, "1m10s")
    assert view.eta(0).text == "0m00s" and view.eta(4000).text == "2h13m"
    # Without the store's count: the head's figure, else what Redis holds (waiting + queued + in flight).
    assert view.remaining() == 4 and view.eta().seconds == 8.0
    assert FleetView(workers=[serving], stats={"store_waiting": 10}, backlog={"gpu0": 6}).remaining() == 20
    assert FleetView(workers=[serving], stats={"store_pending": 35, "store_waiting": 10}).remaining() == 35
    # Before any prompt succeeded: tokens generated so far per prompt in flight, a lower bound.
    early = FleetView(workers=[serving])
    assert early.eta(10).lower_bound and early.eta(10).text == "at least 0m40s"  # 10 x 800/4 tokens at 50/s
    assert FleetView(workers=[worker("w0", "gpu0")]).eta(10).text == "unknown"  # nothing measured yet
    assert eta_text(None) == "unknown" and eta_text(float("nan")) == "unknown"


def test_every_command_prints_the_same_eta_for_the_same_run(cli: Cli, r: redis.Redis, redis_url: str,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(40))), "--queues", "gpu0,gpu1",
               "--no-progress")[0] == 0
    work(redis_url, ["gpu0"], 4, completion_tokens=100)  # 4 succeeded, 100 completion tokens each
    work(redis_url, ["gpu0"], 1, fail=lambda cid: True)  # 1 failed for good
    work(redis_url, ["gpu1"], 2, hold=True)  # 2 in flight
    publish(r, worker("w0", "gpu0", effective_max=4, tokens_per_s=30.0))
    publish(r, worker("w1", "gpu1", effective_max=4, tokens_per_s=20.0, in_flight=2))
    head_pass(redis_url, tmp_path, r)  # collects the 5 results, tops the window up, publishes the store's figures
    # 35 prompts pending x 100 tokens / 50 tokens/s
    eta = "1m10s"

    rc, out, _ = cli("status")
    assert rc == 0 and f"ETA {eta}" in out
    st = orjson.loads(cli("status", "--json")[1])
    assert (st["totals"]["pending"], st["eta"], st["eta_s"]) == (35, eta, 70)

    store = Store.open(tmp_path / "state" / f"{RUN}.sqlite", run=RUN, readonly=True)
    try:
        progress = io.StringIO()
        Screen(progress, every_s=0).progress(gather_progress(r, K, store))  # `batchfleet run`'s progress line
    finally:
        store.close()
    assert f"ETA {eta}" in progress.getvalue()

    common = ["--redis-url", redis_url, "--run", RUN]
    assert supervisor([*common, "status"]) == 0
    assert f"ETA {eta}" in " ".join(capsys.readouterr().out.split())
    assert supervisor([*common, "watch", "--once", "--json"]) == 0
    snap = orjson.loads(capsys.readouterr().out)
    assert (snap["eta"], round(snap["eta_s"])) == (eta, 70)

    metrics = FleetMetrics()
    metrics.update(read_fleet(r, K), None, PilotState())
    assert "batchfleet_eta_seconds 70.0" in generate_latest(metrics.registry).decode()


def test_a_record_this_version_cannot_read_is_said_once_counted_and_shown(
        cli: Cli, r: redis.Redis, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(4))), "--no-progress")[0] == 0
    publish(r, worker("w0", "gpu0", effective_max=4, tokens_per_s=30.0))
    publish(r, worker("w1", "gpu1"), raw=b'{"worker": "w1", "queue": "gpu1", "gpu": "one"}')
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            rc, out, _ = cli("status")
            assert rc == 0 and "workers 1 live of 2" in out
            assert "1 status record(s) this version cannot read" in out
    said = [rec.getMessage() for rec in caplog.records if "'w1'" in rec.getMessage()]
    assert len(said) == 1 and "WorkerStatus.gpu" in said[0]


def test_a_worker_in_a_state_from_a_newer_version_keeps_its_queue_and_capacity_in_the_window(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(100))), "--queues", "gpu0",
               "--no-progress")[0] == 0
    publish(r, worker("w0", "gpu0", effective_max=4))
    future = orjson.loads(worker("w1", "gpu1", effective_max=12).to_json())
    future["state"] = "hibernating"  # a rolling upgrade: a newer worker, a state this version does not know
    publish(r, worker("w1", "gpu1"), raw=orjson.dumps(future))
    view = read_fleet_view(r, K)
    assert view.capacity == {"gpu0": 4, "gpu1": 12} and view.unreadable == 0
    head_pass(redis_url, tmp_path, r)
    assert (r.llen(Keys.queue("gpu0")), r.llen(Keys.queue("gpu1"))) == (8, 24)  # 2 x capacity each: not starved
    st = orjson.loads(cli("status", "--json")[1])
    assert st["queues"]["gpu1"]["workers_capacity"] == 12 and st["workers"]["live"] == 2


def _watch_once(redis_url: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert supervisor(["--redis-url", redis_url, "--run", RUN, "watch", "--once"]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_a_finished_runs_watch_says_finished_not_draining_nor_waiting_for_workers(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(3))), "--no-progress")[0] == 0
    work(redis_url, ["gpu0"], completion_tokens=20)
    publish(r, worker("w0", "gpu0", effective_max=4, tokens_per_s=0.0))  # idle, still up (e.g. under honcho)
    head_pass(redis_url, tmp_path, r)  # collects the last results: the run has finished
    text = _watch_once(redis_url, capsys)
    assert "the run has finished: done 3 | failed 0" in text and " idle" in text
    assert "draining" not in text and "no workers" not in text and "no live workers" not in text
    r.delete(K.status("w0"))  # its worker stopped (`batchfleet run` stops them at the end)
    text = _watch_once(redis_url, capsys)
    assert "the run has finished: done 3 | failed 0" in text
    assert "draining" not in text and not re.search(r"no (live )?workers", text)
