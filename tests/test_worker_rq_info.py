"""A real `rq worker` with batchfleet's class, as RQ's own tools see it (issue 20 §4): `rq info` shows
its finished and failed counts; its server's port in use is one line and a retry, not a traceback;
the server's pid file goes when the worker stops it cleanly."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import orjson
import pytest

from .fleet import BIN, Fleet, write_prompts

pytestmark = pytest.mark.slow


def rq_info(fleet: Fleet) -> str:
    done = subprocess.run([str(BIN / "rq"), "info", "--url", fleet.redis_url, "--only-workers", fleet.queue(0)],
                          capture_output=True, text=True, timeout=60, env=fleet.env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_rq_info_counts_a_workers_jobs_its_busy_port_is_one_line_and_its_pid_file_goes_on_a_clean_stop(
        tmp_path: Path, fleets) -> None:
    fleet: Fleet = fleets(gpus=1, env={"BATCHFLEET_SERVER_ARGS": "--context-length 256"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 12, max_tokens=24)
    with (tmp_path / "prompts.jsonl").open("ab") as f:  # one prompt the server refuses (HTTP 400): it fails
        f.write(orjson.dumps({"id": "too-long", "prompt": "x", "max_tokens": 1000}) + b"\n")
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues, "--no-progress")
    busy = socket.socket()
    busy.bind(("127.0.0.1", fleet.port_base))  # the port of GPU 0's server is taken by another program
    busy.listen()
    try:
        fleet.start_worker(0)
        fleet.wait_for(lambda: "already in use" in fleet.worker_log(0), 60, "the worker to say its port is in use")
    finally:
        busy.close()
    fleet.wait_for(lambda: fleet.finished() == len(rows) + 1, 120, "every prompt")  # it retried, and served
    said = [line for line in fleet.worker_log(0).splitlines() if "already in use" in line]
    assert said and all(f"port {fleet.port_base} is already in use" in line for line in said)
    assert "Traceback" not in fleet.worker_log(0)
    pid_file = tmp_path / "state" / "logs" / "sglang-gpu0.pid"
    assert orjson.loads(pid_file.read_bytes())["pid"] == fleet.sim_record(0)["pid"]  # while it serves

    # the counts reach RQ's worker hash right after the status record that has them: by the next record
    fleet.wait_for(lambda: [(s.done, s.failed) for s in fleet.statuses()] == [(len(rows), 1)], 30,
                   "a status record with every prompt")
    ts = fleet.statuses()[0].ts
    fleet.wait_for(lambda: fleet.statuses()[0].ts > ts, 30, "the next status beat")
    line = next(x for x in rq_info(fleet).splitlines() if fleet.queue(0) in x and "jobs:" in x)
    assert re.search(rf"jobs: {len(rows)} finished, 1 failed", line), line

    assert fleet.stop_all() == {0: 0}
    assert not pid_file.exists()  # the server was stopped cleanly: its pid names nothing now
