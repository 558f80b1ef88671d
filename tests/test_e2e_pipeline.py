"""The whole pipeline with real parts: producer CLI -> real Redis/RQ -> `rq worker gpuN` processes
running our worker class, each owning a simulated SGLang server over HTTP -> collector -> export."""

from __future__ import annotations

import signal
import subprocess
import time

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.procs import pid_alive
from batchfleet.records import WorkerState

from .fleet import BIN, Fleet, expected_text, gone, text_of, write_prompts

pytestmark = pytest.mark.slow


def read_export(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_two_gpus_500_prompts_end_to_end(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=2, env={"BATCHFLEET_MAX_RUNNING_REQUESTS": "64"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 500)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)

    # RQ's own view agrees with what was enqueued.
    info = subprocess.run([str(BIN / "rq"), "info", "-u", redis_url, "--raw", "--only-queues"],
                          capture_output=True, text=True, check=True).stdout
    counts = {line.split()[1]: int(line.split()[2].rstrip(",")) for line in info.splitlines()
              if line.startswith("queue ")}
    assert counts == {fleet.queue(0): 250, fleet.queue(1): 250}

    for gpu in (0, 1):
        fleet.start_worker(gpu)
    fleet.wait_for(lambda: fleet.finished() >= 500, 180, "500 prompts")
    statuses = {s.gpu: s for s in fleet.statuses()}
    assert fleet.stop_all() == {0: 0, 1: 0}

    for gpu in (0, 1):
        rec = fleet.sim_record(gpu)
        effective = rec["effective_max_running_requests"]
        assert effective < 64, "the tiny profile's mamba pool must cap below the requested 64"
        # The server was kept exactly full: never more than it can run, and not less.
        assert rec["peak_running"] == effective
        assert statuses[gpu].effective_max == effective
        assert "--max-running-requests" in rec["argv"] and "--enable-metrics" in rec["argv"]
        assert rec["flags"]["host"] == "127.0.0.1"

    out = tmp_path / "results.jsonl"
    fleet.producer("export", str(out))
    lines = read_export(out)
    assert [x["custom_id"] for x in lines] == [r["id"] for r in rows]  # one line each, in input order
    for row, line in zip(rows, lines, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert text_of(line["response"]["body"]) == expected_text(row)
        assert line["response"]["body"]["usage"]["completion_tokens"] > 0
    # Every prompt ran exactly once.
    stats = fleet.stats()
    assert stats["succeeded"] == 500 and stats.get("failed", 0) == 0
    assert sum(fleet.sim_record(g)["requests_by_endpoint"].get(ep, 0) for g in (0, 1)
               for ep in ("/v1/completions", "/v1/chat/completions")) == 500

    # Re-enqueueing the same file after the run changes nothing.
    again = fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    assert "0 new" in again.stdout + again.stderr
    assert fleet.r.llen(Keys.queue(fleet.queue(0))) == 0 and fleet.r.llen(Keys.queue(fleet.queue(1))) == 0
    # Results left Redis: nothing piles up once collected.
    assert fleet.r.xlen(fleet.k.results) == 0 and fleet.r.scard(fleet.k.done) == 0
    assert not fleet.r.keys("rq:job:*")


def test_kill_9_loses_and_duplicates_nothing(tmp_path, redis_url):
    # Default lease settings: the claim is that a killed worker's prompts run again within 30 s.
    fleet = Fleet(tmp_path, redis_url, gpus=2, env={"SGLANG_SIM_TIME_SCALE": "4"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 240, max_tokens=96)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    victim = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.r.zcard(Keys.started(fleet.queue(0))) >= 5, 60, "gpu0 to have prompts in flight")
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(10)
    # Counted after the kill: a prompt it finished just before dying is not in flight.
    in_flight = {m.decode().split(":")[0] for m in fleet.r.zrange(fleet.k.leases, 0, -1)}
    assert in_flight
    fleet.start_worker(1)
    # Its in-flight prompts are put back within the lease time and run by the live worker.
    fleet.wait_for(lambda: int(fleet.r.hget(fleet.k.stats, "recovered") or 0) >= len(in_flight), 30,
                   "recovery of the killed worker's prompts")
    recovered_after = time.monotonic() - killed_at
    assert recovered_after < 30
    fleet.wait_for(lambda: fleet.finished() >= 240, 240, "all prompts")
    assert fleet.stop_all()[1] == 0

    # The killed worker's server died with it (it would hold the GPU and the port otherwise).
    pid = fleet.sim_record(0)["pid"]
    assert gone(pid), f"the killed worker's server {pid} outlived it"

    out = tmp_path / "results.jsonl"
    fleet.producer("export", str(out))
    lines = read_export(out)
    assert sorted(x["custom_id"] for x in lines) == sorted(r["id"] for r in rows)
    by_id = {x["custom_id"]: x for x in lines}
    for row in rows:
        assert text_of(by_id[row["id"]]["response"]["body"]) == expected_text(row)
    # Exactly one result was ever published per prompt: no duplicates reached the stream.
    assert fleet.stats()["succeeded"] == 240


def test_sigterm_finishes_or_hands_back_and_stops_the_server(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_TIME_SCALE": "2",
                                                    "BATCHFLEET_SHUTDOWN_GRACE_S": "0.5"})
    write_prompts(tmp_path / "prompts.jsonl", 60, max_tokens=400)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    proc = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.r.zcard(Keys.started(fleet.queue(0))) >= 5, 60, "prompts in flight")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    # Nothing is left half-done: every prompt is either finished or back in its queue.
    assert fleet.r.zcard(Keys.started(fleet.queue(0))) == 0 and fleet.r.zcard(fleet.k.leases) == 0
    assert fleet.finished() + fleet.r.llen(Keys.queue(fleet.queue(0))) == 60
    assert int(fleet.r.hget(fleet.k.stats, "handed_back") or 0) >= 1
    assert not pid_alive(fleet.sim_record(0)["pid"])  # the worker stopped its server before it exited
    assert "handed back" in fleet.worker_log(0)


