"""The worker reads its server's start-up facts (cap, cause, pools, memory) from `/server_info` and
the start-up log, as a real SGLang gives them; here the simulator prints them in SGLang's words."""

from __future__ import annotations

import httpx
import pytest

from batchfleet import sglang
from worker.facts import read_facts

from .simproc import start_sim

NB = ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule", "--mem-fraction-static", "0.9",
      "--max-running-requests", "128")


def facts_of(*flags: str, profile: str, version: str = "0.5.23"):
    with start_sim(*flags, env={"SGLANG_SIM_PROFILE": profile, "SGLANG_SIM_VERSION": version}) as sim:
        path = "/server_info" if version == "0.5.23" else "/get_server_info"
        info = httpx.get(sim.url + path, timeout=10).json()
        capacity = sglang.effective_capacity(info) or sglang.capacity_from_log(sim.logs())
        return read_facts(info, sim.logs(), effective=capacity), sim.observed()


@pytest.mark.parametrize(("flags", "profile", "cause", "cap", "pool", "per_request"), [
    ((), "seed-27b-96gb", "mamba", 37, 187, 5),  # the seed: capped by the pool at 37
    (NB, "seed-27b-96gb", "mamba", 72, 218, 3),
    (("--max-running-requests", "6"), "tiny-hybrid", "requested", 6, 61, 5),
    (("--disable-radix-cache", "--max-running-requests", "40"), "tiny-hybrid", "requested", 40, 40, 1),
    (("--max-running-requests", "64"), "tiny-plain", "requested", 64, None, None),
])
def test_facts_say_what_caps_the_server(flags, profile, cause, cap, pool, per_request):
    facts, observed = facts_of(*flags, profile=profile)
    assert facts.effective_max_running == cap == observed["effective_max_running_requests"]
    assert (facts.cap_cause, facts.mamba_pool, facts.slots_per_request) == (cause, pool, per_request)
    assert facts.max_total_num_tokens and facts.kv_gb and facts.memory_before_load_gb
    assert (facts.mamba_gb is not None) == (pool is not None)


def test_facts_from_an_older_release_come_from_the_log():
    # 0.5.6: no effective_... key, only /get_server_info; the log lines still say it all.
    facts, _ = facts_of(profile="seed-27b-96gb", version="0.5.6")
    assert (facts.effective_max_running, facts.cap_cause, facts.mamba_pool, facts.slots_per_request) == \
        (37, "mamba", 187, 5)


def test_facts_never_guess():
    facts = read_facts({}, "", effective=12)
    assert facts.cap_cause == "" and facts.mamba_pool is None and facts.kv_gb is None
