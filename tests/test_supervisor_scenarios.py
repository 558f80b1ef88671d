"""The supervisor against real processes: `rq worker gpuN` with our worker class, simulated SGLang
servers, real Redis, and `supervisor run` as a subprocess. The seed scenario must restart the fleet
onto no_buffer; the control scenarios must not restart anything."""

from __future__ import annotations

import orjson
import pytest

from batchfleet.keys import Keys
from bench.bench_seed import SupervisorProc, exactly_once, run_seed, write_seed_prompts

from .fleet import Fleet

pytestmark = pytest.mark.slow

FAST = ("--window", "2", "--windows", "3", "--sample", "0.5", "--restart-cost", "1", "--verify-windows", "2",
        "--rollout-batch", "1")


def test_seed_scenario_mamba_bound_fleet_moves_to_no_buffer(tmp_path, redis_url):
    # Long generations, as in the seed run: every admission costs a prefill batch, and with short ones
    # that churn eats into the gain of more slots (the simulator's own ceiling is ~x1.9). Three
    # verification windows average out the noise of a shared 2-core box.
    res = run_seed(tmp_path, redis_url, gpus=2, prompts=900, time_scale=5, rollout_batch=1, tokens=(500, 900),
                   verify_windows=3)
    log = res["supervisor_log"]
    assert res["windows_to_decide"] <= 3, log
    assert res["slots_before"] == [37] and res["slots_after"] == [72], log
    assert res["strategies_after"] == ["no_buffer"]
    assert res["ratio"] >= 1.8, log
    assert res["restarts"] == 2 and res["rollbacks"] == 0
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["succeeded"] == 900


def start(tmp_path, redis_url, *, gpus: int, prompts: int, env: dict[str, str], args: tuple[str, ...] = FAST,
          worker_env: dict[int, dict[str, str]] | None = None, **prompt_kw) -> tuple[Fleet, SupervisorProc]:
    fleet = Fleet(tmp_path, redis_url, gpus=gpus, env={"BATCHFLEET_SHUTDOWN_GRACE_S": "1", **env})
    write_seed_prompts(tmp_path / "prompts.jsonl", prompts, **prompt_kw)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", ",".join(f"gpu{g}" for g in range(gpus)))
    for g in range(gpus):
        fleet.start_worker(g, env=(worker_env or {}).get(g))
    return fleet, SupervisorProc(fleet, *args)


def observe_without_restart(fleet: Fleet, sup: SupervisorProc, cls: str, *, windows: int = 6) -> None:
    """The class shows up in the autopilot's state, and `windows` windows later nothing was restarted."""
    def classes() -> dict[str, str]:
        raw = fleet.r.get(fleet.k.autopilot)
        return orjson.loads(raw)["classes"] if raw else {}
    fleet.wait_for(lambda: set(classes().values()) == {cls}, 60,
                   f"every server classified {cls}: {classes()}; supervisor said:\n{sup.output()[-3000:]}")
    seen = len(fleet.r.xrange(fleet.k.history))
    fleet.wait_for(lambda: len(fleet.r.xrange(fleet.k.history)) >= seen + windows * 4, 60, f"{windows} windows")
    assert set(classes().values()) == {cls}, sup.output()
    assert not [e for e in sup.events() if e.kind in ("decision", "canary", "rollback", "restarted")], sup.output()
    assert not fleet.r.hgetall(fleet.k.control)


def test_client_bound_is_reported_as_ours_and_restarts_nothing(tmp_path, redis_url):
    fleet, sup = start(tmp_path, redis_url, gpus=1, prompts=600, env={"BATCHFLEET_MAX_IN_FLIGHT": "4"})
    try:
        observe_without_restart(fleet, sup, "client-bound")
        (diag,) = sup.events("diagnosis")
        assert diag.data["ours"] and "our side is slow" in diag.message
        assert "client-bound" in sup.output()  # the console says it too
    finally:
        sup.stop()
        fleet.stop_all()


def test_saturated_healthy_restarts_nothing(tmp_path, redis_url):
    # A --max-running-requests ceiling below the mamba pool's cap: full, but mamba usage is low.
    fleet, sup = start(tmp_path, redis_url, gpus=1, prompts=600, env={"BATCHFLEET_MAX_RUNNING_REQUESTS": "6"})
    try:
        observe_without_restart(fleet, sup, "saturated-healthy")
    finally:
        sup.stop()
        fleet.stop_all()


def test_kv_bound_restarts_nothing(tmp_path, redis_url):
    # A plain model asked for more requests than its KV pool holds: KV fills up and the server retracts.
    fleet, sup = start(tmp_path, redis_url, gpus=1, prompts=1500, min_tokens=900, max_tokens=1000,
                       env={"SGLANG_SIM_PROFILE": "tiny-plain", "BATCHFLEET_MODEL_PATH": "sim/tiny-plain",
                            "BATCHFLEET_MAX_RUNNING_REQUESTS": "64", "SGLANG_SIM_TIME_SCALE": "5"})
    try:
        observe_without_restart(fleet, sup, "kv-bound")
    finally:
        sup.stop()
        fleet.stop_all()


def test_draining_restarts_nothing_and_loses_nothing(tmp_path, redis_url):
    # The backlog is gone almost at once: a mamba-bound-looking server with no work left waiting.
    # Fewer prompts than slots, so the worker's health probe (a real generation) finds a free slot.
    fleet, sup = start(tmp_path, redis_url, gpus=1, prompts=10, min_tokens=1200, max_tokens=1200,
                       env={"SGLANG_SIM_TIME_SCALE": "2"})
    try:
        observe_without_restart(fleet, sup, "draining", windows=3)
        fleet.wait_for(lambda: fleet.finished() >= 10, 120, "all prompts")
    finally:
        sup.stop()
        fleet.stop_all()
    assert exactly_once(fleet, 10) == (0, 0)


def test_a_canary_that_does_not_gain_is_rolled_back_and_not_tried_again(tmp_path, redis_url):
    # knee-hybrid: no_buffer gives 22 slots instead of 12, but decode slows steeply past 12 running.
    fleet, sup = start(tmp_path, redis_url, gpus=2, prompts=1000,
                       env={"SGLANG_SIM_PROFILE": "knee-hybrid", "BATCHFLEET_MODEL_PATH": "sim/knee-hybrid",
                            "SGLANG_SIM_TIME_SCALE": "5"}, args=(*FAST, "--forbid", "no_radix"))
    try:
        rollback = sup.wait_event("rollback", 90)
        assert "did not gain" in rollback.message and rollback.data["measured_ratio"] < 1
        canary = rollback.data["canary"]
        fleet.wait_for(lambda: any(s.worker == canary and s.state == "serving" and s.generation == 2
                                   for s in fleet.statuses()), 60, "the canary back on its old spec")
        # Stalled again, but the change that failed is not tried twice.
        fleet.wait_for(lambda: any("did not gain" in e.message for e in sup.events("decision")), 60,
                       "the autopilot to say it has nothing left to try")
        assert {(s.strategy, s.effective_max) for s in fleet.statuses()} == {("default", 12)}
        fleet.wait_for(lambda: fleet.finished() >= 1000, 180, "all prompts")
    finally:
        sup.stop()
        fleet.stop_all()
    assert len(sup.events("restarted")) == 2  # the canary out and back; nobody else
    spec = fleet.r.hget(fleet.k.control, Keys.control_worker(canary))
    assert orjson.loads(spec)["strategy"] == "default"
    assert exactly_once(fleet, 1000) == (0, 0)
