"""Simulator faults (crash, hang, start-up OOM, error rate, per-GPU) and simulated GPU memory accounting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from tests.simproc import SimProc, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


async def _send(url: str, n: int, params: dict, timeout: float = 30) -> list[object]:
    async with httpx.AsyncClient(timeout=timeout) as c:
        return await asyncio.gather(*[c.post(url + "/generate", json={"text": f"r {i}", "sampling_params": params})
                                      for i in range(n)], return_exceptions=True)


def test_crash_after_n_admitted() -> None:
    sim = start_sim(env={**FAST, "SGLANG_SIM_CRASH_AFTER": "3", "SGLANG_SIM_TIME_SCALE": "1"})
    try:
        results = asyncio.run(_send(sim.url, 5, LONG))
        assert all(isinstance(r, httpx.HTTPError) for r in results), results
        assert sim.proc.wait(timeout=5) != 0
        assert "CUDA error" in sim.logs()
    finally:
        sim.stop()


def test_crash_marker_kills_the_server_only_for_the_prompt_that_holds_it() -> None:
    sim = start_sim(env={**FAST, "SGLANG_SIM_CRASH_MARKER": "POISON-42"})
    try:
        ok = httpx.post(sim.url + "/v1/completions", json={"prompt": "harmless words", "max_tokens": 4}, timeout=10)
        assert ok.status_code == 200 and sim.proc.poll() is None
        with pytest.raises(httpx.HTTPError):
            httpx.post(sim.url + "/v1/chat/completions", timeout=10,
                       json={"messages": [{"role": "user", "content": "a POISON-42 b"}], "max_tokens": 4})
        assert sim.proc.wait(timeout=5) != 0
        assert "CUDA error: an illegal memory access was encountered" in sim.logs()
    finally:
        sim.stop()


def test_hang_keeps_port_but_fails_health_generate() -> None:
    # hangs at its first admission: on a loaded machine a second request may arrive only after the first is done
    with start_sim(env={**FAST, "SGLANG_SIM_HANG_AFTER": "1"}) as sim:
        results = asyncio.run(_send(sim.url, 2, {"max_new_tokens": 50}, timeout=1.5))
        assert all(isinstance(r, httpx.ReadTimeout) for r in results), results
        assert httpx.get(sim.url + "/health").status_code == 200
        t0 = time.monotonic()
        assert httpx.get(sim.url + "/health_generate", timeout=10).status_code == 503
        assert time.monotonic() - t0 < 3  # 20 s / time scale, at least 1 s


def test_a_full_busy_server_is_healthy() -> None:
    """As in SGLang: /health_generate answers 200 once the scheduler produced anything after the check
    began, even when the probe itself waits behind a full batch of long generations (it is not hung)."""
    with start_sim("--max-running-requests", "4",
                   env={"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "2"}) as sim:

        async def go() -> tuple[int, float]:
            async with httpx.AsyncClient(timeout=120) as c:
                load = [asyncio.ensure_future(c.post(sim.url + "/generate", json={
                    "text": f"long {i}", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}))
                    for i in range(8)]
                await asyncio.sleep(1.0)  # every slot busy, 4 more waiting
                t0 = time.monotonic()
                code = (await c.get(sim.url + "/health_generate")).status_code
                took = time.monotonic() - t0
                for t in load:
                    t.cancel()
                return code, took

        code, took = asyncio.run(go())
        assert code == 200 and took < 5  # answered by progress, not after the 10 s (20 s / 2) timeout


def test_fail_startup_oom() -> None:
    p = run_sim_cli("--model-path", "m", env={**FAST, "SGLANG_SIM_FAIL_STARTUP": "oom"})
    assert p.returncode != 0
    assert "torch.OutOfMemoryError: CUDA out of memory." in p.stderr


def _statuses(sim: SimProc, n: int) -> list[int]:
    return [httpx.post(sim.url + "/generate", json={"text": f"e {i}", "sampling_params": {"max_new_tokens": 2}})
            .status_code for i in range(n)]


def test_error_rate_is_seeded() -> None:
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "0.3"}
    with start_sim(env=env) as a:
        first = _statuses(a, 30)
    with start_sim(env=env) as b:
        second = _statuses(b, 30)
    assert first == second
    assert set(first) == {200, 500}
    assert 3 <= first.count(500) <= 18


def test_error_marker_fails_its_prompt_every_time_and_only_it() -> None:
    with start_sim(env={**FAST, "SGLANG_SIM_ERROR_MARKER": "BAD-7"}) as sim:
        for _ in range(3):
            bad = httpx.post(sim.url + "/v1/completions", json={"prompt": "x BAD-7 y", "max_tokens": 4}, timeout=10)
            assert bad.status_code == 500
        chat = httpx.post(sim.url + "/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "a BAD-7"}], "max_tokens": 4})
        assert chat.status_code == 500
        ok = httpx.post(sim.url + "/v1/completions", json={"prompt": "harmless", "max_tokens": 4}, timeout=10)
        assert ok.status_code == 200 and sim.proc.poll() is None
        assert sim.observed()["error_marker_hits"] == 4  # live, not the record file (rewritten every 0.5 s)


def test_fault_gpus_limits_faults() -> None:
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "1.0", "SGLANG_SIM_FAULT_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "2"}
    with start_sim(env=env) as sim:
        assert set(_statuses(sim, 5)) == {200}
    with start_sim(env={**env, "CUDA_VISIBLE_DEVICES": "3"}) as sim:
        assert set(_statuses(sim, 5)) == {500}


def _smi(env: dict[str, str]) -> dict[int, tuple[int, int]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], env=env, capture_output=True, text=True, check=True)
    rows = [tuple(int(x) for x in line.split(", ")) for line in out.stdout.splitlines()]
    return {i: (used, total) for i, used, total in rows}


def test_gpu_memory_freed_after_exit_and_sigkill() -> None:
    sim = start_sim(env={**FAST, "CUDA_VISIBLE_DEVICES": "3"})
    rows = _smi(sim.env)
    assert len(rows) == 8
    assert rows[3][0] > 1000 and rows[0][0] == 0
    sim.stop()
    assert _smi(sim.env)[3][0] == 0
    again = SimProc(env={**FAST, "CUDA_VISIBLE_DEVICES": "3", "SGLANG_SIM_GPU_DIR": sim.env["SGLANG_SIM_GPU_DIR"]})
    again.start()
    try:
        assert _smi(again.env)[3][0] > 1000
        again.kill()  # SIGKILL: the file stays behind with a dead (zombie, not yet reaped) pid
        deadline = time.monotonic() + 10
        while _smi(again.env)[3][0] != 0:
            assert time.monotonic() < deadline, "a killed server's GPU memory still reads as used"
            time.sleep(0.1)
    finally:
        again.stop()
    py = subprocess.run([sys.executable, "-m", "sglang_sim.gpus", "--query-gpu=index,memory.used,memory.total",
                         "--format=csv,noheader,nounits"], env=again.env, capture_output=True, text=True, check=True)
    assert py.stdout.splitlines()[3] == "3, 0, 8192"


def test_a_sick_server_stays_up_but_answers_500_to_every_generation_and_to_health_generate() -> None:
    with start_sim(env={**FAST, "SGLANG_SIM_SICK_AFTER": "3"}) as sim:
        healthy = [
            httpx.post(sim.url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}, timeout=10),
            httpx.post(sim.url + "/v1/completions", json={"prompt": "b", "max_tokens": 2}, timeout=10),
            httpx.post(sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "c"}],
                                                                "max_tokens": 2}, timeout=10),
        ]
        assert [r.status_code for r in healthy] == [200, 200, 200]
        assert httpx.get(sim.url + "/health_generate", timeout=10).status_code == 200  # probes do not count
        native = httpx.post(sim.url + "/generate", json={"text": "d"}, timeout=10)
        chat = httpx.post(sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "e"}]},
                          timeout=10)
        health = httpx.get(sim.url + "/health_generate", timeout=10)
        # SGLang's shape for a scheduler abort with a 5xx status (an HTTPException), on both kinds of route
        for r in (native, chat):
            body = r.json()
            assert r.status_code == 500 and body["object"] == "error" and body["code"] == 500, r.text
            assert body["type"] == "500" and body["message"]
        assert (health.status_code, health.text) == (500, "Internal Server Error")
        assert httpx.get(sim.url + "/health", timeout=10).status_code == 200
        assert sim.proc.poll() is None
        seen = sim.observed()
        assert seen["sick"] is True and seen["sick_answers"] == 3


def test_faults_once_lets_the_restarted_server_serve(tmp_path) -> None:
    env = {**FAST, "SGLANG_SIM_SICK_AFTER": "1", "SGLANG_SIM_FAULTS_ONCE": str(tmp_path / "spent")}
    statuses = []
    for _ in range(2):
        with start_sim(env=env) as sim:
            statuses.append([httpx.post(sim.url + "/generate", json={"text": f"p {i}"}, timeout=10).status_code
                             for i in range(3)])
    assert statuses == [[200, 500, 500], [200, 200, 200]]
    oom = {**FAST, "SGLANG_SIM_FAIL_STARTUP": "oom", "SGLANG_SIM_FAULTS_ONCE": str(tmp_path / "oom-spent")}
    assert run_sim_cli("--model-path", "m", env=oom).returncode == -9
    with start_sim(env=oom) as sim:
        assert httpx.post(sim.url + "/generate", json={"text": "x"}, timeout=10).status_code == 200
