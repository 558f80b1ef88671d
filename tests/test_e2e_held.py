"""The faults that already held when issue 7 was filed, kept held on real parts (redis-server, `rq worker`
processes, simulated SGLang servers over HTTP, `producer head` and `supervisor watch` processes):
every worker `kill -9`ed at once, a server SIGSTOPped and later one `kill -9`ed, the head `kill -9`ed
again and again, `supervisor watch` `kill -9`ed mid-rollout, and prompts that get HTTP 500 every time.
Each asserts exact counts in the export (results == prompts, none twice, none lost) and prints its
recovery time (`pytest -s`)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.records import WorkerState
from bench.bench_seed import SupervisorProc, exactly_once

from .fleet import Fleet, expected_text, gone, text_of, write_prompts
from .test_supervisor_scenarios import FAST, TINY, start

pytestmark = pytest.mark.slow


def export_exact(fleet: Fleet, rows: list[dict], *, failed: frozenset[str] = frozenset()) -> dict[str, dict]:
    """`producer export`; one line per prompt in input order, none twice, the right text for each but
    `failed`, which must have failed."""
    out = fleet.tmp / "results.jsonl"
    fleet.producer("export", str(out), check=False)
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert [i for i, n in Counter(ids).items() if n > 1] == []  # 0 duplicated
    assert ids == [r["id"] for r in rows]  # 0 lost, input order
    by_id = {x["custom_id"]: x for x in lines}
    for row in rows:
        line = by_id[row["id"]]
        if row["id"] in failed:  # no answer (error), or an HTTP error answer (response)
            assert line["error"] is not None or line["response"]["status_code"] != 200, line
        else:
            assert line["error"] is None and text_of(line["response"]["body"]) == expected_text(row), line
    return by_id


def test_every_worker_kill_9_at_once(tmp_path: Path, fleets) -> None:
    n = 200
    fleet = fleets(run="allk9", prefix="allk9.", gpus=2, env={"SGLANG_SIM_TIME_SCALE": "4"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=96)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    victims = [fleet.start_worker(g) for g in range(2)]
    fleet.wait_for(lambda: all(fleet.r.zcard(Keys.started(fleet.queue(g))) >= 5 for g in range(2)), 60,
                   "both GPUs with prompts in flight")
    servers = [fleet.sim_record(g)["pid"] for g in range(2)]
    for v in victims:
        v.send_signal(signal.SIGKILL)
    for v in victims:
        v.wait(10)
    killed_at = time.monotonic()
    held = fleet.r.zcard(fleet.k.leases)  # the dead workers' leases: nobody renews them now
    assert held >= 10
    assert all(gone(pid) for pid in servers), "a server outlived its killed worker"
    for g in range(2):
        fleet.start_worker(g)
    fleet.wait_for(lambda: fleet.stats().get("recovered", 0) >= held, 60, "the killed workers' prompts back")
    recovered_s = time.monotonic() - killed_at
    fleet.wait_for(lambda: fleet.finished() >= n, 240, "every prompt")
    assert fleet.stop_all() == {0: 0, 1: 0}
    export_exact(fleet, rows)
    stats = fleet.stats()
    # (at least `held`: a live worker's lease may lapse too under a heavy load; it is requeued, not duplicated)
    assert stats["succeeded"] == n and stats.get("failed", 0) == 0 and stats["recovered"] >= held
    print(f"\nall workers kill -9: {held} leased prompts recovered {recovered_s:.1f} s after the kill; {n}/{n} once")


def test_a_server_sigstopped_then_a_server_kill_9(tmp_path: Path, fleets) -> None:
    n = 120
    fleet = fleets(run="stopped", prefix="stopped.", gpus=1, env={"SGLANG_SIM_TIME_SCALE": "10",
                                                                   "BATCHFLEET_HEALTH_INTERVAL_S": "1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=48)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= 20, 90, "20 prompts")
    recovery = []
    for sig, after in ((signal.SIGSTOP, 60), (signal.SIGKILL, n)):
        pid = fleet.sim_record(0)["pid"]
        os.kill(pid, sig)
        at = time.monotonic()
        # A new server: its record names another pid once it is up.
        fleet.wait_for(lambda pid=pid: fleet.sim_record(0).get("ready") and fleet.sim_record(0)["pid"] != pid, 120,
                       f"a new server after {signal.Signals(sig).name}")
        recovery.append(time.monotonic() - at)
        assert gone(pid), f"the {signal.Signals(sig).name} server {pid} is still there"
        fleet.wait_for(lambda after=after: fleet.finished() >= after, 180, f"{after} prompts")
    assert fleet.stop_all() == {0: 0}
    export_exact(fleet, rows)
    stats = fleet.stats()
    assert stats["succeeded"] == n and stats.get("failed", 0) == 0 and stats.get("quarantined", 0) == 0
    assert stats["server_deaths"] == 2
    log = fleet.worker_log(0)
    assert "health check failed" in log, log[-3000:]
    print(f"\nserver SIGSTOP: serving again after {recovery[0]:.1f} s; kill -9: after {recovery[1]:.1f} s; "
          f"{n}/{n} once")


def test_the_head_kill_9_again_and_again(tmp_path: Path, fleets) -> None:
    n, kills = 600, 6
    fleet = fleets(run="headk9", prefix="headk9.", gpus=2, env={"BATCHFLEET_WINDOW_DEFAULT": "20",
                                                                 "BATCHFLEET_WINDOW_MAX": "30",
                                                                 "SGLANG_SIM_TIME_SCALE": "4"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=24)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    for g in range(2):
        fleet.start_worker(g)
    at_kill = []
    for i in range(kills):
        head = fleet.start_head()
        # Kill it at a different point of its loop each time: after some progress, then a bit later.
        fleet.wait_for(lambda i=i: fleet.finished() >= 50 * (i + 1), 120, f"{50 * (i + 1)} prompts")
        time.sleep(0.05 * i)
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        at_kill.append(fleet.finished())
    assert at_kill[-1] < n - 50, at_kill  # the last head still had work to feed
    at = time.monotonic()
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= n, 180, "every prompt after the last restart")
    finished_s = time.monotonic() - at
    assert fleet.stop_all() == {0: 0, 1: 0}
    export_exact(fleet, rows)
    served = sum(sum(fleet.sim_record(g)["requests_by_endpoint"].values()) for g in range(2))
    assert served == n  # nothing generated twice: a head death costs the workers nothing
    assert fleet.stats()["succeeded"] == n
    log = fleet.head_log()
    assert "Redis lost the data" not in log and "nowhere in Redis" not in log, log[-3000:]
    print(f"\nhead kill -9 x{kills} (at {at_kill} results): the last head finished the run in {finished_s:.1f} s; "
          f"{n}/{n} once, {served} generations")


def test_supervisor_kill_9_mid_rollout_then_restarted(tmp_path: Path, redis_url: str) -> None:
    n = 600
    fleet, sup = start(tmp_path, redis_url, gpus=2, prompts=n, min_tokens=300, max_tokens=500, env=TINY,
                       args=(*FAST, "--keep-prefix-cache"), run="supk9")
    second: SupervisorProc | None = None
    try:
        sup.wait_event("rollout", 120)
        sup.proc.send_signal(signal.SIGKILL)
        sup.proc.wait(10)
        killed_at = time.monotonic()
        second = SupervisorProc(fleet, *FAST, "--keep-prefix-cache")
        # One spec for the whole fleet again: the rollout finished (or was rolled back) by the new process.
        fleet.wait_for(lambda: len({(s.strategy, s.state) for s in fleet.statuses()}) == 1
                       and {s.state for s in fleet.statuses()} == {WorkerState.SERVING}
                       and fleet.r.hkeys(fleet.k.control) == [b"fleet"], 180, "one spec across the fleet")
        settled_s = time.monotonic() - killed_at
        strategies = {s.strategy for s in fleet.statuses()}
        fleet.wait_for(lambda: fleet.finished() >= n, 240, "every prompt")
    finally:
        sup.stop()
        if second is not None:
            second.stop()
        fleet.stop_all()
        fleet.kill_all()
    rolled_back = bool(second and second.events("rollback"))
    assert strategies == ({"default"} if rolled_back else {"no_buffer"}), (strategies, second and second.output())
    assert exactly_once(fleet, n) == (0, 0)
    print(f"\nsupervisor kill -9 mid-rollout: one spec ({strategies}) across the fleet {settled_s:.1f} s after the "
          f"kill; {n}/{n} once")


def test_prompts_that_get_http_500_every_time_fail_once_with_their_reason(tmp_path: Path, fleets) -> None:
    n, attempts, marker = 60, 3, "ALWAYS-500-9c"
    fleet = fleets(run="e500", prefix="e500.", gpus=2, env={"SGLANG_SIM_TIME_SCALE": "20",
                                                             "SGLANG_SIM_ERROR_MARKER": marker,
                                                             "BATCHFLEET_MAX_ATTEMPTS": str(attempts),
                                                             "BATCHFLEET_BACKOFF_BASE_S": "0.1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=16)
    bad = {rows[i]["id"] for i in (4, 21, 38)}  # a completion prompt and a chat one among them
    for row in rows:
        if row["id"] in bad:
            if "prompt" in row:
                row["prompt"] += f" {marker}"
            else:
                row["messages"][0]["content"] += f" {marker}"
    (tmp_path / "prompts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    for g in range(2):
        fleet.start_worker(g)
    fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt")
    assert fleet.stop_all() == {0: 0, 1: 0}
    by_id = export_exact(fleet, rows, failed=frozenset(bad))
    for cid in bad:  # the last HTTP 500 answer, with the server's body (OpenAI's output format)
        line = by_id[cid]
        assert line["error"] is None and line["response"]["status_code"] == 500, line
        assert isinstance(line["response"]["body"], dict), line
    # Each was tried exactly `attempts` times (the servers' own count), on a server that stayed up. The
    # workers stopped their servers, and a server writes its record a last time as it stops: once both
    # are gone, their records hold every attempt they ever saw.
    assert all(gone(fleet.sim_record(g)["pid"]) for g in range(2))
    assert sum(fleet.sim_record(g)["error_marker_hits"] for g in range(2)) == 3 * attempts
    stats = fleet.stats()
    assert stats["succeeded"] == n - 3 and stats["failed"] == 3 and stats.get("server_deaths", 0) == 0
    print(f"\nHTTP 500 every time: {len(bad)} prompts failed once each after {attempts} attempts; "
          f"{n - 3} succeeded")
