"""How a simulated server fails to start, as SGLang 0.5.23 does: CUDA out of memory, its port already in
use, a model path that is neither a directory nor a hub id; what it prints and its exit status."""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

import httpx
import pytest

from tests.simproc import SimProc, gpu_memory_used, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}
SIGQUIT_LINE = "] Received sigquit from a child process. It usually means the child failed."


def _last_line(stderr: str) -> str:
    return stderr.rstrip("\n").splitlines()[-1]


@pytest.mark.parametrize(("flags", "env", "first"), [
    ((), {"SGLANG_SIM_FAIL_STARTUP": "oom"}, "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB of "
                                             "which 1.12 GiB is free."),
    (("--mem-fraction-static", "0.98"), {"SGLANG_SIM_PROFILE": "seed-27b-96gb"}, "Tried to allocate "),
])
def test_cuda_out_of_memory_at_startup_prints_torchs_message_and_the_server_kills_itself(
        flags: tuple[str, ...], env: dict[str, str], first: str) -> None:
    p = run_sim_cli("--model-path", "sim/m", *flags, env={**FAST, **env})
    assert p.returncode == -signal.SIGKILL
    assert f"torch.OutOfMemoryError: CUDA out of memory. {first}" in p.stderr
    assert re.search(r"^\[[\d: -]+\] Scheduler hit an exception: Traceback \(most recent call last\):$", p.stderr,
                     re.MULTILINE)
    assert re.search(r"^torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate \d+\.\d\d [GM]iB\. GPU 0 has a "
                     r"total capacity of \d+\.\d\d GiB of which \d+\.\d\d [GM]iB is free\. Including non-PyTorch "
                     r"memory, this process has \d+\.\d\d GiB memory in use\. .* If reserved but unallocated memory "
                     r"is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
                     r"fragmentation\.", p.stderr, re.MULTILINE)
    assert SIGQUIT_LINE in p.stderr
    assert "fired up" not in p.stderr


def test_a_port_held_by_another_server_fails_startup_after_sglangs_warmup_reached_the_holder() -> None:
    with start_sim(env=FAST) as holder:
        late = SimProc(env={**FAST, "CUDA_VISIBLE_DEVICES": "1"}, port=holder.port).start(wait=False)
        try:
            code = late.wait_exit(30)
        finally:
            late.stop()
        logs = late.logs()
        seen = holder.observed()
    assert code == 1  # uvicorn's sys.exit(1), once the lifespan (and its warm-up thread) has ended
    assert re.search(rf"^\[[\d: -]+\] ERROR:    \[Errno 98\] error while attempting to bind on address "
                     rf"\('127\.0\.0\.1', {holder.port}\): address already in use$", logs, re.MULTILINE), logs
    # SGLang's warm-up polls the port it asked for, so it warmed up the server that holds it, and said so
    assert seen["requests_by_endpoint"].get("/generate") == 1
    assert logs.index("address already in use") < logs.index("The server is fired up and ready to roll!")
    assert "Uvicorn running on" not in logs
    assert gpu_memory_used(late.env)[1] == 0


def test_a_port_held_by_a_socket_that_does_not_answer_makes_the_server_give_up_and_kill_itself() -> None:
    with socket.socket() as taken:  # bound, not listening: the bind fails and connections are refused
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        late = SimProc(env={**FAST, "SGLANG_SIM_WARMUP_TRIES": "2"}, port=port).start(wait=False)
        try:
            code = late.wait_exit(30)
        finally:
            late.stop()
    logs = late.logs()
    assert code == -signal.SIGKILL
    assert f"error while attempting to bind on address ('127.0.0.1', {port}): address already in use" in logs
    assert re.search(r"^\[[\d: -]+\] Initialization failed\. warmup error: Traceback", logs, re.MULTILINE)
    assert "requests.exceptions.ConnectionError" in logs and "fired up" not in logs


BAD_PATHS = [
    ("/no/such/model", "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                       "'/no/such/model'. Use `repo_type` argument if needed."),
    ("/models", "OSError: Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with "
                "'-' or '.' and the maximum length is 96: '/models'."),
    ("./no-such-model", "OSError: Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or "
                        "end with '-' or '.' and the maximum length is 96: './no-such-model'."),
    ("~/models/m", "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': '~/models/m'. Use "
                   "`repo_type` argument if needed."),
    ("../m", "OSError: Repo id must use alphanumeric chars, '-', '_' or '.'. The name cannot start or end with "
             "'-' or '.' and the maximum length is 96: '../m'."),
]


def test_a_model_path_that_looks_local_and_does_not_exist_fails_as_transformers_does(tmp_path: Path) -> None:
    for path, error in BAD_PATHS:
        p = run_sim_cli("--model-path", path, env=FAST)
        assert p.returncode == 1, path
        assert p.stderr.startswith("Traceback (most recent call last):\n")
        assert _last_line(p.stderr) == error
        assert "server_args=" not in p.stderr  # it died resolving its arguments, before any scheduler
    # a directory that exists is loaded; a name that can be a hub id is taken for one (as tests use them)
    with start_sim("--model-path", str(tmp_path), env=FAST) as sim:
        assert httpx.get(sim.url + "/model_info").json()["model_path"] == str(tmp_path)
    with start_sim("--model-path", "sim/tiny-hybrid", env=FAST) as sim:
        assert httpx.post(sim.url + "/generate", json={"text": "hi"}, timeout=10).status_code == 200


@pytest.mark.parametrize(("flags", "error"), [
    (("--dp-size", "2", "--attn-dp-size", "2", "--tp-size", "2"),
     "ValueError: --dp-size 2 with --attn-dp-size 2: data-parallel replicas combined with attention data "
     "parallelism are not supported."),
    (("--dp-size", "2", "--enable-dp-attention"), "AssertionError"),
    (("--mamba-radix-cache-strategy", "no_buffer"),
     "AssertionError: no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True."),
])
def test_a_flag_combination_sglang_refuses_ends_in_a_traceback_and_exit_1(flags: tuple[str, ...],
                                                                           error: str) -> None:
    p = run_sim_cli("--model-path", "sim/m", *flags, env=FAST)
    assert p.returncode == 1
    assert p.stderr.startswith("Traceback (most recent call last):\n") and _last_line(p.stderr) == error
