"""The store is the source of truth, the head feeds a window: end to end on real parts (redis-server,
`rq worker` processes with simulated SGLang servers, the `producer` CLI, honcho with the shipped
Procfile), through the faults of a long run: the head killed, Redis restarted with and without
persistence, a stock RQ worker eating jobs. Each test asserts exact counts in the export."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import Keys

from .conftest import RedisServer
from .fleet import BIN, ROOT, Fleet, expected_text, text_of, write_prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    """Fleets made by a test are stopped (workers and head) whatever happens."""
    made: list[Fleet] = []
    yield made
    for fleet in made:
        fleet.stop_all(timeout_s=20)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        s = RedisServer(tmp_path, *args)
        s.start()
        servers.append(s)
        return s

    yield make  # type: ignore[misc]
    for s in servers:
        s.stop()


def status(fleet: Fleet) -> dict:
    return orjson.loads(fleet.producer("status", "--json").stdout)


def export_exactly(fleet: Fleet, rows: list[dict], timeout_s: float = 240) -> list[dict]:
    """`producer export --wait`, then: one line per prompt, none twice, none missing, right texts."""
    out = fleet.tmp / "results.jsonl"
    done = fleet.producer("export", str(out), "--wait", "--timeout", str(timeout_s), check=False,
                          timeout_s=timeout_s + 60)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- head\n{fleet.head_log()[-3000:]}"
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert [i for i, n in Counter(ids).items() if n > 1] == []  # 0 duplicated
    assert ids == [r["id"] for r in rows]  # 0 lost, input order
    for row, line in zip(rows, lines, strict=True):
        assert line["error"] is None and text_of(line["response"]["body"]) == expected_text(row)
    return lines


def served(fleet: Fleet, gpus: range) -> int:
    return sum(sum(fleet.sim_record(g)["requests_by_endpoint"].values()) for g in gpus)


def test_the_head_feeds_a_window_and_a_restarted_head_resumes(tmp_path: Path, redis_url: str,
                                                              fleets: list[Fleet]) -> None:
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"BATCHFLEET_WINDOW_DEFAULT": "30", "BATCHFLEET_WINDOW_MAX": "40",
                                                   "SGLANG_SIM_TIME_SCALE": "40"})
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 400, max_tokens=24)
    out = fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues).stdout
    assert f"fed to Redis: {fleet.queue(0)} 30" in out and "370 prompt(s) wait in the store" in out
    fleet.start_worker(0)
    fleet.start_head()
    peak = 0

    def progress(n: int) -> bool:
        nonlocal peak
        peak = max(peak, fleet.r.llen(Keys.queue(fleet.queue(0))))
        return fleet.finished() >= n

    fleet.wait_for(lambda: progress(120), 120, "120 prompts with the head feeding")
    fleet.head.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    fleet.head.wait()  # type: ignore[union-attr]
    # Without the head the workers finish the window and idle; the rest waits in the store.
    q = fleet.queue(0)
    fleet.wait_for(lambda: fleet.r.llen(Keys.queue(q)) == 0 and fleet.r.zcard(Keys.started(q)) == 0, 60,
                   "the worker to drain the window")
    drained_at = time.time()  # the worker idles, nothing feeding it, over several of its status beats
    fleet.wait_for(lambda: all(s.ts > drained_at + 2 for s in fleet.statuses()), 60, "the idle worker's later beats")
    st = status(fleet)
    assert st["totals"]["queued"] == 0 and st["totals"]["in_flight"] == 0
    assert st["totals"]["waiting"] >= 100 and fleet.finished() < 400
    fleet.start_head()
    lines = export_exactly(fleet, rows)
    assert len(lines) == 400 and fleet.stats()["succeeded"] == 400
    assert peak <= 40, f"Redis held {peak} prompts, more than the window"
    fleet.stop_all()
    assert served(fleet, range(1)) == 400  # each prompt generated exactly once


def test_redis_restart_without_persistence_is_detected_and_repaired(tmp_path: Path, private_redis,
                                                                    fleets: list[Fleet]) -> None:
    server = private_redis()  # no persistence: a restart comes back empty
    fleet = Fleet(tmp_path, server.url, gpus=2, env={"BATCHFLEET_WINDOW_DEFAULT": "40", "SGLANG_SIM_TIME_SCALE": "20"})
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 300, max_tokens=32)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    for gpu in (0, 1):
        fleet.start_worker(gpu)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 60, 120, "some progress")
    assert fleet.stop_head() == 0
    server.stop()
    server.start()  # same port, no data: the marker, the queues, the leases, the counters are gone
    repair = f"producer --run {fleet.run} --state-dir {tmp_path / 'state'} recover"
    fleet.wait_for(lambda: all("Redis lost the data of run t" in fleet.worker_log(g) for g in (0, 1)), 60,
                   "both workers to notice the loss")
    for g in (0, 1):
        assert repair in fleet.worker_log(g)
    st = status(fleet)
    assert st["redis_lost_data"] is True and st["repair"] == repair
    assert st["totals"]["lost"] > 0 and st["totals"]["queued"] == 0
    text = fleet.producer("status").stdout
    assert "REDIS LOST THIS RUN'S DATA" in text and repair in text

    fleet.start_head()
    export_exactly(fleet, rows)
    log = fleet.head_log()
    assert log.count("WARNING: Redis lost the data of run t") == 1 and repair in log
    assert "requeued" in log
    assert status(fleet)["redis_lost_data"] is False


def test_the_head_rides_out_a_redis_outage(tmp_path: Path, private_redis, fleets: list[Fleet]) -> None:
    # A Redis that persists (AOF), down for a while mid-run: the head says so once, says when it is back,
    # and carries on; nothing needs repairing, nothing is lost or run twice. (The code path is the same
    # for a 60 s outage: every Redis error is caught in the loop, which retries each interval.)
    server = private_redis("--appendonly", "yes", "--appendfsync", "always")
    fleet = Fleet(tmp_path, server.url, gpus=1, env={"BATCHFLEET_WINDOW_DEFAULT": "30", "BATCHFLEET_WINDOW_MAX": "40",
                                                    "SGLANG_SIM_TIME_SCALE": "10"})
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 200, max_tokens=32)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    head = fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 40, 120, "some progress")
    server.stop()
    stopped = time.monotonic()
    fleet.wait_for(lambda: "head: lost Redis" in fleet.head_log(), 30, "the head to notice Redis gone")
    time.sleep(max(0.0, 8 - (time.monotonic() - stopped)))  # the outage itself: 8 s
    assert head.poll() is None
    server.start()
    fleet.r = redis.Redis.from_url(server.url)
    export_exactly(fleet, rows)
    assert head.poll() is None
    assert fleet.stop_all() == {0: 0} and head.returncode == 0
    log = fleet.head_log()
    assert log.count("head: lost Redis") == 1 and log.count("head: Redis is back") == 1, log[-3000:]
    assert "Redis lost the data" not in log and "nowhere in Redis" not in log
    assert fleet.stats()["succeeded"] == 200
    assert served(fleet, range(1)) == 200


def test_honcho_runs_the_shipped_procfile_through_a_redis_restart(tmp_path: Path, private_redis,
                                                                   fleets: list[Fleet]) -> None:
    server = private_redis("--appendonly", "yes", "--appendfsync", "always")
    # prefix "": the shipped Procfile's queue names (its own redis-server, so no other test's)
    fleet = Fleet(tmp_path, server.url, gpus=2, prefix="", env={"BATCHFLEET_WINDOW_DEFAULT": "30",
                                                                "SGLANG_SIM_TIME_SCALE": "20"})
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 240, max_tokens=32)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    log = (tmp_path / "honcho.log").open("wb")
    # The shipped Procfile, its collector and two GPU lines exactly as written (the supervisor is left out).
    honcho = subprocess.Popen([str(BIN / "honcho"), "start", "-f", str(ROOT / "Procfile"), "-d", str(tmp_path),
                               "collector", "gpu0", "gpu1"], env=fleet.env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        fleet.wait_for(lambda: fleet.finished() >= 50, 120, "some progress under honcho")
        server.stop()
        time.sleep(61)  # the bar: every long-running process rides out an outage of at least 60 s
        server.start()
        fleet.r = redis.Redis.from_url(server.url)
        export_exactly(fleet, rows)
        assert honcho.poll() is None, "honcho stopped the host"
        assert fleet.stats()["succeeded"] == 240
    finally:
        if honcho.poll() is None:
            honcho.send_signal(signal.SIGTERM)
        try:
            honcho.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            honcho.wait()
    text = (tmp_path / "honcho.log").read_text(errors="replace")
    assert text.count("head: lost Redis") == 1 and text.count("head: Redis is back") == 1, text[-3000:]
    for gpu in ("gpu0", "gpu1"):  # each worker: one line when it lost Redis, one when it was back
        lines = [x for x in text.splitlines() if re.search(rf"\b{gpu}(\.\d+)?\s*\|", x.split("|", 1)[0] + "|")]
        assert sum("lost Redis at" in x for x in lines) == 1, "\n".join(lines[-40:])
        assert sum("is back after" in x for x in lines) == 1, "\n".join(lines[-40:])
    assert "stopped (rc=" not in text.split("SIGTERM received")[0], text[-3000:]  # nothing exited by itself


def test_rq_commands_reach_a_worker_after_a_redis_restart_and_the_outage_is_two_lines(
        tmp_path: Path, private_redis, fleets: list[Fleet]) -> None:
    # RQ's pubsub thread (how `rq`'s shutdown command reaches a worker) lives through a Redis restart,
    # quietly: the worker's one "lost" line and one "back" line are all the outage prints.
    from rq.command import send_shutdown_command

    server = private_redis("--appendonly", "yes", "--appendfsync", "always")
    fleet = Fleet(tmp_path, server.url, gpus=1, env={"SGLANG_SIM_TIME_SCALE": "3",
                                                     "BATCHFLEET_SHUTDOWN_GRACE_S": "0.5"})
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 36, max_tokens=400)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    proc = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.r.zcard(fleet.k.leases) >= 5, 60, "prompts in flight")
    (name,) = [s.worker for s in fleet.statuses()]
    channel = f"rq:pubsub:{name}"
    server.stop()
    time.sleep(8)
    server.start()
    fleet.r = redis.Redis.from_url(server.url)
    fleet.wait_for(lambda: "is back after" in fleet.worker_log(0), 60, "the worker back on Redis")
    fleet.wait_for(lambda: dict(fleet.r.pubsub_numsub(channel)).get(channel.encode()) == 1, 30,
                   "the worker listening for RQ's commands again")
    assert proc.poll() is None
    send_shutdown_command(fleet.r, name)
    assert proc.wait(60) == 75
    log = fleet.worker_log(0)
    assert log.count("lost Redis at") == 1 and log.count("is back after") == 1, log[-3000:]
    assert "could not connect to Redis" not in log and "pubsub thread exiting" not in log, log[-3000:]

    fleet.start_worker(0)
    export_exactly(fleet, rows)
    assert fleet.stop_all() == {0: 0}
    assert fleet.stats()["succeeded"] == 36


def test_a_stock_rq_worker_eats_jobs_status_names_them_recover_runs_them(tmp_path: Path, redis_url: str,
                                                                          fleets: list[Fleet]) -> None:
    fleet = Fleet(tmp_path, redis_url, gpus=1)
    fleets.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 12, max_tokens=16)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    stock_env = {k: v for k, v in fleet.env.items() if k != "RQ_WORKER_CLASS"}
    stock = subprocess.run([str(BIN / "rq"), "worker", "--burst", "--name", "stock-worker", fleet.queue(0)],
                           env=stock_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "DeserializationError" in stock.stdout + stock.stderr
    st = status(fleet)
    assert st["totals"]["failed_foreign"] == 12 and st["totals"]["pending"] == 12
    assert st["foreign_failures"] == [{"queue": fleet.queue(0), "worker": "stock-worker", "count": 12}]
    text = fleet.producer("status").stdout
    repair = f"producer --run {fleet.run} --state-dir {tmp_path / 'state'} recover"
    assert f"12 prompt(s) on queue {fleet.queue(0)} were failed by worker stock-worker" in text and repair in text

    out = fleet.producer("recover").stdout
    assert "requeued 12 prompt(s) (0 that were nowhere in Redis, 12 failed by a non-batchfleet worker)" in out
    assert fleet.r.llen(Keys.queue(fleet.queue(0))) == 12 and fleet.r.zcard(Keys.failed(fleet.queue(0))) == 0
    fleet.start_worker(0)
    export_exactly(fleet, rows)
    fleet.stop_all()
    assert served(fleet, range(1)) == 12
