"""The seed profile under load: gauges at 32 running, decode log lines and throughput in model time."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from tests.simproc import start_sim

SEED = {"SGLANG_SIM_PROFILE": "seed-27b-96gb", "SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "10"}


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"sglang:(\w+)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_gauges_at_32_running() -> None:
    with start_sim("--enable-metrics", "--decode-log-interval", "40", env=SEED) as sim:
        prompt = " ".join(["word"] * 1200)

        async def scenario() -> dict[str, float]:
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(c.post(sim.url + "/generate", json={
                    "text": f"{i} {prompt}", "rid": f"seed-{i}",
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})) for i in range(32)]
                g: dict[str, float] = {}
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    g = _gauges((await c.get(sim.url + "/metrics")).text)
                    # wait for two full decode windows at 32 so gen_throughput is steady-state
                    if g["num_running_reqs"] == 32 and sim.logs().count("Decode batch, #running-req: 32") >= 2:
                        break
                await c.post(sim.url + "/abort_request", json={"abort_all": True})
                await asyncio.gather(*tasks)
                return g

        g = asyncio.run(scenario())
        assert g["num_running_reqs"] == 32 and g["num_queue_reqs"] == 0
        assert 0.17 <= g["full_token_usage"] <= 0.26, g
        assert 0.57 <= g["mamba_usage"] <= 0.63, g
        assert g["token_usage"] == max(g["full_token_usage"], g["mamba_usage"])
        assert 440 <= g["gen_throughput"] <= 500, g
        lines = re.findall(r"Decode batch, #running-req: 32, #full token: \d+, full token usage: 0\.\d\d, "
                         r"mamba num: 112, mamba usage: 0\.60, cuda graph: True, "
                         r"gen throughput \(token/s\): (\d+\.\d\d), #queue-req: 0", sim.logs())
        assert lines, sim.logs()[-2000:]
        # the first window at 32 still contains prefill time; later ones are pure decode
        assert 480 <= float(lines[-1]) <= 495
