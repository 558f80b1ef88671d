"""A server that can never start, and a server that is up but fails everything (issue 21 §1, §2), each
injected on real parts: a real redis-server, real `rq worker` processes running our worker class,
simulated SGLang servers over HTTP that fail as SGLang does (sglang_sim: CUDA out of memory at start,
its port held by another process, HTTP 500 to every generation and to /health_generate).

Asserted as an outsider sees it: the workers' status records and events in Redis, what the simulated
servers served, the export (results == prompts, 0 duplicated, 0 lost, 0 failed)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from batchfleet.config import Config
from batchfleet.errors import ServerStartError
from batchfleet.records import ServerSpec, WorkerState
from worker.server import SGLangServer

from .fleet import BIN, Fleet, expected_text, text_of, write_prompts
from .simproc import start_sim

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def served(fleet: Fleet, gpu: int) -> int:
    path = fleet.record_path(gpu)
    if not path.exists():
        return 0
    rec = orjson.loads(path.read_bytes())
    return sum(rec["requests_by_endpoint"].get(ep, 0) for ep in ENDPOINTS)


def export(fleet: Fleet, tmp: Path) -> dict[str, dict]:
    out = tmp / "results.jsonl"
    fleet.producer("export", str(out))
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    by_id = {x["custom_id"]: x for x in lines}
    assert len(by_id) == len(lines), "a custom_id appears twice in the export"
    return by_id


def status_of(fleet: Fleet, gpu: int):
    return next((s for s in fleet.statuses() if s.queue == fleet.queue(gpu)), None)


def server_log(fleet: Fleet, gpu: int) -> str:
    path = fleet.tmp / "state" / "logs" / f"sglang-gpu{gpu}.log"
    return path.read_text(errors="replace") if path.exists() else ""


# --- §1: a GPU whose server can never start ---------------------------------------------------------------
@pytest.mark.slow
def test_a_gpu_whose_server_runs_out_of_memory_at_every_start_is_marked_failed_and_its_peer_serves_its_queue(
        tmp_path: Path, fleets) -> None:
    n = 80
    fleet = fleets(run="oom", prefix="oom.", gpus=2,
                   env={"SGLANG_SIM_FAIL_STARTUP": "oom", "SGLANG_SIM_FAULT_GPUS": "1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=24)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)  # half of them on gpu1's queue
    assert fleet.r.llen(fleet.k.queue(fleet.queue(1))) == n // 2
    fleet.start_worker(1)
    t0 = time.monotonic()
    fleet.wait_for(lambda: (s := status_of(fleet, 1)) is not None and s.state is WorkerState.FAILED, 120,
                   "gpu1 to be marked failed")
    failed_after = time.monotonic() - t0
    failed = status_of(fleet, 1)
    assert failed is not None
    assert re.search(r"CUDA out of memory \.\.\. Tried to allocate \d+\.\d\d GiB", failed.message), failed.message
    assert "3 starts failed in a row" in failed.message and "supervisor retry" in failed.message
    assert server_log(fleet, 1).count("torch.OutOfMemoryError: CUDA out of memory") == 3
    assert fleet.stats().get("succeeded", 0) == 0 and served(fleet, 1) == 0  # it took no work
    assert [e.data.get("queue") for e in fleet.events("gpu_failed")] == [fleet.queue(1)]
    status = fleet.producer("status").stdout  # what a person sees
    assert re.search(r"\(queue oom\.gpu1\): GPU FAILED \(takes no work\): CUDA out of memory \.\.\. Tried to "
                     "allocate", status), status
    sup = subprocess.run([str(BIN / "supervisor"), "status"], env=fleet.env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert sup.returncode == 0 and "failed: CUDA out of memory" in " ".join(sup.stdout.split()), sup.stdout

    # the healthy GPU serves both queues (its own, and the failed GPU's by stealing)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.finished() == n, 120, "every prompt")
    assert status_of(fleet, 1).state is WorkerState.FAILED  # it stayed out
    stats = fleet.stats()
    assert stats["succeeded"] == n and stats.get("failed", 0) == 0
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)  # results == prompts, once each
    for row in rows:
        assert by_id[row["id"]]["error"] is None and text_of(by_id[row["id"]]["response"]["body"]) == expected_text(row)

    # told to try again: it starts its server again (at once, not after failed_retry_s)
    sup = subprocess.run([str(BIN / "supervisor"), "retry"], env=fleet.env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert sup.returncode == 0 and fleet.queue(1) in sup.stdout, sup.stdout + sup.stderr
    fleet.wait_for(lambda: "told to try again" in fleet.worker_log(1), 30, "gpu1 to try again")
    fleet.wait_for(lambda: server_log(fleet, 1).count("torch.OutOfMemoryError: CUDA out of memory") >= 4, 60,
                   "a fourth start")
    log = fleet.worker_log(1)
    assert not re.search(r"gpu1: gpu1:", log), "a log line names its GPU twice"
    assert "Traceback" not in log
    assert fleet.stop_all() == {0: 0, 1: 0}
    assert served(fleet, 0) == n and served(fleet, 1) == 0  # the records' last word, written as each server stopped
    print(f"\noom: gpu1 marked failed {failed_after:.1f} s after its worker started")


@pytest.mark.slow
def test_a_port_held_by_another_process_names_that_process_and_marks_the_gpu_failed(tmp_path: Path, fleets) -> None:
    fleet = fleets(run="port", prefix="port.", gpus=1)
    holder = subprocess.Popen([sys.executable, "-m", "http.server", str(fleet.port_base), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{fleet.port_base}"],
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "the holder never listened"
            time.sleep(0.1)
        fleet.start_worker(0)
        fleet.wait_for(lambda: (s := status_of(fleet, 0)) is not None and s.state is WorkerState.FAILED, 120,
                       "gpu0 to be marked failed")
        message = status_of(fleet, 0).message
        assert f"port {fleet.port_base} is already in use by pid {holder.pid} (" in message, message
        assert "http.server" in message
        said = [x for x in fleet.worker_log(0).splitlines() if "could not start" in x]
        assert len(said) == 3 and all(x.count("gpu0:") == 1 for x in said), said  # each line names its GPU once
        assert "gpu0: gpu0:" not in fleet.worker_log(0)
    finally:
        holder.kill()
        holder.wait(10)
    assert fleet.stop_all() == {0: 0}


def test_a_foreign_server_answering_on_our_port_is_not_taken_for_our_server(tmp_path: Path, monkeypatch) -> None:
    """SGLang binds its port last: until it fails to, whatever holds the port answers /health_generate
    (here another SGLang). Its 200 must not make the worker take that server for its own."""
    fast = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50", "SGLANG_SIM_GPU_DIR": str(tmp_path / "g")}
    with start_sim(env=fast) as holder:
        for k, v in fast.items():
            monkeypatch.setenv(k, v)
        config = Config(sglang_cmd=f"{sys.executable} -m sglang_sim", model_path="sim/tiny-hybrid",
                        state_dir=tmp_path / "state", port_base=holder.port, startup_timeout_s=60)
        server = SGLangServer(config, gpu=1, port=holder.port)

        async def no_check() -> None:  # the port was free when checked; another process took it since
            return None

        monkeypatch.setattr(server, "clear_leftover", no_check)

        async def go() -> str:
            try:
                capacity = await server.start(ServerSpec())
            except ServerStartError as exc:
                return str(exc)
            finally:
                await server.stop()
            return f"started with capacity {capacity}"

        said = asyncio.run(go())
        assert holder.proc is not None
        assert said.startswith(f"port {holder.port} is already in use by pid {holder.proc.pid}"), said


# --- §2: a server that is up but fails everything --------------------------------------------------------
@pytest.mark.slow
def test_a_server_turning_sick_fails_no_prompt_is_restarted_and_every_prompt_is_exported_once(
        tmp_path: Path, fleets) -> None:
    n, sick_after = 300, 40
    fleet = fleets(run="sick", prefix="sick.", gpus=2,
                   env={"SGLANG_SIM_SICK_AFTER": str(sick_after), "SGLANG_SIM_FAULT_GPUS": "0",
                        "SGLANG_SIM_FAULTS_ONCE": str(tmp_path / "sick-spent"), "SGLANG_SIM_TIME_SCALE": "10"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=32)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.record_path(0).exists(), 60, "gpu0's server")
    first_pid = fleet.sim_record(0)["pid"]
    fleet.start_worker(1)
    fleet.wait_for(lambda: fleet.finished() == n, 240, "every prompt")
    stats = fleet.stats()
    assert stats.get("failed", 0) == 0, stats  # 0 prompts failed for the server's fault
    assert stats["succeeded"] == n
    # the sick server was restarted (no strike for its prompts: they were handed back untouched)
    assert (tmp_path / "sick-spent").exists()
    assert fleet.sim_record(0)["pid"] != first_pid and fleet.sim_record(0)["sick"] is False
    sick = fleet.events("server_sick")
    assert len(sick) == 1 and sick[0].data["queue"] == fleet.queue(0), [e.message for e in sick]
    assert "/health_generate answered 500" in sick[0].message
    assert stats.get("struck", 0) == 0
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)  # results == prompts: 0 lost, 0 duplicated
    for row in rows:
        line = by_id[row["id"]]
        assert line["error"] is None and text_of(line["response"]["body"]) == expected_text(row), line
    assert fleet.stop_all() == {0: 0, 1: 0}
    assert "1 sick restart(s)" in fleet.worker_log(0)
    assert "retries_exhausted" not in fleet.worker_log(0) + fleet.worker_log(1)
    print(f"\nsick after {sick_after}: {stats['succeeded']}/{n} succeeded, {stats.get('failed', 0)} failed, "
          f"{stats.get('handed_back', 0)} handed back uncounted, {stats.get('struck', 0)} struck, 1 restart "
          f"(pid {first_pid} -> {fleet.sim_record(0)['pid']})")


@pytest.mark.slow
def test_a_server_that_stays_sick_after_restarts_is_marked_failed_and_its_peer_finishes(tmp_path: Path,
                                                                                       fleets) -> None:
    n = 200
    fleet = fleets(run="sick3", prefix="sick3.", gpus=2,
                   env={"SGLANG_SIM_SICK_AFTER": "0", "SGLANG_SIM_FAULT_GPUS": "0", "SGLANG_SIM_TIME_SCALE": "10"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=32)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)  # alone: whatever it takes, it fails, and hands back
    fleet.wait_for(lambda: (s := status_of(fleet, 0)) is not None and s.state is WorkerState.FAILED, 120,
                   "gpu0 to be marked failed")
    message = status_of(fleet, 0).message
    assert "server sick" in message and "3 restarts in a row" in message, message
    assert fleet.stats().get("failed", 0) == 0 and fleet.sim_record(0)["sick_answers"] > 0
    fleet.start_worker(1)
    fleet.wait_for(lambda: fleet.finished() == n, 240, "every prompt")
    assert status_of(fleet, 0).state is WorkerState.FAILED
    stats = fleet.stats()
    assert stats.get("failed", 0) == 0 and stats["succeeded"] == n, stats
    assert len(fleet.events("server_sick")) == 3
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    assert all(by_id[r["id"]]["error"] is None for r in rows)
    assert fleet.stop_all() == {0: 0, 1: 0}


@pytest.fixture
def full_disk(tmp_path: Path):
    """A directory on a 256 KiB tmpfs filled to the last byte (a full disk; needs root to mount)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        (mnt / "logs").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 512)
        except OSError:
            pass
        finally:
            os.close(fd)
        yield mnt / "logs"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_under_the_server_logs_fails_no_prompt(tmp_path: Path, fleets, full_disk: Path) -> None:
    """The state dir's disk is full: the server's output is still drained (lines dropped and counted, one
    warning), so the server never blocks on a full pipe, and every prompt succeeds."""
    n = 150
    fleet = fleets(run="disk", prefix="disk.", gpus=1,
                   env={"BATCHFLEET_LOG_DIR": str(full_disk), "SGLANG_SIM_TIME_SCALE": "10"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0, env={"BATCHFLEET_SERVER_ARGS": "--decode-log-interval 1"})  # a log line per decode step
    fleet.wait_for(lambda: fleet.finished() == n, 180, "every prompt")
    stats = fleet.stats()
    assert stats["succeeded"] == n and stats.get("failed", 0) == 0, stats
    assert fleet.stop_all() == {0: 0}
    log = fleet.worker_log(0)
    said = [x for x in log.splitlines() if "cannot write the server's log" in x]
    assert len(said) == 1 and "No space left on device" in said[0], said  # one warning
    dropped = re.search(r"gpu0-server-log: (\d+) line\(s\) of the server's log could not be written", log)
    assert dropped and int(dropped.group(1)) > 100, log[-3000:]  # counted (many decode lines)
    assert "server log copy stopped" not in log
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows)
    assert all(by_id[r["id"]]["error"] is None for r in rows)


