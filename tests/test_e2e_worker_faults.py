"""The faults a ten-hour run meets, on the worker's side, each injected on real parts: a real
redis-server, real `rq worker` processes running our worker class, simulated SGLang servers over
HTTP. Every test asserts exact counts (results == prompts, none twice, none lost except exactly the
quarantined ones), uses its own run and queue names, and kills every process it started.

Figures worth reporting (recovery times) are printed; run with `-s` to see them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys
from batchfleet.procs import pid_alive
from batchfleet.records import WorkerState
from batchfleet.rqlayout import execution_job

from .fleet import BIN, Fleet, expected_text, text_of, write_prompts

pytestmark = pytest.mark.slow




def read_export(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def export(fleet: Fleet, tmp: Path) -> dict[str, dict]:
    out = tmp / "results.jsonl"
    fleet.producer("export", str(out))
    lines = read_export(out)
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in the export"
    return by_id


def server_log(fleet: Fleet, gpu: int) -> str:
    path = fleet.tmp / "state" / "logs" / f"sglang-gpu{gpu}.log"
    return path.read_text(errors="replace") if path.exists() else ""


# --- 7.1: a prompt that crashes its server --------------------------------------------------------------
POISON = "POISON-7f3a"


def test_a_poison_prompt_is_quarantined_after_three_server_deaths_and_no_bystander_fails(tmp_path, fleets):
    n, more, gpus = 300, 90, 3
    fleet = fleets(run="poison", prefix="poison.", gpus=gpus, env={"SGLANG_SIM_CRASH_MARKER": POISON})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=48)
    bad = rows[91]
    bad["messages"][0]["content"] = f"Tell me about {POISON} please"
    (tmp_path / "prompts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    t0 = time.monotonic()
    for g in range(gpus):
        fleet.start_worker(g)

    marks: dict[str, tuple[float, int]] = {}  # moment -> (seconds since start, prompts finished)

    def reached(total: int) -> Callable[[], bool]:
        def check() -> bool:
            s = fleet.stats()
            now, finished = time.monotonic() - t0, s.get("succeeded", 0) + s.get("failed", 0)
            if finished and "first_result" not in marks:
                marks["first_result"] = (now, finished)
            if s.get("server_deaths") and "first_death" not in marks:
                marks["first_death"] = (now, finished)
            if s.get("quarantined") and "quarantined" not in marks:
                marks["quarantined"] = (now, finished)
            return finished >= total
        return check

    fleet.wait_for(reached(n), 240, "every prompt to finish")
    marks["first_batch_done"] = (time.monotonic() - t0, n)
    assert fleet.stats()["server_deaths"] == 3
    # After the quarantine: a second batch runs on every GPU at full capacity, with no death.
    more_rows = write_prompts(tmp_path / "more.jsonl", more, max_tokens=48, start=n)
    fleet.producer("enqueue", "more.jsonl", "--queues", fleet.queues)
    fleet.start_head()  # enqueue feeds one window; the head feeds the rest (the Procfile's collector)
    marks["second_batch"] = (time.monotonic() - t0, n)
    fleet.wait_for(reached(n + more), 120, "the second batch")
    marks["all_done"] = (time.monotonic() - t0, n + more)
    statuses = fleet.statuses()
    assert fleet.stop_all() == {g: 0 for g in range(gpus)}
    assert len(statuses) == gpus and all(w.state is WorkerState.SERVING and w.effective_max == 12 for w in statuses)

    stats = fleet.stats()
    deaths = sum(server_log(fleet, g).count("an illegal memory access was encountered") for g in range(gpus))
    assert deaths == 3, f"{deaths} server deaths"
    assert stats["server_deaths"] == 3 and stats["quarantined"] == 1
    assert stats["succeeded"] == n + more - 1 and stats["failed"] == 1
    # Each death takes back at most what was in hand (capacity 12 + surplus <= 12): strikes for those inside, the
    # rest back untouched; nothing cycled claim -> fail -> hand back while a server was down.
    assert stats.get("struck", 0) + stats.get("handed_back", 0) <= 3 * (12 + 12), stats

    by_id = export(fleet, tmp_path)
    all_rows = rows + more_rows
    assert sorted(by_id) == sorted(r["id"] for r in all_rows)  # results == prompts, exactly once each
    line = by_id[bad["id"]]
    assert line["error"]["code"] == "server_crash" and line["response"] is None
    assert "3 times" in line["error"]["message"] and "illegal memory access" in line["error"]["message"]
    assert "--- server log (tail) ---" in line["error"]["message"]
    for row in all_rows:
        if row is not bad:  # every bystander succeeded, with the right answer
            assert by_id[row["id"]]["error"] is None, by_id[row["id"]]
            assert text_of(by_id[row["id"]]["response"]["body"]) == expected_text(row)

    # Quarantined for good: in RQ's failed registry only, no strike count left, queued nowhere.
    jid = job_id_for("poison", bad["id"])
    k = Keys("poison")
    assert fleet.r.hget(Keys.job(jid), "status") == b"failed"
    assert fleet.r.hget(Keys.job(jid), "exc_info").startswith(b"server_crash: ")
    assert not fleet.r.hexists(k.strikes, jid)
    assert fleet.r.llen(k.suspects) == 0 and fleet.r.llen(k.isolate) == 0

    def rate(a: str, b: str) -> float:
        (t_a, n_a), (t_b, n_b) = marks[a], marks[b]
        return (n_b - n_a) / max(t_b - t_a, 1e-6)

    (t_death, _), (t_quarantine, _) = marks["first_death"], marks["quarantined"]
    print(f"\npoison: quarantined {t_quarantine - t_death:.1f} s after the first death "
          f"({stats.get('struck', 0)} strikes, {stats.get('handed_back', 0)} handed back); prompts/s before the "
          f"first death {rate('first_result', 'first_death'):.0f}, between it and the quarantine "
          f"{rate('first_death', 'quarantined'):.0f}, second batch {rate('second_batch', 'all_done'):.0f}")


# --- issue 21 §3: the innocent prompts a death struck run at the fleet's pace --------------------------------
def _observed(fleet: Fleet, gpu: int) -> dict | None:
    """What the simulator of `gpu` sees now (None while it is down)."""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{fleet.port_base + gpu}/sim/observed", timeout=5).json()
    except httpx.HTTPError:
        return None


def test_prompts_struck_by_server_kills_run_in_groups_not_one_at_a_time_and_none_fails(tmp_path, fleets):
    """Every prompt of the run is inside the two servers when both are killed with -9: all 40 are struck
    (no poison among them). The restarted servers run them many at a time (the old rule ran one
    suspect per worker: a server's peak of running requests was 1). A third kill lands on a group of
    them: only that group goes on to run alone. results == prompts, none twice, none failed."""
    n = 40
    fleet = fleets(run="struck", prefix="struck.", gpus=2,
                   env={"SGLANG_SIM_TIME_SCALE": "0.5", "BATCHFLEET_SURPLUS": "12"})
    # every generation runs its 200 tokens (no early end of sequence): none can finish before both
    # workers have claimed, however unevenly a loaded box starts them
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=200, ignore_eos=True)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    for g in range(2):
        fleet.start_worker(g)

    def inside() -> int:
        seen = [_observed(fleet, g) for g in range(2)]
        return sum(o["running"] + o["queued"] for o in seen if o)

    fleet.wait_for(lambda: inside() == n and fleet.finished() == 0, 120, f"all {n} prompts inside the servers")
    first = [_observed(fleet, g)["pid"] for g in range(2)]  # type: ignore[index]
    for pid in first:
        os.kill(pid, signal.SIGKILL)  # deaths 1 and 2: every prompt struck once

    def restarted(g: int) -> dict | None:
        o = _observed(fleet, g)
        return o if o and o["pid"] not in first and o["ready"] else None

    fleet.wait_for(lambda: all(restarted(g) for g in range(2)), 120, "both servers restarted")
    fleet.wait_for(lambda: (restarted(0) or {}).get("running", 0) >= 2, 60, "a group of struck prompts on gpu0")
    second = restarted(0)
    assert second is not None
    os.kill(second["pid"], signal.SIGKILL)  # death 3: lands on a group, whose members then run alone

    fleet.wait_for(lambda: fleet.finished() >= n, 240, "every prompt to finish")
    last_gpu1 = _observed(fleet, 1)
    stats = fleet.stats()
    assert fleet.stop_all() == {0: 0, 1: 0}
    assert stats["server_deaths"] == 3 and stats.get("quarantined", 0) == 0 and stats.get("failed", 0) == 0
    assert stats["succeeded"] == n and stats["struck"] >= n
    # The struck prompts ran side by side after the deaths, not one at a time (a structural fact of
    # what the servers saw: the restarted servers ran several requests at once, and nothing but
    # struck prompts was left to run).
    assert second["peak_running"] >= 6, second
    assert last_gpu1 is not None and last_gpu1["pid"] not in first
    # Only death 3's group went on to run alone, each of its prompts once: the others ran side by side.
    # (Which worker ran which is the claims' race: a restarted worker may take its peer's struck prompts.)
    lost = [int(m) for m in re.findall(r"server lost with (\d+) prompt", fleet.worker_log(0))]
    assert len(lost) == 2 and 2 <= lost[1] <= 24, lost  # at most capacity + surplus inside the third
    alone = sum(fleet.worker_log(g).count("was inside 2 dead servers: running it alone") for g in range(2))
    assert alone == lost[1], (alone, lost)
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)  # results == prompts, exactly once each
    for row in rows:
        assert by_id[row["id"]]["error"] is None, by_id[row["id"]]
        assert text_of(by_id[row["id"]]["response"]["body"]) == expected_text(row)
    k = Keys("struck")
    assert fleet.r.llen(k.suspects) == 0 and fleet.r.llen(k.isolate) == 0 and fleet.r.hlen(k.strikes) == 0


# --- 7.5: one worker per GPU per host ---------------------------------------------------------------------
def test_a_second_worker_for_the_same_gpu_refuses_to_start_and_the_lock_dies_with_its_owner(tmp_path, fleets):
    n = 120
    fleet = fleets(run="lock", prefix="lock.", gpus=1, env={"SGLANG_SIM_TIME_SCALE": "5",
                                                            "BATCHFLEET_LEASE_TTL_S": "3"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    first = fleet.start_worker(0)
    fleet.wait_for(lambda: any(s.state is WorkerState.SERVING and s.in_flight > 0 for s in fleet.statuses()), 60,
                   "serving")
    server_pid = fleet.sim_record(0)["pid"]

    second = subprocess.run([str(BIN / "rq"), "worker", fleet.queue(0)], env=fleet.env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 3, second.stdout + second.stderr
    assert f"another batchfleet worker (pid {first.pid}) already owns" in second.stdout + second.stderr
    assert pid_alive(server_pid)  # the first worker's server was not touched
    assert first.poll() is None and fleet.r.scard("rq:workers") == 1  # the refused one never registered

    first.send_signal(signal.SIGKILL)  # the lock dies with its owner, even on kill -9
    first.wait(10)
    third = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt, on the worker that took over")
    assert fleet.stop_all() == {0: 0} and third.returncode == 0
    assert "left by an earlier worker" not in fleet.worker_log(0)  # it died with its worker: nothing to kill
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    assert all(x["error"] is None for x in by_id.values()) and fleet.stats()["succeeded"] == n


def test_a_stale_pid_file_leads_to_a_kill_only_when_it_is_verifiably_our_old_server(tmp_path, fleets):
    from worker.server import write_pid_record

    fleet = fleets(run="pidfile", prefix="pidfile.", gpus=1)
    pid_path = tmp_path / "state" / "logs" / "sglang-gpu0.pid"
    pid_path.parent.mkdir(parents=True)
    stranger = subprocess.Popen(["sleep", "300"])
    leftover = None
    try:
        # 1. The pid now belongs to another process (pid reused): never signalled, in either file format.
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        for record in ({"pid": stranger.pid, "start_ticks": 1, "boot_id": boot_id,
                        "cmdline": [sys.executable, "-m", "sglang_sim"]}, stranger.pid):
            pid_path.write_bytes(orjson.dumps(record))
            proc = fleet.start_worker(0)
            fleet.wait_for(lambda: any(s.state is WorkerState.SERVING for s in fleet.statuses()), 60, "serving")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert stranger.poll() is None, "a process that merely reuses the pid was killed"
        assert "is not the server recorded there (pid reused): left alone" in fleet.worker_log(0)

        # 2. Our old server, still holding the GPU's port (its worker could not take it along): stopped.
        port = fleet.port_base
        leftover = subprocess.Popen([sys.executable, "-m", "sglang_sim", "--model-path", "sim/tiny-hybrid",
                                     "--port", str(port)], env=fleet.env, start_new_session=True,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        write_pid_record(pid_path, leftover.pid)
        write_prompts(tmp_path / "prompts.jsonl", 20)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.finished() >= 20, 60, "prompts on the worker's own new server")
        assert leftover.wait(10) is not None  # killed (and reaped here)
        assert fleet.sim_record(0)["pid"] != leftover.pid
        assert "left by an earlier worker (verified" in fleet.worker_log(0)
        assert fleet.stop_all() == {0: 0}
    finally:
        stranger.kill()
        stranger.wait()
        if leftover is not None and leftover.poll() is None:
            leftover.kill()
            leftover.wait()


# --- 7.6: bookkeeping defects ------------------------------------------------------------------------------
def test_a_worker_paused_for_a_long_results_stream_resumes_when_the_collector_drains_it(tmp_path, fleets):
    n = 80  # more than its first claims (capacity 12 + an initial surplus of 12): it must resume to finish
    fleet = fleets(run="pause", prefix="pause.", gpus=1, env={"BATCHFLEET_MAX_PENDING_RESULTS": "5"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: "results stream holds" in fleet.worker_log(0), 60, "the worker to pause")
    paused_at = fleet.finished()
    assert 5 < paused_at < n
    collector = subprocess.Popen([str(BIN / "producer"), "collect", "--follow", "--interval", "0.2"], env=fleet.env,
                                 cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        fleet.wait_for(lambda: fleet.finished() >= n, 120, "the paused worker to resume and finish")
    finally:
        collector.send_signal(signal.SIGTERM)
        collector.wait(30)
    assert fleet.stop_all() == {0: 0}
    assert "taking work again" in fleet.worker_log(0)
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows) and fleet.stats()["succeeded"] == n


def _final_counts(log: str) -> dict[str, int]:
    line = next(x for x in reversed(log.splitlines()) if " stopped: " in x and "done" in x)
    tail = line.split(" stopped: ", 1)[1]
    return {name: int(num) for num, name in (part.strip().split(" ", 1) for part in tail.split(","))}


def test_after_a_server_crash_nothing_cycles_and_the_counts_are_exact(tmp_path, fleets):
    # The server dies at its 70th admission: the prompts inside it get a strike and go back once;
    # while it restarts the worker claims nothing (no claim -> fail -> hand back loop).
    n = 120
    fleet = fleets(run="crash", prefix="crash.", gpus=1, env={"SGLANG_SIM_CRASH_AFTER": "70"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt despite the crash")
    assert fleet.stop_all() == {0: 0}
    stats = fleet.stats()
    assert stats["server_deaths"] == 1 and stats["succeeded"] == n and stats.get("failed", 0) == 0
    back = stats.get("struck", 0) + stats.get("handed_back", 0)
    # at most what was in hand once (capacity 12 + a surplus of at most as many), nothing cycled
    assert 1 <= back <= 12 + 12, stats
    counts = _final_counts(fleet.worker_log(0))  # the worker's own counts agree with Redis's exactly
    assert counts["handed back"] == stats.get("handed_back", 0) and counts["struck"] == stats.get("struck", 0)
    assert counts["done"] == n and counts["server death(s)"] == 1
    assert sorted(export(fleet, tmp_path)) == sorted(r["id"] for r in rows)


def test_a_server_death_while_redis_is_away_leaves_no_lease_held_forever(tmp_path, fleets):
    # Redis (with AOF) goes away, then the server is killed: the worker cannot record the death. It
    # must not keep those prompts leased (renewed forever, never run): it forgets them, their leases
    # lapse on Redis's clock, and they run again once Redis is back.
    from .conftest import RedisServer

    redis_server = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    redis_server.start()
    try:
        n = 40
        fleet = fleets(run="away", prefix="away.", gpus=1, env={"SGLANG_SIM_TIME_SCALE": "2",
                                                                "BATCHFLEET_LEASE_TTL_S": "3"})
        fleet.redis_url = redis_server.url
        fleet.env["REDIS_URL"] = redis_server.url
        fleet.r = __import__("redis").Redis.from_url(redis_server.url)
        rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=200)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.r.zcard(fleet.k.leases) >= 5, 60, "prompts in flight")
        redis_server.stop()
        os.kill(fleet.sim_record(0)["pid"], signal.SIGKILL)
        fleet.wait_for(lambda: "could not record the server death" in fleet.worker_log(0), 60,
                       "the worker to give up recording the death")
        redis_server.start()
        fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt after Redis came back")
        assert fleet.stop_all() == {0: 0}
        assert fleet.r.zcard(fleet.k.leases) == 0
        stats = fleet.stats()
        assert stats["succeeded"] == n and stats.get("recovered", 0) >= 1
        assert sorted(export(fleet, tmp_path)) == sorted(r["id"] for r in rows)
    finally:
        redis_server.stop()


def test_outcomes_a_worker_could_not_write_before_it_exited_are_said_and_run_again_exactly_once(tmp_path, fleets):
    # Redis (with AOF) goes away while prompts keep finishing in the server; the worker is then told to stop.
    # Their outcomes cannot be written: the worker says how many in one line (their leases lapse on Redis's
    # clock), and once Redis is back another worker runs them: every prompt exactly once in the export.
    from .conftest import RedisServer

    redis_server = RedisServer(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    redis_server.start()
    try:
        n = 40
        fleet = fleets(run="unwritten", prefix="unwritten.", gpus=1, env={
            "SGLANG_SIM_TIME_SCALE": "2", "BATCHFLEET_LEASE_TTL_S": "4", "BATCHFLEET_SHUTDOWN_GRACE_S": "2"})
        fleet.redis_url = redis_server.url
        fleet.env["REDIS_URL"] = redis_server.url
        fleet.r = __import__("redis").Redis.from_url(redis_server.url)
        rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=64)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        worker = fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.r.zcard(fleet.k.leases) >= 5 and fleet.finished() >= 1, 60, "prompts in flight")

        def finished_in_server() -> int:
            rec = fleet.sim_record(0)
            return rec["requests_total"] - rec["running"] - rec["queued"] - rec.get("aborted_total", 0)

        redis_server.stop()
        at_stop = finished_in_server()
        fleet.wait_for(lambda: finished_in_server() >= at_stop + 3, 60, "prompts finishing while Redis is away")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(90) == 0
        said = [x for x in fleet.worker_log(0).splitlines() if "could not write the outcome of" in x]
        assert len(said) == 1, fleet.worker_log(0)[-3000:]
        unwritten = int(said[0].split("could not write the outcome of ")[1].split()[0])
        assert unwritten >= 3

        redis_server.start()
        fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt after Redis came back")
        assert fleet.stop_all() == {0: 0}
        stats = fleet.stats()
        assert stats["succeeded"] == n and stats.get("recovered", 0) >= unwritten
        assert sorted(export(fleet, tmp_path)) == sorted(r["id"] for r in rows)
    finally:
        redis_server.stop()


# --- 7.7: a bad record never stops the fleet ------------------------------------------------------------
def test_a_bad_control_record_stops_no_worker_now_or_after_a_restart(tmp_path, fleets):
    n, gpus = 240, 2
    fleet = fleets(run="badrec", prefix="badrec.", gpus=gpus, env={"SGLANG_SIM_TIME_SCALE": "10"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    for g in range(gpus):
        fleet.start_worker(g)
    fleet.wait_for(lambda: sum(s.state is WorkerState.SERVING and s.in_flight > 0 for s in fleet.statuses()) == gpus,
                   60, "every worker serving")
    # A field from a newer version: ignored with one warning; same generation, so nothing restarts.
    fleet.r.hset(fleet.k.control, Keys.CONTROL_FLEET, orjson.dumps({"generation": 0, "strategy": "default",
                                                                    "added_by_a_newer_version": {"x": 1}}))
    fleet.wait_for(lambda: all("added_by_a_newer_version" in fleet.worker_log(g) for g in range(gpus)), 30,
                   "the unknown field to be noticed")
    # An invalid spec: refused, one event per worker, the current server kept.
    fleet.r.hset(fleet.k.control, Keys.CONTROL_FLEET, orjson.dumps({"generation": 1, "strategy": "bogus",
                                                                    "shiny": True}))
    fleet.wait_for(lambda: len(fleet.events("spec_refused")) >= gpus, 30, "each worker to refuse the spec")
    refused_at = max(e.ts for e in fleet.events("spec_refused"))
    # Several spec reads later (each worker reads it every second), still one event per worker.
    fleet.wait_for(lambda: len(fleet.statuses()) == gpus and all(s.ts > refused_at + 3 for s in fleet.statuses()),
                   30, "a few more seconds of every worker's life")
    assert len(fleet.events("spec_refused")) == gpus
    assert all(s.state is WorkerState.SERVING and s.generation == 0 for s in fleet.statuses())
    assert all(fleet.worker_log(g).count("added_by_a_newer_version") == 1 for g in range(gpus))
    fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt of the first batch")

    # Restarted workers meet the same record: they start on their configuration and serve.
    assert fleet.stop_all() == {g: 0 for g in range(gpus)}
    more = write_prompts(tmp_path / "more.jsonl", 60, max_tokens=64, start=n)
    fleet.producer("enqueue", "more.jsonl", "--queues", fleet.queues)
    for g in range(gpus):
        fleet.start_worker(g)
    fleet.wait_for(lambda: fleet.finished() >= n + 60, 120, "every prompt after the restart")
    assert fleet.stop_all() == {g: 0 for g in range(gpus)}
    refused = fleet.events("spec_refused")
    assert len(refused) == 2 * gpus and len({e.source for e in refused}) == 2 * gpus
    assert "strategy 'bogus'" in refused[0].message
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows + more) and fleet.stats()["succeeded"] == n + 60


# --- 8.1: a job is data ----------------------------------------------------------------------------------
class Listener:
    """A TCP listener that records every connection it gets: forged jobs must not reach it."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.seen.append(conn.recv(65536) or b"<connected>")
                except OSError:
                    self.seen.append(b"<connected>")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _forge(r, queue: str, jid: str, payload: object, *, raw: bytes | None = None) -> str:
    """Write a job into Redis as someone with write access could, bypassing the producer."""
    data = raw if raw is not None else orjson.dumps(["batchfleet.jobs.generate", None, [payload], {}])
    r.hset(Keys.job(jid), mapping={"data": data, "origin": queue, "status": "queued", "description": "forged"})
    r.rpush(Keys.queue(queue), jid)
    return jid


def test_forged_jobs_are_refused_and_the_server_key_goes_nowhere_else(tmp_path, fleets):
    import zlib

    key, n = "sekrit-server-key-123", 20
    listener = Listener()
    try:
        fleet = fleets(run="forge", prefix="forge.", gpus=1, env={"BATCHFLEET_SERVER_API_KEY": key})
        rows = write_prompts(tmp_path / "prompts.jsonl", n)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        q, there = fleet.queue(0), f"http://127.0.0.1:{listener.port}"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

        def job(cid: str, **over: object) -> dict:
            return {"cid": cid, "seq": 999, "url": "/v1/chat/completions", "body": chat, "run": "forge", **over}

        bomb = zlib.compress(b'["batchfleet.jobs.generate", null, [{"cid": "' + b" " * 40_000_000 + b'"}], {}]')
        forged = [
            _forge(fleet.r, q, job_id_for("forge", "abs"), job("abs", url=there + "/v1/chat/completions")),
            _forge(fleet.r, q, job_id_for("forge", "rel"), job("rel", url=f"//127.0.0.1:{listener.port}/x")),
            _forge(fleet.r, q, job_id_for("forge", "dots"), job("dots", url="/v1/chat/completions/../../exfil")),
            _forge(fleet.r, q, job_id_for("", "norun"), {k: v for k, v in job("norun").items() if k != "run"}),
            _forge(fleet.r, q, job_id_for("other", "other"), job("other", run="other")),
            _forge(fleet.r, q, "bf-000000000000000000000000", job("p0")),  # a second p0 under another id
            _forge(fleet.r, q, job_id_for("forge", "key"), job("key", body={**chat, "api_base": there})),
            _forge(fleet.r, q, job_id_for("forge", "stream"), job("stream", body={**chat, "stream": True})),
            _forge(fleet.r, q, job_id_for("forge", "shape"), job("shape", body={"prompt": "x"})),
            _forge(fleet.r, q, "bf-sys", None, raw=orjson.dumps(["os.system", None, ["touch /tmp/pwned"], {}])),
            _forge(fleet.r, q, "bf-bomb", None, raw=bomb),
        ]
        fleet.start_worker(0)
        fleet.wait_for(lambda: fleet.finished() >= n and int(fleet.r.hget(fleet.k.stats, "refused") or 0)
                       >= len(forged), 60, "the prompts to run and the forged jobs to be refused")
        assert fleet.stop_all() == {0: 0}

        assert listener.seen == []  # nothing (and so no key) ever went anywhere else
        record = fleet.sim_record(0)
        assert sum(record["requests_by_endpoint"].values()) == n  # the server saw the real prompts only
        stats = fleet.stats()
        assert stats["refused"] == len(forged) and stats["succeeded"] == n and stats.get("failed", 0) == 0
        for jid in forged:  # refused: RQ's failed registry says why; never a result
            assert fleet.r.hget(Keys.job(jid), "exc_info").startswith(b"refused: ")
        assert fleet.r.zcard(Keys.failed(q)) == len(forged)
        by_id = export(fleet, tmp_path)
        assert sorted(by_id) == sorted(r["id"] for r in rows)
        assert all(x["error"] is None for x in by_id.values())
        log = fleet.worker_log(0)
        assert "not on batchfleet's allow-list" in log and "unknown url" in log and "names no run" in log
        assert "inflates past" in log and "job id is not the one" in log
    finally:
        listener.close()


# --- 8.3: RQ's pubsub shutdown command ---------------------------------------------------------------------
def test_rq_shutdown_command_drains_and_exits_nonzero_so_it_is_restarted(tmp_path, fleets):
    from rq.command import send_shutdown_command

    n = 36
    fleet = fleets(run="shut", prefix="shut.", gpus=1, env={"SGLANG_SIM_TIME_SCALE": "3",
                                                            "BATCHFLEET_SHUTDOWN_GRACE_S": "0.5"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=400)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    proc = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.r.zcard(fleet.k.leases) >= 5, 60, "prompts in flight")
    (name,) = [s.worker for s in fleet.statuses()]
    channel = f"rq:pubsub:{name}"
    # Garbage and commands without meaning here are data: ignored, and later commands still heard.
    fleet.r.publish(channel, b"\xff not json")
    fleet.r.publish(channel, orjson.dumps({"command": "kill-horse"}))
    fleet.wait_for(lambda: fleet.worker_log(0).count("ignored an RQ pubsub message") == 2, 30, "both ignored")
    assert proc.poll() is None
    server_pid = fleet.sim_record(0)["pid"]
    send_shutdown_command(fleet.r, name)
    assert proc.wait(60) == 75  # nonzero: a restart-on-failure policy starts it again
    # Drained: nothing half-done; every prompt finished or back in its queue.
    assert fleet.r.zcard(fleet.k.leases) == 0 and fleet.r.zcard(Keys.started(fleet.queue(0))) == 0
    assert fleet.finished() + fleet.r.llen(Keys.queue(fleet.queue(0))) == n
    assert int(fleet.r.hget(fleet.k.stats, "handed_back") or 0) >= 1
    assert [e.data["exit_code"] for e in fleet.events("shutdown_command")] == [75]
    assert not pid_alive(server_pid)  # the worker stopped its server before it exited

    fleet.start_worker(0)  # what systemd's Restart=on-failure does
    fleet.wait_for(lambda: fleet.finished() >= n, 120, "every prompt after the restart")
    assert fleet.stop_all() == {0: 0}
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows) and fleet.stats()["succeeded"] == n