def test_server_that_cannot_start_is_reported_and_takes_no_work(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_FAIL_STARTUP": "oom"})
    write_prompts(tmp_path / "prompts.jsonl", 10)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: any(s.state is WorkerState.DOWN for s in fleet.statuses()), 30, "the worker to report down")
    (status,) = fleet.statuses()
    assert "CUDA out of memory" in status.message
    assert fleet.r.llen(Keys.queue(fleet.queue(0))) == 10  # no prompt was taken
    assert "CUDA out of memory" in fleet.worker_log(0)
    fleet.stop_all()


def test_server_crash_is_survived_without_loss(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_CRASH_AFTER": "70"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 120)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= 120, 120, "all prompts despite crashes")
    fleet.stop_all()
    assert fleet.stats()["succeeded"] == 120
    assert "restarting it" in fleet.worker_log(0)
    out = tmp_path / "results.jsonl"
    fleet.producer("export", str(out))
    assert sorted(x["custom_id"] for x in read_export(out)) == sorted(r["id"] for r in rows)


def test_legacy_server_gets_the_old_flag_and_capacity_from_its_log(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_VERSION": "0.5.6",
                                                    "BATCHFLEET_STRATEGY": "no_buffer"})
    write_prompts(tmp_path / "prompts.jsonl", 40)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= 40, 60, "prompts on a legacy server")
    (status,) = fleet.statuses()
    fleet.stop_all()
    rec = fleet.sim_record(0)
    argv = rec["argv"]
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "no_buffer"
    assert "--mamba-radix-cache-strategy" not in argv and "--disable-overlap-schedule" not in argv
    assert status.effective_max == rec["effective_max_running_requests"] == rec["peak_running"]


def test_hung_server_is_detected_killed_and_restarted_without_loss(tmp_path, redis_url):
    # The simulator stops generating after 30 admissions while its port stays open and /health
    # answers 200: only a real generation shows it is stuck.
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_HANG_AFTER": "30",
                                                    "BATCHFLEET_HEALTH_INTERVAL_S": "1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 50)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= 50, 150, "all prompts despite the hang")
    fleet.stop_all()
    log = fleet.worker_log(0)
    assert "health check failed (2 in a row)" in log and "restarting it" in log
    assert fleet.stats()["succeeded"] == 50
    out = tmp_path / "results.jsonl"
    fleet.producer("export", str(out))
    assert sorted(x["custom_id"] for x in read_export(out)) == sorted(r["id"] for r in rows)


def test_workers_ride_out_a_redis_restart(tmp_path):
    # A Redis that persists (AOF), restarted mid-run on the same port: workers keep their in-flight
    # prompts, wait for it, and carry on; nothing is lost or run twice.
    from .conftest import RedisServer

    server = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    server.start()
    try:
        fleet = Fleet(tmp_path, server.url, gpus=1, env={"SGLANG_SIM_TIME_SCALE": "5"})
        rows = write_prompts(tmp_path / "prompts.jsonl", 150, max_tokens=64)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.finished() >= 20, 60, "some progress")
        server.stop()
        time.sleep(3)
        server.start()
        fleet.r = __import__("redis").Redis.from_url(server.url)
        fleet.wait_for(lambda: fleet.finished() >= 150, 120, "all prompts after the Redis restart")
        assert fleet.stop_all() == {0: 0}
        log = fleet.worker_log(0)  # one line when it lost Redis, one when Redis was back
        assert log.count("lost Redis at") == 1 and log.count("is back after") == 1, log[-3000:]
        out = tmp_path / "results.jsonl"
        fleet.producer("export", str(out))
        assert sorted(x["custom_id"] for x in read_export(out)) == sorted(r["id"] for r in rows)
        assert fleet.stats()["succeeded"] == 150
    finally:
        server.stop()