def test_a_worker_refuses_a_local_model_path_that_does_not_exist_before_starting_a_server(tmp_path: Path,
                                                                                         fleets) -> None:
    fleet = fleets(run="nomodel", prefix="nomodel.", gpus=1, env={"BATCHFLEET_MODEL_PATH": "/no/such/model"})
    w = fleet.start_worker(0)
    assert w.wait(60) == 2, fleet.worker_log(0)
    log = fleet.worker_log(0)
    assert "the model path '/no/such/model' (BATCHFLEET_MODEL_PATH) does not exist on this host" in log, log
    assert "Traceback" not in log and "started server" not in log
    assert not fleet.record_path(0).exists()  # no server ever started


@pytest.mark.slow
def test_a_server_whose_probe_passes_but_every_request_fails_is_restarted_then_marked_failed(tmp_path: Path,
                                                                                             fleets) -> None:
    """Only `/health_generate` generates (every generation request answers 500): a passing probe closes
    the breaker twice; the third time nothing succeeded since, so the server is sick all the same."""
    n = 120
    fleet = fleets(run="probeok", prefix="probeok.", gpus=2,
                   env={"SGLANG_SIM_ERROR_RATE": "1.0", "SGLANG_SIM_FAULT_GPUS": "0", "SGLANG_SIM_TIME_SCALE": "10"})
    rows = write_prompts(tmp_path / "prompts.jsonl", n, max_tokens=16)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: (s := status_of(fleet, 0)) is not None and s.state is WorkerState.FAILED, 180,
                   "gpu0 to be marked failed")
    message = status_of(fleet, 0).message
    assert "only the probe generates" in message and "3 restarts in a row" in message, message
    assert fleet.stats().get("failed", 0) == 0
    fleet.start_worker(1)
    fleet.wait_for(lambda: fleet.finished() == n, 120, "every prompt")
    stats = fleet.stats()
    assert stats["succeeded"] == n and stats.get("failed", 0) == 0, stats
    by_id = export(fleet, tmp_path)
    assert sorted(by_id) == sorted(r["id"] for r in rows) and all(x["error"] is None for x in by_id.values())
    assert fleet.stop_all() == {0: 0, 1: 0}