# --- 12: leases on Redis's clock ---------------------------------------------------------------------------
def test_workers_with_clocks_minutes_off_recover_nothing_early_and_nothing_late(tmp_path, fleets):
    n, ttl = 90, 10.0  # 10 s: a live worker's renewal is never that late on a loaded 2-core machine
    fleet = fleets(run="clock", prefix="clock.", gpus=3, env={"SGLANG_SIM_TIME_SCALE": "2",
                                                              "BATCHFLEET_LEASE_TTL_S": str(ttl)})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=300)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    offsets = {0: 0.0, 1: 600.0, 2: -600.0}  # one on time, one ten minutes ahead, one ten behind
    for g, off in offsets.items():
        fleet.start_worker(g, env={"BATCHFLEET_TEST_CLOCK_OFFSET_S": str(off)})
    fleet.wait_for(lambda: fleet.r.zcard(fleet.k.leases) >= 30, 60, "all three workers with prompts in flight")

    # Every lease expires within one lease time of Redis's clock, whoever wrote it.
    redis_now = float("{}.{:06d}".format(*fleet.r.time()))
    scores = [s for _, s in fleet.r.zrange(fleet.k.leases, 0, -1, withscores=True)]
    assert all(s <= redis_now + ttl + 0.01 for s in scores), (redis_now, sorted(scores)[-3:])
    assert all(s > redis_now - 60 for s in scores), (redis_now, sorted(scores)[:3])
    fleet.wait_for(lambda: fleet.finished() >= 30, 120, "a third of the prompts")
    assert int(fleet.r.hget(fleet.k.stats, "recovered") or 0) == 0  # no live worker's prompt was taken early
    # Status records carry each worker's own (skewed) clock: proof the offsets were applied.
    ts = {s.worker.split(".")[-2]: s.ts for s in fleet.statuses()}
    assert ts["gpu1"] - ts["gpu0"] > 500 and ts["gpu0"] - ts["gpu2"] > 500

    # The on-time and the ahead worker die; only the one ten minutes behind is left to recover.
    for g in (0, 1):
        fleet.workers[g].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    for g in (0, 1):
        fleet.workers[g].wait(10)
    # Counted after the kill: a prompt the dead finished just before it is no victim, so the victims are
    # the leases left, not the in-flight count read before the kill.
    held = {execution_job(m) for m in fleet.r.zrange(fleet.k.leases, 0, -1)}
    # (A live worker's prompt can finish, and its job hash go, between the two reads: it is no victim.)
    victims = {jid for jid in held if (fleet.r.hget(Keys.job(jid), "worker_name") or b"").decode().split(".")[-2:-1]
               in (["gpu0"], ["gpu1"])}
    assert victims
    fleet.wait_for(lambda: int(fleet.r.hget(fleet.k.stats, "recovered") or 0) >= len(victims), 60,
                   "the skewed worker to recover the dead workers' prompts")
    recovered_after = time.monotonic() - killed
    period = ttl / 3
    assert recovered_after >= ttl - period - 0.5, recovered_after  # not early (a lease lives ttl past renewal)
    fleet.wait_for(lambda: fleet.finished() >= n, 180, "every prompt")
    assert fleet.stop_all()[2] == 0
    stats = fleet.stats()
    assert stats["succeeded"] == n
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    print(f"\nclock skew ±600 s: {len(victims)} prompts of two killed workers recovered {recovered_after:.1f} s after "
          f"the kill by the worker 10 min behind (lease {ttl:.0f} s, renewed every {period:.0f} s)")
