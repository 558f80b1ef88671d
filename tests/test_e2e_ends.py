"""Runs end cleanly (issue 7, section 9), on real parts: redis-server, `rq worker` processes with simulated
SGLang servers, the `producer` CLI and head. `producer cancel` mid-run, `producer purge RUN`, a finished
run's keys expiring, failed jobs trimmed once their result is collected, and `make demo`'s flow leaving
nothing in a shared Redis."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from batchfleet.keys import RQ_QUEUES, Keys
from producer.ends import run_jobs

from .fleet import BIN, ROOT, Fleet, write_prompts

pytestmark = pytest.mark.slow



def observed(fleet: Fleet, gpu: int) -> dict:
    """What the simulator of `gpu` has seen, now (not the record file, which lags)."""
    return httpx.get(f"http://127.0.0.1:{fleet.port_base + gpu}/sim/observed", timeout=10).json()


def run_keys(r: redis.Redis, run: str) -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(match=Keys(run).pattern, count=1000))


def export_lines(fleet: Fleet, name: str = "results.jsonl") -> list[dict]:
    out = fleet.tmp / name
    done = fleet.producer("export", str(out), check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return [orjson.loads(x) for x in out.read_bytes().splitlines()]


def test_cancel_mid_run_drops_queued_and_in_flight_prompts(fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    fleet = fleets(run="cx", prefix="cx.", gpus=2,
                   env={"BATCHFLEET_LEASE_TTL_S": "3", "BATCHFLEET_WINDOW_DEFAULT": "40",
                        "SGLANG_SIM_TIME_SCALE": "5"})
    rows = write_prompts(fleet.tmp / "prompts.jsonl", 300, max_tokens=200)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues, "--no-progress")
    for g in range(2):
        fleet.start_worker(g)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 10, 180, "10 results")

    done = fleet.producer("cancel", "--wait", "60", check=False, timeout_s=180)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "cancelled run cx:" in done.stdout and "2 live worker(s) dropped" in done.stdout
    # The requests the workers had sent are cancelled (connections closed): the servers abort them.
    fleet.wait_for(lambda: all(observed(fleet, g)["running"] + observed(fleet, g)["queued"] == 0 for g in range(2)),
                   60, "the simulators to hold no request")
    served = [observed(fleet, g)["requests_total"] for g in range(2)]

    # Redis holds no job of the run: queues, suspects/isolate, leases, RQ's started registries are empty.
    k = fleet.k
    assert run_jobs(r, "cx") == {}
    assert [r.llen(Keys.queue(fleet.queue(g))) for g in range(2)] == [0, 0]
    assert [r.zcard(Keys.started(fleet.queue(g))) for g in range(2)] == [0, 0]
    assert r.zcard(k.leases) == 0 and not r.exists(k.suspects, k.isolate)

    # Several lease beats later (the workers' cancel check), the head has ended the run...
    fleet.wait_for(lambda: "was cancelled" in fleet.head_log(), 60, "the head to end the run")
    fleet.wait_for(lambda: all("run cx cancelled: dropped" in fleet.worker_log(g) for g in range(2)), 30,
                   "both workers to say the run was cancelled")
    # ... and not one request more reached a simulator while every worker lived three more lease beats
    # (3 s of lease, a beat a second), as its own status records show: the cancelled prompts never ran
    # after the cancel.
    said_at = time.time()
    fleet.wait_for(lambda: len(fleet.statuses()) == 2 and all(s.ts > said_at + 3 for s in fleet.statuses()), 60,
                   "three more lease beats of every worker")
    assert [observed(fleet, g)["requests_total"] for g in range(2)] == served
    assert all(p.poll() is None for p in fleet.workers.values())  # workers idle, they did not exit

    lines = export_lines(fleet)
    ids = [x["custom_id"] for x in lines]
    assert ids == [row["id"] for row in rows]  # one line per prompt, input order, none twice
    codes = Counter("ok" if x["error"] is None else x["error"]["code"] for x in lines)
    assert set(codes) <= {"ok", "cancelled"} and codes["ok"] >= 10 and codes["cancelled"] >= 1
    assert codes["ok"] + codes["cancelled"] == 300
    st = orjson.loads(fleet.producer("status", "--json").stdout)
    assert st["totals"]["cancelled"] == codes["cancelled"] and st["totals"]["succeeded"] == codes["ok"]
    assert st["totals"]["pending"] == 0 and st["cancelled_at"] is not None
    # every request a simulator served was of a prompt that got a result or was in flight at the cancel
    assert sum(served) >= codes["ok"]
    print(f"cancel: {codes['ok']} succeeded before it, {codes['cancelled']} cancelled; requests served {served}")

    # The run takes no more prompts: enqueue refuses.
    again = fleet.producer("enqueue", "prompts.jsonl", check=False)
    assert again.returncode == 2 and "was cancelled" in again.stderr


def test_after_producer_cancel_every_server_stops_within_a_second_and_each_worker_says_so_once(
        fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    """Long generations in flight on both GPUs; `producer cancel`. Leases of 900 s (renewed every 300 s)
    keep the lease beat out of it: only the announced drop (`bf:<run>:drop`, `bf:<run>:signals`) can
    stop the workers in time. The servers notice a closed connection as SGLang 0.5.23 does, at their
    next 4 s check: only the abort by rid stops the generations in time. Within 1 s of the cancel
    returning no server runs or queues a request, and no server is asked for more; the servers were
    told to abort the dropped requests by their rids (`POST /abort_request`, as SGLang takes it); each
    worker says one true line, none of the lease or recovery lines that a cancel is not."""
    fleet = fleets(run="cz", prefix="cz.", gpus=2,
                   env={"BATCHFLEET_LEASE_TTL_S": "900", "SGLANG_SIM_TIME_SCALE": "1",
                        "SGLANG_SIM_DISCONNECT_CHECK_S": "4"})
    write_prompts(fleet.tmp / "prompts.jsonl", 60, max_tokens=1500)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues, "--no-progress")
    for g in range(2):
        fleet.start_worker(g)
    def running(g: int) -> int:
        try:
            return observed(fleet, g)["running"]
        except httpx.HTTPError:  # not up yet
            return 0

    fleet.wait_for(lambda: all(running(g) > 0 for g in range(2)), 120, "generations running on both servers")

    done = fleet.producer("cancel", "--wait", "30", check=False, timeout_s=120)
    stopped_by = time.monotonic() + 1.0
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"  # both workers confirmed (not at a lease beat)
    while not all((o := observed(fleet, g))["running"] + o["queued"] == 0 for g in range(2)):
        assert time.monotonic() < stopped_by, [observed(fleet, g) for g in range(2)]
        time.sleep(0.05)
    seen = [observed(fleet, g) for g in range(2)]
    time.sleep(2.0)  # the counts must stay put: nothing generates, nothing more is sent
    after = [observed(fleet, g) for g in range(2)]
    for before, now in zip(seen, after, strict=True):
        assert (now["requests_total"], now["generation_tokens_total"]) == \
            (before["requests_total"], before["generation_tokens_total"])

    m = re.search(r"2 live worker\(s\) dropped (\d+) in-flight prompt", done.stdout)
    assert m, done.stdout
    dropped = []
    for g in range(2):
        text = fleet.worker_log(g)
        lines = re.findall(r"run cz cancelled: dropped (\d+) in flight", text)
        assert len(lines) == 1, text[-3000:]
        dropped.append(int(lines[0]))
        assert "lost the lease" not in text and "already recovered" not in text, text[-3000:]
    assert all(n > 0 for n in dropped) and sum(dropped) == int(m.group(1))
    # the dropped requests were aborted by their rids, in the servers that ran them (one call each; a prompt
    # claimed but not yet sent has no request to abort)
    assert all(0 < o["abort_calls"] <= n for o, n in zip(after, dropped, strict=True)), (after, dropped)
    # each server aborted requests, and only dropped ones (fewer when some dropped prompts were not sent yet:
    # under load the surplus waits in the worker); what it did not abort it no longer runs (asserted above)
    assert all(0 < o["aborted_total"] <= n for o, n in zip(after, dropped, strict=True)), (after, dropped)


def test_purge_removes_every_key_of_the_run_and_only_its(fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    other = fleets(run="keep", prefix="keep.", gpus=1)
    write_prompts(other.tmp / "other.jsonl", 5)
    other.env["BATCHFLEET_STATE_DIR"] = str(other.tmp / "state-keep")
    other.producer("enqueue", "other.jsonl", "--queues", other.queues, "--no-progress")
    keep_before = sorted(r.scan_iter(match="*"))

    fleet = fleets(run="px", prefix="px.", gpus=1, env={"SGLANG_SIM_TIME_SCALE": "5",
                                                        "BATCHFLEET_WINDOW_DEFAULT": "30"})
    write_prompts(fleet.tmp / "prompts.jsonl", 60, max_tokens=200)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues, "--no-progress")
    worker = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= 3, 180, "3 results")
    worker.send_signal(signal.SIGKILL)  # leaves leases, started-registry entries, queued jobs, its status
    worker.wait(30)
    assert run_jobs(r, "px") and run_keys(r, "px")

    dry = fleet.producer("purge", "px", check=False)
    assert dry.returncode == 2 and "--yes" in dry.stderr and run_keys(r, "px")
    refused = fleet.producer("purge", "px", "--yes", check=False)  # its status record still says it lives
    assert refused.returncode == 2 and "live worker" in refused.stderr and run_keys(r, "px")
    done = fleet.producer("purge", "px", "--yes", "--force", check=False)
    assert done.returncode == 0, done.stderr
    assert "purged run px:" in done.stdout

    assert run_keys(r, "px") == []  # SCAN bf:px:*
    assert run_jobs(r, "px") == {}  # SCAN rq:job:* whose data is of run px
    q = fleet.queue(0)
    assert not r.exists(Keys.queue(q), Keys.started(q), Keys.failed(q))
    assert not r.sismember(RQ_QUEUES, Keys.queue(q))
    left = [k.decode() for k in r.scan_iter(match="*") if b"px" in k]
    assert left == []
    # the other run is untouched
    assert keep_before and all(r.exists(k) for k in keep_before)
    assert len(run_jobs(r, "keep")) == 5


def test_a_finished_runs_keys_expire(fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    fleet = fleets(run="tx", prefix="tx.", gpus=1, env={"BATCHFLEET_FINISHED_TTL_S": "8",
                                                        "BATCHFLEET_LEASE_TTL_S": "3"})
    write_prompts(fleet.tmp / "prompts.jsonl", 20, max_tokens=16)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues, "--no-progress")
    fleet.start_worker(0)
    fleet.start_head()
    fleet.wait_for(lambda: "has finished" in fleet.head_log(), 180, "the head to see the run finished")
    assert all(r.ttl(key) == -2 or 0 < r.ttl(key) <= 8 for key in (fleet.k.meta, fleet.k.stats, fleet.k.done))
    assert r.ttl(fleet.k.meta) != -1  # -2: already gone (a slow box), else a TTL of at most 8 s
    # Everything but what the live worker keeps writing (its status record, which expires by itself,
    # and the set naming it) goes within the TTL; the head writes nothing more.
    fleet.wait_for(lambda: set(run_keys(r, "tx")) <= {fleet.k.workers, *(fleet.k.status(n.decode())
                                                                           for n in r.smembers(fleet.k.workers))},
                   60, "the run's keys to expire")
    fleet.wait_for(lambda: "ended and its keys expired" in fleet.worker_log(0), 30,
                   "the worker to see the marker expire")
    assert "lost the data" not in fleet.worker_log(0)
    fleet.stop_all()
    assert run_keys(r, "tx") == []
    assert "lost the data" not in fleet.head_log() and "LOST" not in fleet.head_log()
    # The store has everything; a missing marker of a finished run is not "Redis lost the data".
    st = orjson.loads(fleet.producer("status", "--json").stdout)
    assert st["redis_lost_data"] is False and st["totals"]["succeeded"] == 20 and st["totals"]["pending"] == 0
    assert len(export_lines(fleet)) == 20


def _job_bytes(r: redis.Redis, run: str) -> int:
    return sum(r.memory_usage(Keys.job(j), samples=0) or 0 for j in run_jobs(r, run))  # every field, no sampling


def test_failed_jobs_keep_a_bounded_stub_and_rq_requeue_still_runs_them(fleets: Callable[..., Fleet],
                                                                        r: redis.Redis) -> None:
    fleet = fleets(run="fx", prefix="fx.", gpus=1, env={"BATCHFLEET_SERVER_ARGS": "--context-length 4096"})
    big = "lorem ipsum dolor sit amet " * (10 * 1024 * 1024 // 27)  # two ~10 MB prompts: too long for the server
    lines = [{"id": "big0", "prompt": big + "0", "max_tokens": 8}, {"id": "big1", "prompt": big + "1", "max_tokens": 8}]
    (fleet.tmp / "big.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    fleet.producer("enqueue", "big.jsonl", "--queues", fleet.queues, "--no-progress", timeout_s=300)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.stats().get("failed", 0) == 2, 300, "two failures")
    before_jobs, before_mem = _job_bytes(r, "fx"), r.info("memory")["used_memory"]
    fleet.producer("collect", timeout_s=300)  # the store holds the prompts and their results now
    after_jobs, after_mem = _job_bytes(r, "fx"), r.info("memory")["used_memory"]
    print(f"failed jobs: {before_jobs:,} B -> {after_jobs:,} B; used_memory {before_mem:,} -> {after_mem:,}")
    assert before_jobs > 20_000_000 and after_jobs < 4096
    assert before_mem - after_mem > 20_000_000
    q = fleet.queue(0)
    assert r.zcard(Keys.failed(q)) == 2  # still in RQ's failed registry, requeueable
    jobs = run_jobs(r, "fx")
    assert len(jobs) == 2 and all(0 < r.ttl(Keys.job(j)) <= 7 * 24 * 3600 for j in jobs)
    exported = export_lines(fleet)
    # HTTP 400 answers: their status and the server's body, no error object (OpenAI's output format)
    assert [(x["error"], x["response"]["status_code"]) for x in exported] == [(None, 400), (None, 400)]
    assert all("longer than" in x["response"]["body"]["message"] for x in exported)

    # `rq requeue` of a trimmed job: the worker hands it to the head, which feeds it again in full. Here
    # a server with a longer context takes the whole 10 MB prompt and fails it for another reason
    # (its KV cache), and that later failure replaces the first in the export.
    fleet.stop_all()
    fleet.env["BATCHFLEET_SERVER_ARGS"] = "--context-length 8000000"
    done = subprocess.run([str(BIN / "rq"), "requeue", "-u", fleet.redis_url, "--queue", q, "--all"],
                          env=fleet.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    fleet.start_worker(0)
    fleet.start_head()
    fleet.wait_for(lambda: "brought back by `rq requeue`" in fleet.head_log(), 120, "the head to feed them again")
    fleet.wait_for(lambda: fleet.stats().get("failed", 0) == 4, 300, "the two prompts to run again")
    fleet.wait_for(lambda: fleet.head_log().count("has finished") == 2, 120, "the head to collect them")
    again = export_lines(fleet, "again.jsonl")
    assert [x["custom_id"] for x in again] == ["big0", "big1"]
    assert all("1941806 tokens" not in orjson.dumps(x).decode() and "KV cache" in orjson.dumps(x).decode()
               for x in again)
    assert _job_bytes(r, "fx") < 4096  # trimmed again once collected


def test_the_demo_leaves_nothing_in_a_shared_redis(tmp_path: Path, redis_url: str, r: redis.Redis) -> None:
    prompts = tmp_path / "few.jsonl"
    write_prompts(prompts, 12, max_tokens=16)
    r.set("someone:else", "x")  # a shared Redis: the demo must keep its hands off this
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--gpus", "2", "--prompts", str(prompts),
                           "--time-scale", "40", "--timeout", "240"],
                          env={**os.environ, "REDIS_URL": redis_url, "PATH": f"{BIN}:{os.environ['PATH']}"},
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "purged run demo-" in done.stdout
    assert "prompts exported : 12 (12 succeeded" in done.stdout
    left = sorted(k.decode() for k in r.scan_iter(match="*"))
    assert left == ["someone:else"], left
