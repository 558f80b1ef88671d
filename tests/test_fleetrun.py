"""`batchfleet run` end to end: its own private redis-server (AOF in the state dir), real `rq worker`
processes with simulated SGLang servers, the head and the supervisor, all started by the command.

What an outsider sees: the export (one line per prompt, none twice), exit codes, what the simulated
servers say they served, and the private Redis surviving a Ctrl-C for the re-run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import RQ_QUEUES, Keys
from batchfleet.procs import pid_alive
from batchfleet.records import Event, WorkerState
from producer.store import Store

from .fleet import ROOT, expected_text, free_port_block, text_of, write_prompts

BIN = Path(sys.executable).parent
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

pytestmark = pytest.mark.slow


def run_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHFLEET_", "REDIS_URL", "RQ_", "SGLANG_SIM"))}
    env.update({
        "PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{env.get('PATH', '')}",
        "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
        "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid",
        "BATCHFLEET_PORT_BASE": str(free_port_block(2)),
        "BATCHFLEET_STARTUP_TIMEOUT_S": "60",
        "BATCHFLEET_STATUS_INTERVAL_S": "0.5",
        "SGLANG_SIM_GPU_DIR": str(tmp / "gpus"),
        "SGLANG_SIM_STARTUP_S": "0.2",
        "SGLANG_SIM_RECORD": str(tmp / "sim-gpu{gpu}.json"),
        **extra,
    })
    return env


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every `batchfleet run` a test starts; killed (its whole session: workers, servers, Redis) at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(60)
        if p.poll() is None:
            p.kill()


def start(tmp: Path, env: dict[str, str], procs: list[subprocess.Popen[bytes]], *args: str) -> subprocess.Popen[bytes]:
    log = (tmp / f"run-{len(procs)}.log").open("wb")
    p = subprocess.Popen([str(BIN / "batchfleet"), "run", "prompts.jsonl", "-o", "results.jsonl", "--gpus", "0-1",
                          "--progress-every", "1", *args], env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def output(tmp: Path, i: int) -> str:
    return (tmp / f"run-{i}.log").read_text(errors="replace")


def served(tmp: Path) -> int:
    """Prompts the simulated servers say they served (the records of the last servers on each GPU)."""
    total = 0
    for g in (0, 1):
        path = tmp / f"sim-gpu{g}.json"
        if path.exists():
            rec = orjson.loads(path.read_bytes())
            total += sum(rec["requests_by_endpoint"].get(ep, 0) for ep in ENDPOINTS)
    return total


def check_export(tmp: Path, rows: list[dict]) -> None:
    lines = [orjson.loads(x) for x in (tmp / "results.jsonl").read_bytes().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert [i for i, n in Counter(ids).items() if n > 1] == []  # 0 duplicated
    assert ids == [r["id"] for r in rows]  # 0 missing, input order
    for row, line in zip(rows, lines, strict=True):
        assert line["error"] is None and text_of(line["response"]["body"]) == expected_text(row)


def test_batchfleet_run_on_two_simulated_gpus_with_a_private_redis(tmp_path: Path,
                                                                   procs: list[subprocess.Popen[bytes]]) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 60, max_tokens=24)
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="40")
    p = start(tmp_path, env, procs)
    assert p.wait(240) == 0, output(tmp_path, 0)
    out = output(tmp_path, 0)
    assert "a private redis-server at redis://127.0.0.1:" in out
    assert re.search(r"\] 60/60 \(100%\)", out), out  # the progress line reached the end
    assert "wrote 60 lines to results.jsonl (60 succeeded, 0 failed)" in out
    check_export(tmp_path, rows)
    assert served(tmp_path) == 60  # every prompt reached a server exactly once
    state = tmp_path / ".batchfleet"
    assert (state / "prompts.redis" / "appendonlydir").is_dir()  # the private Redis kept an AOF
    logs = state / "logs" / "prompts"  # the run's own
    assert {"worker-gpu0.log", "worker-gpu1.log", "head.log", "supervisor.log"} <= {f.name for f in logs.iterdir()}
    # the private Redis is gone: it removes its pid file on a clean shutdown (or the pid is dead)
    # Logs may quote prompts and servers' flags: only their owner reads them.
    assert (state / "logs").stat().st_mode & 0o777 == 0o700 and logs.stat().st_mode & 0o777 == 0o700
    assert {f.name: f.stat().st_mode & 0o777 for f in logs.iterdir() if f.suffix == ".log"} == \
        {f.name: 0o600 for f in logs.iterdir() if f.suffix == ".log"}
    pidfile = state / "prompts.redis" / "redis.pid"
    if pidfile.exists():
        assert not pid_alive(int(pidfile.read_text()))
    # the same command again: nothing left to run, nothing served again, the same export
    p2 = start(tmp_path, env, procs)
    assert p2.wait(120) == 0, output(tmp_path, 1)
    assert "0 new, 0 already in the store, 60 already finished" in output(tmp_path, 1)
    assert "started" not in output(tmp_path, 1)  # no worker was started
    check_export(tmp_path, rows)


def test_ctrl_c_drains_and_the_same_command_resumes_without_running_a_finished_prompt_twice(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    n = 240
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=48)
    # --dry-run: the supervisor restarts nothing, so every served request is a prompt's one run
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="2", BATCHFLEET_WINDOW_DEFAULT="40", BATCHFLEET_WINDOW_MAX="40")
    p = start(tmp_path, env, procs, "--dry-run")
    store_path = tmp_path / ".batchfleet" / "prompts.sqlite"

    def counts() -> dict[str, int]:
        store = Store.open(store_path, run="prompts", readonly=True)
        try:
            with store.read():
                return store.counts()
        finally:
            store.close()

    deadline = time.monotonic() + 180
    # the store is complete once the processes start (they start after the enqueue)
    while not ("started 2 worker(s)" in output(tmp_path, 0) and counts()["succeeded"] >= 10):
        assert p.poll() is None, output(tmp_path, 0)
        assert time.monotonic() < deadline, output(tmp_path, 0)
        time.sleep(0.2)
    # a supervisor decision on the events stream is said on one line
    url = re.search(r"private redis-server at (redis://\S+)", output(tmp_path, 0)).group(1)
    r = redis.Redis.from_url(url)
    r.xadd(Keys("prompts").events, {"e": Event(kind="decision", message="test decision line\nsecond line",
                                               source="supervisor").to_json()})
    deadline = time.monotonic() + 30
    while "supervisor decision: test decision line" not in output(tmp_path, 0):
        assert time.monotonic() < deadline, output(tmp_path, 0)
        time.sleep(0.2)
    r.close()
    p.send_signal(signal.SIGINT)
    assert p.wait(120) == 130, output(tmp_path, 0)
    first = output(tmp_path, 0)
    assert "interrupted: draining" in first and "run the same command again to resume" in first
    assert "second line" not in first  # one line per event
    assert not (tmp_path / "results.jsonl").exists()  # nothing exported on Ctrl-C
    after = counts()
    assert 10 <= after["succeeded"] < n and after["pending"] == n - after["succeeded"] - after["failed"]
    served_first = served(tmp_path)
    for g in (0, 1):  # the next servers write new records
        (tmp_path / f"sim-gpu{g}.json").unlink(missing_ok=True)

    p2 = start(tmp_path, env, procs, "--dry-run")
    assert p2.wait(300) == 0, output(tmp_path, 1)
    second = output(tmp_path, 1)
    done = after["succeeded"] + after["failed"]
    assert f"0 new, {n - done:,} already in the store, {done:,} already finished" in second
    assert f"stopped: {done:,} of {n:,} prompts done, {n - done:,} pending" in first
    assert f"wrote {n} lines to results.jsonl ({n} succeeded, 0 failed)" in second
    check_export(tmp_path, rows)  # exact counts, 0 duplicated
    # no prompt finished by the first run was served again: the second run served at most what was pending
    served_second = served(tmp_path)
    assert served_second <= after["pending"], (served_first, served_second, after)
    assert served_first + served_second >= n


def test_a_server_that_cannot_start_shows_with_its_reason_and_no_traceback(tmp_path: Path, redis_url: str) -> None:
    """A bad BATCHFLEET_SGLANG_CMD: the real worker says DOWN and why in its status record; `producer
    status` and `supervisor status` show the reason; the worker's output has no traceback."""
    from .fleet import Fleet

    fleet = Fleet(tmp_path, redis_url, run="down", gpus=2, prefix="down.",
                  env={"BATCHFLEET_SGLANG_CMD": f"{tmp_path / 'no-such-python'} -m sglang_sim"})
    try:
        write_prompts(tmp_path / "prompts.jsonl", 2)
        fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
        fleet.start_worker(0)
        fleet.wait_for(lambda: any(s.state is WorkerState.DOWN for s in fleet.statuses()), 60, "a DOWN status record")
        status = fleet.producer("status").stdout
        assert re.search(r"worker \S+ \(queue down\.gpu0\): server DOWN: could not run \S*no-such-python", status), \
            status
        sup = subprocess.run([str(BIN / "supervisor"), "status"], env=fleet.env, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        # The table wraps a long reason at the terminal's width: read it without its line breaks.
        assert sup.returncode == 0 and "no-such-python" in "".join(sup.stdout.split()) and "down" in sup.stdout, \
            sup.stdout
        codes = fleet.stop_all()
        assert codes == {0: 0}
        assert "Traceback" not in fleet.worker_log(0) and "no-such-python" in fleet.worker_log(0)
        # no model path: a configuration error. The worker exits 2 with one line; its DOWN record says why
        # until it expires
        sim = f"{sys.executable} -m sglang_sim"
        w = fleet.start_worker(1, env={"BATCHFLEET_MODEL_PATH": "", "BATCHFLEET_SGLANG_CMD": sim})
        assert w.wait(60) == 2, fleet.worker_log(1)
        assert "Traceback" not in fleet.worker_log(1) and "set BATCHFLEET_MODEL_PATH" in fleet.worker_log(1)
        status = fleet.producer("status").stdout
        why = r"\(queue down\.gpu1\): server DOWN: configuration error: .*set BATCHFLEET_MODEL_PATH"
        assert re.search(why, status), status
    finally:
        fleet.kill_all()


def test_batchfleet_run_uses_redis_url_when_it_answers_and_says_why_a_server_is_down(
        tmp_path: Path, redis_url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    rows = write_prompts(tmp_path / "prompts.jsonl", 20, max_tokens=16)
    bad = run_env(tmp_path, REDIS_URL=redis_url, BATCHFLEET_SGLANG_CMD=f"{tmp_path / 'no-such-python'} -m sglang_sim")
    p = start(tmp_path, bad, procs)
    deadline = time.monotonic() + 120
    while "server DOWN" not in output(tmp_path, 0):
        assert p.poll() is None and time.monotonic() < deadline, output(tmp_path, 0)
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    assert p.wait(120) == 130, output(tmp_path, 0)
    first = output(tmp_path, 0)
    assert f"Redis: {redis_url}" in first and "private" not in first
    assert re.search(r"prompts\.gpu[01]: server DOWN: could not run \S*no-such-python", first), first
    assert first.count("server DOWN") == 2  # once per worker and reason, not once per second
    r = redis.Redis.from_url(redis_url)
    assert r.exists(Keys("prompts").meta)  # the run lives in that Redis, under its own queues
    assert {Keys.queue_name(q) for q in r.smembers(RQ_QUEUES)} >= {"prompts.gpu0", "prompts.gpu1"}
    good = run_env(tmp_path, REDIS_URL=redis_url, SGLANG_SIM_TIME_SCALE="40")
    p2 = start(tmp_path, good, procs)
    assert p2.wait(240) == 0, output(tmp_path, 1)
    assert "0 new, 20 already in the store, 0 already finished" in output(tmp_path, 1)
    check_export(tmp_path, rows)


def test_another_file_of_the_same_name_is_refused_and_rerun_changed_serves_only_its_changed_prompts(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """The same base name and custom_ids, other prompts: never the first file's answers."""
    (tmp_path / "dA").mkdir()
    (tmp_path / "dB").mkdir()
    rows_a = write_prompts(tmp_path / "dA" / "prompts.jsonl", 10, max_tokens=16)
    rows_b = [dict(row) for row in rows_a]
    for i in (2, 5, 7):  # three prompts differ
        key = "messages" if "messages" in rows_b[i] else "prompt"
        rows_b[i][key] = [{"role": "user", "content": f"Something else {i}"}] if key == "messages" else f"Other {i}"
    (tmp_path / "dB" / "prompts.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows_b))
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="40")

    def run(name: str, out: str, *extra: str) -> tuple[int, str]:
        log = tmp_path / f"{out}.log"
        with log.open("wb") as fh:
            p = subprocess.Popen([str(BIN / "batchfleet"), "run", f"{name}/prompts.jsonl", "-o", out, "--gpus", "0",
                                  "--state-dir", "st", "--progress-every", "1", *extra], env=env, cwd=tmp_path,
                                 stdout=fh, stderr=subprocess.STDOUT)
            procs.append(p)
            code = p.wait(240)
        return code, log.read_text(errors="replace")

    def answers(out: str) -> list[str]:
        lines = [orjson.loads(x) for x in (tmp_path / out).read_bytes().splitlines()]
        assert all(x["error"] is None for x in lines)
        return [text_of(x["response"]["body"]) for x in lines]

    code, said = run("dA", "rA.jsonl")
    assert code == 0, said
    assert answers("rA.jsonl") == [expected_text(r) for r in rows_a] and served(tmp_path) == 10
    code, said = run("dB", "rB.jsonl")
    assert code == 2, said
    assert "dB/prompts.jsonl:3: custom_id 'p2' is in the store of run prompts with a different request; " \
           "3 custom_ids differ in all" in said and "--rerun-changed" in said
    assert "started" not in said and not (tmp_path / "rB.jsonl").exists()
    code, said = run("dB", "rB.jsonl", "--rerun-changed")
    assert code == 0, said
    assert "10 lines: 0 new, 0 already in the store, 7 already finished, 3 changed (run again)" in said
    assert answers("rB.jsonl") == [expected_text(r) for r in rows_b]
    assert served(tmp_path) == 3  # the new server's record: only the three changed prompts ran


def test_batchfleet_run_reads_its_prompts_from_stdin_every_line_of_them(tmp_path: Path) -> None:
    """`batchfleet run - -o OUT` with the prompts piped in: the first line too (the check for an empty
    input must not take it from the enqueue that follows)."""
    rows = write_prompts(tmp_path / "prompts.jsonl", 5, max_tokens=8)
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="40")
    with (tmp_path / "prompts.jsonl").open("rb") as stdin:
        done = subprocess.run([str(BIN / "batchfleet"), "run", "-", "-o", "results.jsonl", "--gpus", "0",
                               "--run", "piped"], env=env, cwd=tmp_path, stdin=stdin, capture_output=True,
                              text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    check_export(tmp_path, rows)
