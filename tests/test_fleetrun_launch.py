"""`batchfleet run`'s files and its one-at-a-time rule (issue 20 §4): a private state dir, logs per run,
no server pid file left after a clean stop, and a second `batchfleet run` of the same run on the same
Redis that says who is active and starts nothing; a run killed with -9 does not block the next one.
The lease itself (fleetrun.lease) on a real Redis, without processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import RQ_WORKERS, Keys
from fleetrun.lease import SERVE, Holder, LaunchLease, RunActive

from .fleet import write_prompts
from .test_fleetrun import check_export, output, procs, run_env, start  # noqa: F401  (procs: a fixture)

HOST = socket.gethostname()
BIN = Path(sys.executable).parent


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- the lease, on a real Redis ------------------------------------------------------------------------
def test_a_second_lease_of_a_run_is_refused_with_the_holders_host_and_pid(r: redis.Redis) -> None:
    first, other = LaunchLease(r, Keys("lr")), LaunchLease(r, Keys("other"))
    first.acquire()
    try:
        with pytest.raises(RunActive, match=rf"another batchfleet run of lr is active \({HOST}, pid {os.getpid()},"):
            LaunchLease(r, Keys("lr")).acquire()
        other.acquire()  # another run is not affected
    finally:
        first.release()
        other.release()  # its renewing thread would keep its key in the tests' Redis
    assert not r.exists(Keys("lr").launcher)  # released: the next one may start
    again = LaunchLease(r, Keys("lr"))
    again.acquire()
    again.release()


def test_a_lease_of_a_killed_run_is_taken_over_on_its_host_and_lapses_on_another(r: redis.Redis) -> None:
    key = Keys("lk").launcher
    # killed with -9 on this host: its pid is gone, so the lease is taken over at once
    r.set(key, Holder(host=HOST, pid=dead_pid(), started=time.time(), token="old").to_json(), px=60_000)
    lease = LaunchLease(r, Keys("lk"))
    lease.acquire()
    assert Holder.from_json(r.get(key)) == lease.me
    lease.release()
    # what is not a lease record (data from Redis) is no holder either
    r.set(key, b"\xff not json", px=60_000)
    lease = LaunchLease(r, Keys("lk"))
    lease.acquire()
    lease.release()
    # on another host its pid cannot be checked: it blocks until it lapses, never longer than its TTL
    r.set(key, Holder(host="elsewhere", pid=1234, started=time.time(), token="x").to_json(), px=800)
    with pytest.raises(RunActive, match=r"\(elsewhere, pid 1234,.*lapses within 15 s"):
        LaunchLease(r, Keys("lk")).acquire()
    deadline = time.monotonic() + 10
    while r.exists(key):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    lease = LaunchLease(r, Keys("lk"))
    lease.acquire()
    lease.release()


def test_a_lease_says_which_launcher_holds_it_and_one_this_version_does_not_know_still_holds(
        r: redis.Redis) -> None:
    key = Keys("lc").launcher
    serve = LaunchLease(r, Keys("lc"), command=SERVE)
    serve.acquire()
    try:
        with pytest.raises(RunActive, match=rf"another batchfleet serve of lc is active \({HOST}, pid {os.getpid()},"):
            LaunchLease(r, Keys("lc")).acquire()  # a `batchfleet run` of the same run
    finally:
        serve.release()
    record = {"host": "elsewhere", "pid": 1234, "started": time.time(), "token": "t"}
    for command, named in ((None, "batchfleet run"), ("batchfleet train", "batchfleet launcher")):
        # written before launchers said which they are, or by a launcher this version does not know
        r.set(key, orjson.dumps(record if command is None else {**record, "command": command}), px=60_000)
        with pytest.raises(RunActive, match=rf"another {named} of lc is active \(elsewhere, pid 1234,"):
            LaunchLease(r, Keys("lc"), command=SERVE).acquire()
    r.delete(key)


def test_the_live_run_renews_its_lease_and_releases_only_its_own(r: redis.Redis) -> None:
    key = Keys("ln").launcher
    lease = LaunchLease(r, Keys("ln"), ttl_s=0.9)
    lease.acquire()
    try:
        lowest = r.pttl(key)
        deadline = time.monotonic() + 10
        while (ttl := r.pttl(key)) <= lowest + 100:  # renewed: its time to live went up again
            assert ttl > 0 and time.monotonic() < deadline
            lowest = min(lowest, ttl)
            time.sleep(0.02)
        assert Holder.from_json(r.get(key)) == lease.me
    finally:
        lease.release()
    r.set(key, Holder(host=HOST, pid=os.getpid(), started=time.time(), token="someone else").to_json(), px=60_000)
    lease.release()  # a second release, or a lease lost to another run: leaves the other's alone
    assert Holder.from_json(r.get(key)).token == "someone else"


# --- batchfleet run, end to end --------------------------------------------------------------------------
@pytest.mark.slow
def test_batchfleet_run_keeps_its_state_dir_private_logs_per_run_and_no_server_pid_file(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    write_prompts(tmp_path / "prompts.jsonl", 12, max_tokens=16)
    write_prompts(tmp_path / "other.jsonl", 8, max_tokens=16, start=100)
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="40")
    p = start(tmp_path, env, procs, "--gpus", "0", "--no-supervisor")
    assert p.wait(240) == 0, output(tmp_path, 0)
    p2 = subprocess.Popen([str(BIN / "batchfleet"), "run", "other.jsonl", "-o", "other-out.jsonl", "--gpus", "0",
                           "--no-supervisor"], env=env, cwd=tmp_path,
                          stdout=(tmp_path / "run-1.log").open("wb"), stderr=subprocess.STDOUT)
    procs.append(p2)
    assert p2.wait(240) == 0, output(tmp_path, 1)
    state = tmp_path / ".batchfleet"
    assert state.stat().st_mode & 0o777 == 0o700  # like `producer enqueue`'s: the store and logs quote prompts
    logs = state / "logs"
    for run, other in (("prompts", "other"), ("other", "prompts")):
        files = {f.name for f in (logs / run).iterdir()}
        assert {"worker-gpu0.log", "head.log", "sglang-gpu0.log"} <= files, files
        worker_log = (logs / run / "worker-gpu0.log").read_text()
        assert f"Listening on {run}.gpu0" in worker_log and f"{other}.gpu0" not in worker_log  # not appended
        assert (logs / run).stat().st_mode & 0o777 == 0o700
    assert f"logs in {logs / 'prompts'}" in output(tmp_path, 0)
    assert list(state.rglob("sglang-gpu*.pid")) == []  # the servers were stopped cleanly: no pid file stays


@pytest.mark.slow
def test_a_second_batchfleet_run_of_the_same_run_says_who_is_active_and_starts_nothing(
        tmp_path: Path, redis_url: str, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    rows = write_prompts(tmp_path / "prompts.jsonl", 40, max_tokens=48)
    slow = run_env(tmp_path, REDIS_URL=redis_url, SGLANG_SIM_TIME_SCALE="1")
    first = start(tmp_path, slow, procs, "--gpus", "0", "--no-supervisor", "--dry-run")
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 120
    while r.scard(f"{RQ_WORKERS}:prompts.gpu0") < 1:  # the first run's worker is up
        assert first.poll() is None and time.monotonic() < deadline, output(tmp_path, 0)
        time.sleep(0.2)
    second = start(tmp_path, slow, procs, "--gpus", "0")
    assert second.wait(60) == 3, output(tmp_path, 1)
    said = output(tmp_path, 1)
    assert f"another batchfleet run of prompts is active ({HOST}, pid {first.pid}, since" in said
    assert "started 1 worker" not in said and "new, " not in said  # before the enqueue, before any process
    assert r.scard(f"{RQ_WORKERS}:prompts.gpu0") == 1  # one worker on the GPU's queue: the first run's
    heads = (tmp_path / ".batchfleet" / "logs" / "prompts" / "head.log").read_text()
    assert len(re.findall(r"batchfleet run \(pid \d+\) starts head", heads)) == 1
    first.send_signal(2)  # SIGINT: it drains and releases the lease
    assert first.wait(120) == 130, output(tmp_path, 0)
    assert not r.exists(Keys("prompts").launcher)
    # a run killed with -9 leaves its lease behind; on its own host the next run takes it over at once
    r.set(Keys("prompts").launcher, Holder(host=HOST, pid=dead_pid(), started=time.time(), token="k").to_json(),
          px=600_000)
    fast = run_env(tmp_path, REDIS_URL=redis_url, SGLANG_SIM_TIME_SCALE="40")
    third = start(tmp_path, fast, procs, "--gpus", "0", "--no-supervisor")
    assert third.wait(240) == 0, output(tmp_path, 2)
    check_export(tmp_path, rows)


def test_batchfleet_run_fresh_start_reaches_the_supervisor_it_starts(tmp_path: Path) -> None:
    """Issue 22 §4: `batchfleet run --fresh-start` starts `supervisor watch --fresh-start` (which ignores
    the fleet's memory); without it the supervisor starts on what earlier runs verified."""
    from batchfleet.config import Config
    from fleetrun.cli import build_parser
    from fleetrun.launch import start_fleet

    class Recorder:
        def __init__(self) -> None:
            self.workers: dict[int, object] = {}
            self.others: dict[str, object] = {}
            self.argv: dict[str, list[str]] = {}

        def start(self, name: str, argv: list[str], env: dict[str, str]) -> str:
            self.argv[name] = argv
            return name

    args = build_parser().parse_args(["run", "p.jsonl", "-o", "out.jsonl", "--fresh-start"])
    config = Config(run="fresh", state_dir=tmp_path)
    for fresh in (args.fresh_start, False):
        rec = Recorder()
        start_fleet(rec, config, [(0,)], fresh_start=fresh)  # type: ignore[arg-type]
        assert rec.argv["supervisor"][1:] == ["watch", *(["--fresh-start"] if fresh else [])]
