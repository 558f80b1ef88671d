"""`batchfleet run` when GPUs cannot serve (issue 21 §1): GPUs nvidia-smi does not list and a local
model path that does not exist are refused before anything starts (one line, exit 2); with no GPU
that can serve, the run exits 2 within minutes naming each GPU and its reason, and leaves nothing
running; with some that can, it finishes on them and says which failed. Real parts: the command as a
subprocess, its private redis-server, real `rq worker`s, simulated SGLang servers (sglang_sim) and the
simulator's nvidia-smi stand-in."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from .fleet import write_prompts
from .test_fleetrun import BIN, check_export, output, procs, run_env, start  # noqa: F401  (procs: a fixture)


def batchfleet_run(tmp: Path, env: dict[str, str], *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "batchfleet"), "run", "prompts.jsonl", "-o", "results.jsonl", *args], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=timeout_s)


def ours_running(tmp: Path, run: str) -> list[str]:
    """Processes left by this test's run: its workers (`rq worker <run>.gpuN`), servers and redis-server
    (their command lines name the test's directory or the run's queues)."""
    left = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if not zombie and (str(tmp) in cmd or f"{run}.gpu" in cmd):
            left.append(f"{entry.name}: {cmd}")
    return left


def test_gpus_nvidia_smi_does_not_list_are_a_usage_error(tmp_path: Path) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 4)
    env = run_env(tmp_path, SGLANG_SIM_NUM_GPUS="4")
    done = batchfleet_run(tmp_path, env, "--gpus", "2,7")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gpus names GPU(s) 7 that nvidia-smi does not list (it lists 0,1,2,3)" in lines[0], \
        done.stderr
    assert not (tmp_path / ".batchfleet").exists()  # nothing started: no Redis, no store, no log


@pytest.mark.parametrize("path", ["/no/such/model", "./no-such-model", "~/no-such-model"])
def test_a_local_model_path_that_does_not_exist_is_refused_before_any_server_starts(tmp_path: Path, path: str) -> None:
    write_prompts(tmp_path / "prompts.jsonl", 4)
    env = run_env(tmp_path, BATCHFLEET_MODEL_PATH=path)
    done = batchfleet_run(tmp_path, env, "--gpus", "0")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the model path {path!r} (BATCHFLEET_MODEL_PATH) does not exist" in lines[0], \
        done.stderr
    assert ("does not expand ~" in lines[0]) == path.startswith("~")
    assert not list(tmp_path.glob("sim-gpu*.json"))  # no server started


@pytest.mark.slow
def test_with_no_gpu_that_can_serve_the_run_exits_2_naming_each_gpu_and_leaves_nothing_running(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    write_prompts(tmp_path / "prompts.jsonl", 20, max_tokens=16)
    env = run_env(tmp_path, SGLANG_SIM_FAIL_STARTUP="oom")
    t0 = time.monotonic()
    p = start(tmp_path, env, procs, "--run", "nogpu")
    assert p.wait(240) == 2, output(tmp_path, 0)
    took = time.monotonic() - t0
    out = output(tmp_path, 0)
    assert "no GPU can serve; each was marked failed:" in out, out
    for g in (0, 1):
        assert re.search(rf"^  gpu{g}: CUDA out of memory \.\.\. Tried to allocate \d+\.\d\d GiB .*3 starts failed in "
                         r"a row", out, re.MULTILINE), out
    assert "Traceback" not in out
    assert took < 180, f"took {took:.0f} s"
    assert ours_running(tmp_path, "nogpu") == []
    print(f"\nno GPU can serve: exit 2 after {took:.0f} s")


@pytest.mark.slow
def test_with_some_gpus_that_can_serve_the_run_finishes_on_them_and_says_which_failed(
        tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    rows = write_prompts(tmp_path / "prompts.jsonl", 60, max_tokens=16)
    env = run_env(tmp_path, SGLANG_SIM_FAIL_STARTUP="oom", SGLANG_SIM_FAULT_GPUS="1", SGLANG_SIM_TIME_SCALE="40")
    p = start(tmp_path, env, procs, "--run", "somegpu")
    assert p.wait(240) == 0, output(tmp_path, 0)
    out = output(tmp_path, 0)
    assert re.search(r"somegpu\.gpu1: (GPU FAILED \(takes no work\)|server DOWN): CUDA out of memory \.\.\. Tried to "
                     "allocate", out), out
    assert re.search(r"finished without 1 GPU\(s\) whose server could not serve \(their queues were served by the "
                     r"others\): gpu1: CUDA out of memory", out), out
    assert "wrote 60 lines to results.jsonl (60 succeeded, 0 failed)" in out
    check_export(tmp_path, rows)
    assert ours_running(tmp_path, "somegpu") == []
