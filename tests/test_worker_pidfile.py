"""The server's pid record (worker/server.py): written so that the worker's next start can tell its own
leftover server from a stranger that reuses the pid."""

from __future__ import annotations

import subprocess
import sys

import orjson

from worker import server


def test_a_pid_record_written_while_the_process_is_still_inside_exec_waits_for_its_command_line(
        tmp_path, monkeypatch) -> None:
    """Right after a launch /proc/<pid>/cmdline can read empty (the process is inside exec; about once in
    30 launches here). A record taken then would never match the server again: the next worker would
    leave it holding the port as 'pid reused'. The record is taken again until the command line shows."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        real = server.process_identity
        calls = 0

        def inside_exec_at_first(pid: int):
            nonlocal calls
            calls += 1
            identity = real(pid)
            return {**identity, "cmdline": []} if calls <= 2 and identity else identity

        monkeypatch.setattr(server, "process_identity", inside_exec_at_first)
        path = tmp_path / "sglang-gpu0.pid"
        server.write_pid_record(path, proc.pid)
        record = orjson.loads(path.read_bytes())
        assert record["cmdline"] and record["cmdline"][0] == sys.executable
        assert calls == 3
        monkeypatch.setattr(server, "process_identity", real)
        assert server.leftover_server(path) == proc.pid  # recognised as the very process recorded
    finally:
        proc.kill()
        proc.wait()
