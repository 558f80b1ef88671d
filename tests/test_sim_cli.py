"""Simulator command line and start-up: flags of 0.5.23, legacy spellings, validation, calibration."""

from __future__ import annotations

import re

import httpx
import pytest

from sglang_sim.memory import plan_memory
from sglang_sim.profiles import get_profile
from tests.simproc import run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}
SEED = {**FAST, "SGLANG_SIM_PROFILE": "seed-27b-96gb"}
LEGACY = {**FAST, "SGLANG_SIM_VERSION": "0.5.6"}


def test_unknown_flag_exits_2() -> None:
    p = run_sim_cli("--model-path", "m", "--no-such-flag")
    assert p.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in p.stderr


def test_bad_choice_exits_2() -> None:
    p = run_sim_cli("--model-path", "m", "--mamba-radix-cache-strategy", "bogus")
    assert p.returncode == 2
    assert "invalid choice: 'bogus'" in p.stderr


def test_old_spellings_are_fatal_on_0523() -> None:
    p = run_sim_cli("--model-path", "m", "--mamba-scheduler-strategy", "no_buffer")
    assert p.returncode == 2
    p = run_sim_cli("--model-path", "m", "--cuda-graph-max-bs", "8")
    assert p.returncode == 2 and "ambiguous option" in p.stderr


def test_help_lists_flags() -> None:
    p = run_sim_cli("--help")
    assert p.returncode == 0
    assert "--mamba-radix-cache-strategy {auto,no_buffer,extra_buffer,extra_buffer_lazy}" in p.stdout
    assert "--mamba-scheduler-strategy" not in p.stdout
    assert p.stdout.startswith("usage: sglang serve")


def test_legacy_help_and_spelling() -> None:
    p = run_sim_cli("--help", env=LEGACY)
    assert "--mamba-scheduler-strategy {auto,no_buffer,extra_buffer}" in p.stdout
    assert "--mamba-radix-cache-strategy" not in p.stdout
    assert "--cuda-graph-max-bs CUDA_GRAPH_MAX_BS" in p.stdout
    p = run_sim_cli("--model-path", "m", "--mamba-radix-cache-strategy", "no_buffer", env=LEGACY)
    assert p.returncode == 2


def test_legacy_server_endpoints_and_no_effective_key() -> None:
    # Legacy: no_buffer is allowed without --disable-overlap-schedule.
    with start_sim("--mamba-scheduler-strategy", "no_buffer", env=LEGACY) as sim:
        assert httpx.get(sim.url + "/server_info").status_code == 404
        assert httpx.get(sim.url + "/model_info").status_code == 404
        info = httpx.get(sim.url + "/get_server_info").json()
        assert httpx.get(sim.url + "/get_model_info").status_code == 200
        assert info["version"] == "0.5.6"
        assert info["mamba_scheduler_strategy"] == "no_buffer"
        assert "effective_max_running_requests_per_dp" not in info["internal_states"][0]
        m = re.search(r"max_running_requests=(\d+), context_len", sim.logs())
        assert m and int(m.group(1)) == 20  # tiny-hybrid pool 61 // 3


def test_no_buffer_requires_disable_overlap() -> None:
    p = run_sim_cli("--model-path", "m", "--mamba-radix-cache-strategy", "no_buffer", env=FAST)
    assert p.returncode != 0
    assert "no_buffer do not support overlap schedule" in p.stderr


@pytest.mark.parametrize(
    ("flags", "ratio", "pool", "effective"),
    [
        ({}, 5, (185, 189), 37),
        ({"mem_fraction_static": 0.90, "max_running_requests": 128}, 3, (216, 219), 72),
    ],
)
def test_seed_formula(flags: dict, ratio: int, pool: tuple[int, int], effective: int) -> None:
    plan = plan_memory(get_profile("seed-27b-96gb"), flags, ratio=ratio)
    assert pool[0] <= plan.mamba_pool <= pool[1]
    assert plan.effective_max_running == effective


def _started(flags: list[str], env: dict) -> tuple[int, str, dict]:
    with start_sim(*flags, env=env) as sim:
        info = httpx.get(sim.url + "/server_info").json()
        logs = sim.logs()
    m = re.search(r"max_running_requests=(\d+), context_len=\d+, available_gpu_mem=\d+\.\d\d GB", logs)
    assert m, logs
    assert int(m.group(1)) == info["internal_states"][0]["effective_max_running_requests_per_dp"]
    return int(m.group(1)), logs, info


def test_seed_calibration_table() -> None:
    default, logs, info = _started([], SEED)
    assert default == 37
    assert re.search(r"\] max_running_requests is capped to 37 by the mamba state cache "
                     r"\(max_mamba_cache_size=18\d, 5 state slots per request\)\.", logs)
    assert re.search(r"Mamba Cache is allocated\. max_mamba_cache_size: 18\d, conv_state size: \d+\.\d\dGB, "
                     r"ssm_state size: \d+\.\d\dGB", logs)
    assert "The server is fired up and ready to roll!" in logs
    assert info["max_running_requests"] is None
    assert info["mamba_radix_cache_strategy"] == "extra_buffer"
    nb, _, info = _started(["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
                            "--mem-fraction-static", "0.90", "--max-running-requests", "128"], SEED)
    assert nb == 72
    assert info["max_running_requests"] == 128  # the REQUESTED value, not the effective one
    assert 216 <= info["internal_states"][0]["max_mamba_cache_size"] <= 219
    radix_off, _, _ = _started(["--disable-radix-cache"], SEED)
    assert radix_off > 72


def test_oom_at_too_high_mem_fraction() -> None:
    p = run_sim_cli("--model-path", "m", "--mem-fraction-static", "0.98", env=SEED)
    assert p.returncode != 0
    assert "torch.OutOfMemoryError: CUDA out of memory." in p.stderr


def test_dp_ranks_in_internal_states() -> None:
    with start_sim("--dp-size", "2", env=FAST) as sim:
        info = httpx.get(sim.url + "/server_info").json()
        assert len(info["internal_states"]) == 2
        assert sum(s["effective_max_running_requests_per_dp"] for s in info["internal_states"]) == 24
