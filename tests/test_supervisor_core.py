"""The supervisor's pure core on hand-built snapshots: classification, the ladder, the autopilot."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchfleet.records import ServerMetrics, ServerSpec, WorkerStatus
from supervisor.autopilot import Autopilot, Control, Emit, SetFleet, SetOverride, Settings, State
from supervisor.classify import classify_window
from supervisor.fleet import FleetSnapshot
from supervisor.ladder import LadderConfig, current_spec, next_rung, spec_key


def ws(gpu: int, *, in_flight: int = 37, cap: int = 37, running: float | None = None, kv: float = 0.05,
       mamba: float = 0.69, tps: float = 560.0, done: int = 100, tokens: float = 1e6, retracted: float = 0,
       state: str = "serving", generation: int = 0, strategy: str = "default", hit: float = 0.0,
       flags: list[str] | None = None, queued: float = 0) -> WorkerStatus:
    return WorkerStatus(
        worker=f"w{gpu}", host="h", queue=f"gpu{gpu}", gpu=gpu, state=state, strategy=strategy, generation=generation,
        effective_max=cap, in_flight=in_flight, done=done, tokens_per_s=tps * 5, server_flags=flags or [],
        metrics=ServerMetrics(running=in_flight if running is None else running, queued=queued, full_kv_usage=kv,
                              mamba_usage=mamba, cache_hit_rate=hit, gen_throughput=tps, retracted=retracted,
                              generation_tokens_total=tokens))


def snap(workers: list[WorkerStatus], *, backlog: int = 10_000, ts: float = 0.0) -> FleetSnapshot:
    return FleetSnapshot(ts=ts, workers=workers, backlog={"gpu0": backlog},
                         stats={"succeeded": 1000, "completion_tokens": 300_000})


def window(make, n: int = 3, **kw) -> list[FleetSnapshot]:
    """n samples one second apart; `make(i)` gives the workers of sample i (progress grows with i)."""
    return [snap(make(i), ts=float(i), **kw) for i in range(n)]


def classes(snaps: list[FleetSnapshot]) -> dict[str, str]:
    return {v.worker: v.cls for v in classify_window(snaps).servers}


# --- classification -----------------------------------------------------------------------------
def test_seed_fleet_is_mamba_bound():
    rep = classify_window(window(lambda i: [ws(g, done=100 + i, tokens=1e6 + i * 500) for g in range(4)]))
    assert {v.cls for v in rep.servers} == {"mamba-bound"}
    assert rep.majority("mamba-bound")
    assert "mamba usage 69%" in rep.servers[0].reasons[0]
    assert rep.fleet_tokens_per_s == pytest.approx(4 * 560)


@pytest.mark.parametrize(("kw", "backlog", "expected"), [
    ({"in_flight": 8}, 10_000, "client-bound"),  # BATCHFLEET_MAX_IN_FLIGHT=8 under a 37-slot server
    ({"kv": 0.95}, 10_000, "kv-bound"),
    ({"mamba": 0.2, "kv": 0.3}, 10_000, "saturated-healthy"),  # e.g. --max-running-requests binds
    ({}, 0, "draining"),
    ({"state": "down"}, 10_000, "down"),
    ({"state": "restarting"}, 10_000, "restarting"),
])
def test_control_classes(kw, backlog, expected):
    snaps = window(lambda i: [ws(0, done=100 + i, tokens=1e6 + i, **kw)], backlog=backlog)
    assert classes(snaps) == {"w0": expected}


def test_retractions_mean_kv_bound_and_no_progress_means_hung():
    assert classes(window(lambda i: [ws(0, done=100 + i, retracted=i)])) == {"w0": "kv-bound"}
    assert classes(window(lambda i: [ws(0)])) == {"w0": "hung"}  # done and tokens frozen while in flight


def test_below_cap_with_a_queue_inside_the_server_is_the_servers_kv_not_our_side():
    # tiny-plain asked for 64: the KV budget admits 48 and 16 of ours wait inside the server.
    (v,) = classify_window(window(lambda i: [ws(0, cap=64, in_flight=64, running=48, queued=16, kv=0.8,
                                                done=100 + i)])).servers
    assert v.cls == "kv-bound" and "waiting in the server" in v.reasons[0]


def test_client_bound_blames_our_side():
    (v,) = classify_window(window(lambda i: [ws(0, in_flight=8, done=100 + i)])).servers
    assert "our side" in v.reasons[0] and "BATCHFLEET_MAX_IN_FLIGHT" in v.reasons[1]


def test_a_gpu_far_from_its_peers_is_flagged():
    rep = classify_window(window(lambda i: [ws(g, cap=20 if g == 3 else 37, in_flight=20 if g == 3 else 37,
                                               done=100 + i) for g in range(4)]))
    flagged = {v.worker: v.outliers for v in rep.servers if v.outliers}
    assert list(flagged) == ["w3"] and "capacity 20 vs peers' median 37" in flagged["w3"][0]


# --- ladder -------------------------------------------------------------------------------------------
def test_ladder_climbs_from_default_to_no_buffer_with_more_memory():
    p = next_rung(ServerSpec(), LadderConfig())
    assert p.target == ServerSpec(strategy="no_buffer", mem_fraction_static=0.90, max_running_requests=128)
    assert p.ratio == pytest.approx(5 / 3)


def test_ladder_no_radix_only_when_the_cache_buys_little_and_it_is_allowed():
    nb = ServerSpec(strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128)
    assert next_rung(nb, LadderConfig(), cache_hit_rate=0.4).target is None
    assert next_rung(nb, LadderConfig(), cache_hit_rate=None).target is None
    low = next_rung(nb, LadderConfig(), cache_hit_rate=0.01)
    assert low.target.strategy == "no_radix" and low.ratio == 3
    forbidden = next_rung(nb, LadderConfig(forbid=frozenset({"no_radix"})), cache_hit_rate=0.01)
    assert forbidden.target is None and "forbidden" in forbidden.reasons[0]


def test_ladder_skips_a_change_that_failed_and_a_forbidden_rung():
    failed = spec_key(ServerSpec(strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128))
    p = next_rung(ServerSpec(), LadderConfig(), failed=[failed], cache_hit_rate=0.0)
    assert p.target.strategy == "no_radix"
    assert next_rung(ServerSpec(), LadderConfig(forbid=frozenset({"no_buffer", "no_radix"}))).target is None
    with pytest.raises(ValueError, match="choose from"):
        LadderConfig(forbid=frozenset({"nobuffer"}))


def test_current_spec_is_read_back_from_the_workers_flags():
    w = ws(0, flags=["--mem-fraction-static", "0.85", "--max-running-requests", "64"])
    assert current_spec(None, [w]) == ServerSpec(strategy="default", mem_fraction_static=0.85, max_running_requests=64)
    fleet = ServerSpec(generation=4, strategy="no_buffer")
    assert current_spec(fleet, [w]) is fleet


# --- autopilot ------------------------------------------------------------------------------------------
def control(**kw) -> Control:
    return Control(fleet=None, overrides={}, current=ServerSpec(), **kw)


def stalled(i: int = 0, n: int = 4, **kw) -> list[FleetSnapshot]:
    return window(lambda j: [ws(g, done=100 + i * 10 + j, tokens=1e6 + i * 10 + j, **kw) for g in range(n)])


def drive(pilot: Autopilot, reports, ctl: Control | None = None, t0: float = 100.0) -> list:
    out = []
    for i, snaps in enumerate(reports):
        out += pilot.step(classify_window(snaps), ctl or control(), t0 + 10 * i)
    return out


def kinds(actions) -> list[str]:
    return [a.event.kind for a in actions if isinstance(a, Emit)]


def test_three_stalled_windows_start_a_canary_on_the_first_gpu():
    pilot = Autopilot(Settings(windows=3, restart_cost_s=1), LadderConfig())
    assert not [a for a in drive(pilot, [stalled(0), stalled(1)]) if not isinstance(a, Emit)]
    acts = drive(pilot, [stalled(2)], t0=120)
    (override,) = [a for a in acts if isinstance(a, SetOverride)]
    assert override.worker == "w0" and override.spec.strategy == "no_buffer" and override.spec.generation == 1
    (decision,) = [a.event for a in acts if isinstance(a, Emit) and a.event.kind == "decision"]
    assert decision.data["windows"] == 3 and decision.data["predicted_ratio"] == pytest.approx(5 / 3)
    assert decision.data["seen"]["classes"] == {"mamba-bound": ["w0", "w1", "w2", "w3"]}
    assert pilot.state.phase == "canary"


def test_dry_run_advises_once_and_acts_never():
    pilot = Autopilot(Settings(windows=2, dry_run=True, restart_cost_s=1), LadderConfig())
    acts = drive(pilot, [stalled(i) for i in range(5)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert kinds(acts).count("advice") == 1


def test_not_worth_it_when_little_work_is_left():
    pilot = Autopilot(Settings(windows=2, restart_cost_s=10_000), LadderConfig())
    acts = drive(pilot, [stalled(i) for i in range(4)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert any("not worth a restart" in a.event.message for a in acts if isinstance(a, Emit))


@pytest.mark.parametrize("cls_kw", [{"in_flight": 8}, {"kv": 0.95}, {"mamba": 0.2}])
def test_no_restart_unless_mamba_bound(cls_kw):
    pilot = Autopilot(Settings(windows=2, restart_cost_s=1), LadderConfig())
    acts = drive(pilot, [stalled(i, **cls_kw) for i in range(6)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    if "in_flight" in cls_kw:  # client-bound is said once per server, and it is ours
        diags = [a.event for a in acts if isinstance(a, Emit) and a.event.kind == "diagnosis"]
        assert len(diags) == 4 and all(e.data["ours"] for e in diags)


def canary_phase(canary_tps: float, canary_cap: int = 72) -> tuple[Autopilot, list]:
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1, verify_windows=2, rollout_batch=2), LadderConfig())
    drive(pilot, [stalled(0)])
    assert pilot.state.phase == "canary"

    def moved(i: int) -> list[FleetSnapshot]:
        return window(lambda j: [ws(0, generation=1, strategy="no_buffer", cap=canary_cap, in_flight=canary_cap,
                                    tps=canary_tps, done=200 + i * 10 + j)]
                      + [ws(g, done=100 + i * 10 + j) for g in (1, 2, 3)])
    return pilot, drive(pilot, [moved(i) for i in range(3)], ctl=control(seen_generation=1), t0=200)


def test_a_canary_that_gains_is_rolled_out_a_few_at_a_time_then_becomes_the_fleet_spec():
    pilot, acts = canary_phase(1065.0)
    assert "canary" in kinds(acts) and pilot.state.phase == "rolling_out"
    assert [a.worker for a in acts if isinstance(a, SetOverride)] == ["w1", "w2"]
    new = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0)
    half = window(lambda j: [ws(g, done=300 + j, **new) for g in (0, 1, 2)] + [ws(3, done=300 + j)])
    acts = drive(pilot, [half], ctl=control(seen_generation=1), t0=300)
    assert [a.worker for a in acts if isinstance(a, SetOverride)] == ["w3"]
    done = window(lambda j: [ws(g, done=400 + j, **new) for g in range(4)])
    acts = drive(pilot, [done], ctl=control(seen_generation=1), t0=310)
    (fleet,) = [a for a in acts if isinstance(a, SetFleet)]
    assert fleet.spec.generation == 1 and fleet.spec.strategy == "no_buffer"
    acts = drive(pilot, [done, done, done], ctl=control(seen_generation=1), t0=320)
    (verified,) = [a.event for a in acts if isinstance(a, Emit) and a.event.kind == "verified"]
    assert verified.data["ratio"] == pytest.approx(1065 / 560, rel=0.01) and verified.data["slots"] == [72]
    assert pilot.state.phase == "observing"


def test_a_canary_that_does_not_gain_is_rolled_back_and_not_tried_again():
    pilot, acts = canary_phase(400.0)
    (back,) = [a for a in acts if isinstance(a, SetOverride)]
    assert back.worker == "w0" and back.spec.strategy == "default" and back.spec.generation == 2
    (rb,) = [a.event for a in acts if isinstance(a, Emit) and a.event.kind == "rollback"]
    assert "did not gain" in rb.message and rb.data["canary_tokens_per_s"] == 400.0
    # A restarted supervisor reads its state back and does not try the same change again.
    again = Autopilot(pilot.s, LadderConfig(forbid=frozenset({"no_radix"})), State.from_json(pilot.state.to_json()))
    acts = drive(again, [stalled(i) for i in range(3)], ctl=control(seen_generation=2))
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert any("did not gain" in a.event.message for a in acts if isinstance(a, Emit) and a.event.kind == "decision")


def test_a_canary_that_fails_to_start_is_rolled_back():
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1), LadderConfig())
    drive(pilot, [stalled(0)])
    down = window(lambda j: [replace(ws(0, generation=0), state="down", message="CUDA out of memory")]
                  + [ws(g, done=100 + j) for g in (1, 2, 3)])
    acts = drive(pilot, [down], t0=200)
    assert [a.worker for a in acts if isinstance(a, SetOverride)] == ["w0"]
    assert "CUDA out of memory" in next(a.event.message for a in acts if isinstance(a, Emit)
                                        and a.event.kind == "rollback")
