"""The supervisor's pure core on hand-built snapshots: classification (window aggregates and static
facts), the ladder's predictions, the autopilot's verdicts, back-offs, timeouts, churn, drain and host
outliers. No processes, no Redis: each test runs in milliseconds."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from batchfleet.records import Event, ServerFacts, ServerMetrics, ServerSpec, WorkerStatus
from supervisor.autopilot import Autopilot, Control, DropFields, Emit, PilotState, SetFleet, SetOverride, Settings
from supervisor.classify import classify_window
from supervisor.fleet import FleetSnapshot
from supervisor.ladder import LadderConfig, current_spec, next_rung, predict_capacity, spec_key

# What a seed-profile server says at start-up (default strategy): capped at 37 by its mamba pool.
SEED = ServerFacts(effective_max_running=37, cap_cause="mamba", mamba_pool=187, slots_per_request=5,
                   max_total_num_tokens=200939, context_len=262144, strategy="extra_buffer",
                   mem_fraction_static=0.88, memory_before_load_gb=95.5, weight_gb=54.1, kv_gb=6.13, mamba_gb=5.51)
NB = replace(SEED, effective_max_running=72, mamba_pool=218, slots_per_request=3, strategy="no_buffer",
             mem_fraction_static=0.9, requested_max_running=128, kv_gb=7.13, mamba_gb=6.42)
NO_BUFFER = ServerSpec(strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128)


def ws(gpu: int, *, t: float = 0.0, in_flight: int = 37, cap: int = 37, running: float | None = None,
       queued: float = 0, kv: float = 0.05, mamba: float = 0.69, tps: float = 560.0, done: int | None = None,
       retracted: float = 0, state: str = "serving", generation: int = 0, strategy: str = "default",
       hit: float = 0.0, flags: list[str] | None = None, facts: ServerFacts | None = None, slots: int = 0,
       surplus: int = 0, host: str = "h", worker: str | None = None, counter: bool = True,
       message: str = "") -> WorkerStatus:
    """One status record at time t; the server's generation counter grows at `tps`."""
    return WorkerStatus(
        worker=worker or f"w{gpu}", host=host, queue=f"gpu{gpu}", gpu=gpu, state=state, strategy=strategy,
        generation=generation, effective_max=cap, in_flight=in_flight, slots=slots, surplus=surplus,
        done=100 + int(t) if done is None else done, tokens_per_s=tps, server_flags=flags or [], facts=facts,
        message=message, ts=t,
        metrics=ServerMetrics(running=in_flight if running is None else running, queued=queued, full_kv_usage=kv,
                              mamba_usage=mamba, cache_hit_rate=hit, gen_throughput=tps, retracted=retracted,
                              generation_tokens_total=1e6 + tps * t if counter else None, ts=t if counter else None))


def snap(workers: list[WorkerStatus], *, backlog: int = 10_000, ts: float = 0.0,
         silent: frozenset[str] = frozenset()) -> FleetSnapshot:
    return FleetSnapshot(ts=ts, workers=workers, backlog={"gpu0": backlog},
                         stats={"succeeded": 1000, "completion_tokens": 300_000}, silent=silent)


def window(make, k: int = 0, *, n: int = 5, length: float = 4.0, **kw) -> list[FleetSnapshot]:
    """Window k: n samples over [k*length, (k+1)*length]; `make(t)` gives the workers at time t."""
    ts = [k * length + i * length / (n - 1) for i in range(n)]
    return [snap(make(t), ts=t, **kw) for t in ts]


def classes(snaps: list[FleetSnapshot]) -> dict[str, str]:
    return {v.worker: str(v.cls) for v in classify_window(snaps).servers}


# --- classification -----------------------------------------------------------------------------
def test_seed_fleet_is_mamba_bound_on_gauges_without_facts():
    rep = classify_window(window(lambda t: [ws(g, t=t, counter=False) for g in range(4)]))
    assert {v.cls for v in rep.servers} == {"mamba-bound"} and {v.evidence for v in rep.servers} == {"gauges"}
    assert rep.majority("mamba-bound")
    assert "mamba usage 69%" in rep.servers[0].reasons[0]
    assert rep.fleet_tokens_per_s == pytest.approx(4 * 560)


def test_seed_fleet_is_mamba_bound_from_static_facts_and_rates_come_from_the_counter():
    rep = classify_window(window(lambda t: [ws(g, t=t, facts=SEED, tps=500 + 10 * g) for g in range(2)]))
    assert [(v.cls, v.evidence) for v in rep.servers] == [("mamba-bound", "static")] * 2
    assert "capped at 37 by its mamba state pool (187 state slots, 5 per request)" in rep.servers[0].reasons[0]
    assert [round(v.tokens_per_s) for v in rep.servers] == [500, 510]


@pytest.mark.parametrize(("kw", "backlog", "expected"), [
    ({"in_flight": 8}, 10_000, "client-bound"),  # BATCHFLEET_MAX_IN_FLIGHT=8 under a 37-slot server
    ({"kv": 0.95}, 10_000, "kv-bound"),
    ({"mamba": 0.2, "kv": 0.3}, 10_000, "saturated-healthy"),  # gauges: nothing stands out
    ({"facts": replace(SEED, cap_cause="requested")}, 10_000, "saturated-healthy"),  # --max-running binds
    ({}, 0, "draining"),
    ({"state": "down"}, 10_000, "down"),
    ({"state": "restarting"}, 10_000, "restarting"),
])
def test_control_classes(kw, backlog, expected):
    assert classes(window(lambda t: [ws(0, t=t, **kw)], backlog=backlog)) == {"w0": expected}


def test_retractions_mean_kv_bound_no_progress_means_hung_and_a_frozen_record_means_silent():
    assert classes(window(lambda t: [ws(0, t=t, retracted=t)])) == {"w0": "kv-bound"}
    assert classes(window(lambda t: [ws(0, tps=0, done=100)])) == {"w0": "hung"}  # frozen while in flight
    assert classes(window(lambda t: [ws(0, t=t)], silent=frozenset({"w0"}))) == {"w0": "silent"}


def test_below_cap_with_a_queue_inside_the_server_and_kv_near_full_is_kv_bound():
    # tiny-plain asked for 64: the KV budget admits 48 and 16 of ours wait inside the server.
    (v,) = classify_window(window(lambda t: [ws(0, t=t, cap=64, in_flight=64, running=48, queued=16,
                                                kv=0.8)])).servers
    assert v.cls == "kv-bound" and "waiting in the server" in v.reasons[0]


def test_short_generations_flicker_but_a_mamba_capped_server_is_mamba_bound_every_window():
    """The measured 2b case: with ~48-token generations requests turn over every few steps, so one
    reading of running sits anywhere from 25 to 37 with a few waiting in the server or in transit, KV
    at 1-2 %, and the worker keeps 0.98 of the slots busy. Every window must say mamba-bound, from the
    start-up facts; the gauges alone (no facts) do not, which is why the facts are published."""
    rng = random.Random(5)

    def flicker(t: float, facts: ServerFacts | None) -> list[WorkerStatus]:
        out = []
        for g in range(2):
            running = rng.randint(25, 37)
            out.append(ws(g, t=t, facts=facts, in_flight=rng.choice([36, 37, 37]), running=running,
                          queued=rng.randint(0, 37 - running), kv=rng.uniform(0.01, 0.02),
                          mamba=running * 3.5 / 187))
        return out

    for k in range(20):
        rep = classify_window(window(lambda t: flicker(t, SEED), k, n=11))
        assert [(v.cls, v.evidence) for v in rep.servers] == [("mamba-bound", "static")] * 2, rep.servers[0].reasons
    gauges_only = {str(v.cls) for k in range(20) for v in classify_window(window(lambda t: flicker(t, None), k,
                                                                                    n=11)).servers}
    assert gauges_only == {"mamba-bound", "saturated-healthy"}  # the gauges alone flicker between the two


def test_a_mamba_capped_server_whose_kv_would_fill_at_the_cap_is_not_mamba_bound():
    # Long contexts: 30 running use 50 % of KV, so at 37 KV would be ~62 %: more mamba slots would not fit.
    (v,) = classify_window(window(lambda t: [ws(0, t=t, facts=SEED, running=30, kv=0.5)])).servers
    assert v.cls == "saturated-healthy"


def test_a_queued_surplus_inside_the_server_is_not_a_kv_stall():
    # A worker that keeps 4 requests waiting in the server on purpose (its published surplus).
    (v,) = classify_window(window(lambda t: [ws(0, t=t, facts=SEED, in_flight=41, slots=41, surplus=4,
                                                running=35, queued=4, kv=0.3)])).servers
    assert (v.cls, v.evidence) == ("mamba-bound", "static")


def test_client_bound_names_our_limit():
    (v,) = classify_window(window(lambda t: [ws(0, t=t, in_flight=8, slots=8)])).servers
    assert "our side" in v.reasons[0] and "BATCHFLEET_MAX_IN_FLIGHT" in v.reasons[1]
    (v,) = classify_window(window(lambda t: [ws(0, t=t, in_flight=20)])).servers
    assert "keeps only 20 of its 37 slots busy" in v.reasons[1] and not v.filling


def test_a_worker_filling_new_slots_is_client_bound_but_filling():
    (v,) = classify_window(window(lambda t: [ws(0, t=t, cap=72, in_flight=int(20 + 8 * t))])).servers
    assert v.cls == "client-bound" and v.filling and "still filling" in v.reasons[1]


def test_a_gpu_far_from_its_peers_is_flagged():
    rep = classify_window(window(lambda t: [ws(g, t=t, cap=20 if g == 3 else 37, in_flight=20 if g == 3 else 37)
                                            for g in range(4)]))
    flagged = {v.worker: v.outliers for v in rep.servers if v.outliers}
    assert list(flagged) == ["w3"] and "capacity 20 vs peers' median 37" in flagged["w3"][0]


def test_no_peer_judgement_once_the_backlog_is_gone_or_too_small_to_fill_the_fleet():
    """3b: finishing its last prompts, each GPU runs what it has; nobody is 'far from its peers' and
    nobody is 'client-bound'."""
    def ending(t: float) -> list[WorkerStatus]:
        return [ws(g, t=t, in_flight=37 - 9 * g, tps=560 - 150 * g) for g in range(4)]
    for backlog in (0, 20):  # 20 left in Redis, 54 free slots: the run is ending, not our side
        rep = classify_window(window(ending, backlog=backlog))
        assert not [v.outliers for v in rep.servers if v.outliers]
        assert {str(v.cls) for v in rep.servers[1:]} == {"draining"}, [v.reasons for v in rep.servers]


@pytest.mark.parametrize(("queues", "store_waiting", "expected"), [
    ({"gpu1": 30}, 0, "draining"),  # all fed: the 30 left wait for gpu1's own worker (within one load of it)
    ({"gpu0": 30}, 0, "client-bound"),  # its own queue holds them: its worker is slow
    ({"gpu1": 74}, 0, "client-bound"),  # 30 beyond one load (44) of gpu1's worker: its to steal
    ({"gpu1": 30}, 5, "client-bound"),  # the store holds prompts not fed: the feed lags, our side
])
def test_at_the_runs_tail_a_gpu_is_client_bound_only_if_prompts_wait_within_its_workers_reach(
        queues, store_waiting, expected):
    """A worker claims its own queue, and steals from a serving peer's only what it holds beyond one load
    of that worker (worker/steal.py). At the run's tail, 30 prompts left in gpu1's queue, whose worker
    holds its 44 slots, fill the fleet's free slots by count (12) but none of them is gpu0's to run."""
    def fleet(t: float) -> list[WorkerStatus]:
        return [ws(0, t=t, cap=22, in_flight=10, slots=44), ws(1, t=t, cap=22, in_flight=44, running=22, queued=22,
                                                               slots=44, surplus=22)]
    snaps = [FleetSnapshot(ts=t, workers=fleet(t), backlog={"gpu0": 0, "gpu1": 0, **queues},
                           stats={"succeeded": 1000, "completion_tokens": 300_000, "store_waiting": store_waiting})
             for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    v = classify_window(snaps).servers[0]
    assert (v.worker, str(v.cls)) == ("w0", expected), v.reasons
    if expected == "draining":
        assert "0 are within its worker's reach" in v.reasons[0]


def test_a_canary_on_a_new_generation_is_not_an_outlier():
    rep = classify_window(window(lambda t: [ws(0, t=t, generation=1, cap=72, in_flight=72, tps=1065, facts=NB)]
                                 + [ws(g, t=t, facts=SEED) for g in (1, 2, 3)]))
    assert not [v for v in rep.servers if v.outliers]


def test_a_server_restarted_within_the_window_is_not_compared_with_its_peers():
    # A rollout's last GPU restarted mid-window: its window rate counts the downtime, a small fraction of
    # its peers', and with three GPUs it would make every one of them read as far from its peers.
    new = dict(generation=1, strategy="no_buffer", cap=22, in_flight=22, facts=NB)

    def fleet(t: float) -> list[WorkerStatus]:
        late = ws(2, t=t, state="restarting", cap=12, in_flight=0, tps=0) if t < 2 else ws(2, t=t, tps=377, **new)
        return [ws(g, t=t, tps=4900, **new) for g in (0, 1)] + [late]
    rep = classify_window(window(fleet))
    assert not [(v.worker, v.outliers) for v in rep.servers if v.outliers]
    # Steady the whole window at that rate (among four), it is flagged, and only it.
    rep = classify_window(window(lambda t: [ws(g, t=t, tps=377 if g == 2 else 4900, **new) for g in range(4)]))
    assert {v.worker for v in rep.servers if v.outliers} == {"w2"}


def test_a_slow_host_is_flagged_once_as_a_host_not_as_its_gpus():
    def fleet(t: float) -> list[WorkerStatus]:
        return ([ws(g, t=t, host="a", worker=f"a{g}") for g in range(4)]
                + [ws(10 + g, t=t, host="b", worker=f"b{g}", tps=300) for g in range(4)]
                + [ws(20 + g, t=t, host="c", worker=f"c{g}", tps=1000 if g == 0 else 560) for g in range(4)])
    rep = classify_window(window(fleet))
    assert list(rep.hosts) == ["b"] and "tokens/s: its 4 GPUs 300 vs other hosts' median 560" in rep.hosts["b"][0]
    assert {v.worker for v in rep.servers if v.outliers} == {"c0"}  # one odd GPU is still one GPU
    assert rep.servers[0].label == "a/gpu0"  # several hosts: labels say which
    pilot = Autopilot(Settings(), LadderConfig())
    acts = pilot.step(rep, control(), 10.0) + pilot.step(rep, control(), 20.0)
    host_diags = [a.event for a in acts if isinstance(a, Emit) and a.event.data.get("host")]
    assert len(host_diags) == 1 and host_diags[0].message.startswith("host b: slower than the other hosts")


# --- ladder -------------------------------------------------------------------------------------------
def test_ladder_climbs_from_default_to_no_buffer_with_more_memory():
    p = next_rung(ServerSpec(), LadderConfig())
    assert p.target == NO_BUFFER and p.ratio == pytest.approx(5 / 3)  # no facts: the slot ratio alone


def test_ladder_predicts_the_pool_growth_from_the_memory_figures_as_the_server_will_size_it():
    """Ground truth: the simulator's implementation of SGLang's sizing for the same profile (37 -> 72,
    the seed's own figures). The prediction only uses what a worker publishes."""
    from sglang_sim.memory import plan_memory
    from sglang_sim.profiles import get_profile

    prof = get_profile("seed-27b-96gb")
    now = plan_memory(prof, {}, ratio=5)
    then = plan_memory(prof, {"mem_fraction_static": 0.9, "max_running_requests": 128}, ratio=3)
    facts = replace(SEED, effective_max_running=now.effective_max_running, mamba_pool=now.mamba_pool,
                    kv_gb=round(now.kv_gb, 2), mamba_gb=round(now.conv_gb + now.ssm_gb, 2),
                    memory_before_load_gb=now.memory_before_load_gb, max_total_num_tokens=now.max_total_num_tokens)
    pred = predict_capacity(facts, ServerSpec(), NO_BUFFER)
    assert pred.capacity == then.effective_max_running == 72
    assert pred.ratio == pytest.approx(72 / 37) and "grows the pools x1.16" in pred.how
    assert next_rung(ServerSpec(), LadderConfig(), facts=facts).ratio == pytest.approx(72 / 37)


def test_ladder_no_radix_only_when_the_cache_buys_little_and_it_is_allowed():
    assert next_rung(NO_BUFFER, LadderConfig(), cache_hit_rate=0.4).target is None
    assert next_rung(NO_BUFFER, LadderConfig(), cache_hit_rate=None).target is None
    low = next_rung(NO_BUFFER, LadderConfig(), cache_hit_rate=0.01)
    assert low.target.strategy == "no_radix" and low.ratio == 3
    with_facts = next_rung(NO_BUFFER, LadderConfig(), cache_hit_rate=0.01, facts=NB)
    assert with_facts.ratio == pytest.approx(128 / 72)  # radix off: the pool is sized to the 128 ceiling
    forbidden = next_rung(NO_BUFFER, LadderConfig(forbid=frozenset({"no_radix"})), cache_hit_rate=0.01)
    assert forbidden.target is None and "forbidden" in forbidden.reasons[0]


def test_ladder_skips_a_change_in_back_off_and_a_forbidden_rung():
    p = next_rung(ServerSpec(), LadderConfig(), failed={spec_key(NO_BUFFER): "did not gain"}, cache_hit_rate=0.0)
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
    return Control(**{"fleet": None, "overrides": {}, "current": ServerSpec(), **kw})


def stalled(k: int = 0, n: int = 4, **kw) -> list[FleetSnapshot]:
    return window(lambda t: [ws(g, t=t, **kw) for g in range(n)], k)


def drive(pilot: Autopilot, windows, ctl: Control | None = None, events=None) -> list:
    out = []
    for i, snaps in enumerate(windows):
        rep = classify_window(snaps)
        out += pilot.step(rep, ctl or control(), rep.end, (events or {}).get(i, ()))
    return out


def kinds(actions) -> list[str]:
    return [a.event.kind for a in actions if isinstance(a, Emit)]


def emitted(actions, kind: str) -> list[Event]:
    return [a.event for a in actions if isinstance(a, Emit) and a.event.kind == kind]


def test_three_stalled_windows_on_gauges_start_a_canary_keyed_by_queue():
    pilot = Autopilot(Settings(windows=3, restart_cost_s=1), LadderConfig())
    assert not [a for a in drive(pilot, [stalled(0, counter=False), stalled(1, counter=False)])
                if not isinstance(a, Emit)]
    acts = drive(pilot, [stalled(2, counter=False)])
    (override,) = [a for a in acts if isinstance(a, SetOverride)]
    assert override.queue == "gpu0" and override.spec.strategy == "no_buffer" and override.spec.generation == 1
    (decision,) = emitted(acts, "decision")
    assert decision.data["windows"] == 3 and decision.data["predicted_ratio"] == pytest.approx(5 / 3, rel=1e-3)
    assert decision.data["evidence"] == "gauges"
    assert decision.data["seen"]["classes"] == {"mamba-bound": ["gpu0", "gpu1", "gpu2", "gpu3"]}
    assert pilot.state.phase == "canary" and pilot.state.canary == "gpu0"


def test_start_up_facts_decide_in_one_window_with_the_memory_prediction():
    pilot = Autopilot(Settings(windows=3, restart_cost_s=1), LadderConfig())
    acts = drive(pilot, [stalled(0, facts=SEED)])
    (decision,) = emitted(acts, "decision")
    assert decision.data["windows"] == 1 and decision.data["evidence"] == "start-up facts"
    assert decision.data["predicted_ratio"] == pytest.approx(72 / 37, rel=1e-3)
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu0"]


def test_dry_run_advises_once_and_acts_never():
    pilot = Autopilot(Settings(windows=2, dry_run=True, restart_cost_s=1), LadderConfig())
    acts = drive(pilot, [stalled(i) for i in range(5)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert kinds(acts).count("advice") == 1


def test_not_worth_it_when_little_work_is_left():
    pilot = Autopilot(Settings(windows=2, restart_cost_s=10_000), LadderConfig())
    acts = drive(pilot, [stalled(i) for i in range(4)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert any("not worth a restart" in e.message and "(--restart-cost)" in e.message
               for e in emitted(acts, "decision"))


def test_a_lower_bound_eta_never_says_not_worth_it():
    # While no prompt has finished, the ETA counts only the tokens generated so far: a lower bound of the
    # work left, so it can show that a restart pays, never that it does not (the first window of a slow
    # start would otherwise read as a run almost done).
    pilot = Autopilot(Settings(windows=2, restart_cost_s=10_000), LadderConfig())
    acts = []
    for i in range(3):
        rep = replace(classify_window(stalled(i)), eta_lower=True)
        acts += pilot.step(rep, control(), rep.end, ())
    decisions = [e.message for e in emitted(acts, "decision")]
    assert decisions and all("no prompt has finished yet" in m for m in decisions), decisions
    assert not [a for a in acts if not isinstance(a, Emit)]
    rep = classify_window(stalled(3))  # prompts have finished: now the same figures are judged
    assert not rep.eta_lower
    assert any("not worth a restart" in e.message for e in emitted(pilot.step(rep, control(), rep.end, ()), "decision"))


@pytest.mark.parametrize("cls_kw", [{"in_flight": 8}, {"kv": 0.95}, {"mamba": 0.2}])
def test_no_restart_unless_mamba_bound(cls_kw):
    pilot = Autopilot(Settings(windows=2, restart_cost_s=1), LadderConfig())
    acts = drive(pilot, [stalled(i, **cls_kw) for i in range(6)])
    assert not [a for a in acts if not isinstance(a, Emit)]
    if "in_flight" in cls_kw:  # client-bound is said once per server, and it is ours
        diags = emitted(acts, "diagnosis")
        assert len(diags) == 4 and all(e.data["ours"] for e in diags)


# The canary scenario: 4 GPUs, windows of 4 s. After the decision (window 0) the canary gpu0 restarts
# (window 1), then serves generation 1 with `canary_cap` slots, its worker keeping `fill(k, t)` in flight.
def seed_pilot(**settings) -> Autopilot:
    pilot = Autopilot(Settings(**{"windows": 1, "restart_cost_s": 1, "verify_windows": 2, "rollout_batch": 2,
                                  **settings}), LadderConfig(forbid=frozenset({"no_radix"})))
    drive(pilot, [stalled(0, facts=SEED)])
    assert pilot.state.phase == "canary"
    return pilot


def canary_windows(ks, *, tps: float = 1065.0, cap: int = 72, fill=lambda k, t: 72, peer_fill=lambda k, t: 37,
                   backlog: int = 10_000) -> list[list[FleetSnapshot]]:
    def fleet(k: int):
        def make(t: float) -> list[WorkerStatus]:
            canary = ws(0, t=t, generation=1, strategy="no_buffer", cap=cap, in_flight=fill(k, t), tps=tps, facts=NB)
            return [canary] + [ws(g, t=t, facts=SEED, in_flight=peer_fill(k, t)) for g in (1, 2, 3)]
        return make
    return [window(fleet(k), k, backlog=backlog) for k in ks]


def restarting(k: int) -> list[FleetSnapshot]:
    return window(lambda t: [ws(0, t=t, state="restarting")] + [ws(g, t=t, facts=SEED) for g in (1, 2, 3)], k)


def test_a_canary_that_gains_is_rolled_out_a_few_at_a_time_then_verified_on_steady_windows():
    pilot = seed_pilot()
    ctl = control(seen_generation=1)
    acts = drive(pilot, [restarting(1), *canary_windows([2, 3])], ctl)
    (canary,) = emitted(acts, "canary")
    assert canary.data["measured_ratio"] == pytest.approx(1065 / 560, rel=0.01) and canary.data["measured_s"] == 8
    assert pilot.state.phase == "rolling_out"
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu1", "gpu2"]
    new = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0, facts=NB)
    half = window(lambda t: [ws(g, t=t, **new) for g in (0, 1, 2)] + [ws(3, t=t, facts=SEED)], 4)
    acts = drive(pilot, [half], ctl)
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu3"]
    done = [window(lambda t: [ws(g, t=t, **new) for g in range(4)], k) for k in (5, 6, 7, 8)]
    acts = drive(pilot, done[:1], ctl)
    (fleet,) = [a for a in acts if isinstance(a, SetFleet)]
    assert fleet.spec.generation == 1 and fleet.spec.strategy == "no_buffer"
    acts = drive(pilot, done[1:], ctl)
    (verified,) = emitted(acts, "verified")
    assert verified.data["ratio"] == pytest.approx(1065 / 560, rel=0.01) and verified.data["slots"] == [72]
    assert pilot.state.phase == "observing"


def test_the_verdict_compares_with_the_peers_steady_rate_not_a_ramp_up_decision_window():
    # Start-up facts decide after one window, which may hold the fleet's ramp-up (half the steady rate
    # here): a verdict against that window would read double the gain the move is worth.
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1, verify_windows=2, rollout_batch=3),
                      LadderConfig(forbid=frozenset({"no_radix"})))
    (decision,) = emitted(drive(pilot, [stalled(0, facts=SEED, tps=280.0)]), "decision")
    assert decision.data["before_tokens_per_s"] == pytest.approx(4 * 280, rel=0.01)
    ctl = control(seen_generation=1)
    acts = drive(pilot, [restarting(1), *canary_windows([2, 3])], ctl)
    (canary,) = emitted(acts, "canary")
    assert canary.data["peers_tokens_per_s"] == pytest.approx(560, rel=0.01)
    new = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0, facts=NB)
    acts = drive(pilot, [window(lambda t: [ws(g, t=t, **new) for g in range(4)], k) for k in (4, 5, 6, 7)], ctl)
    (verified,) = emitted(acts, "verified")
    assert verified.data["ratio"] == pytest.approx(1065 / 560, rel=0.01), verified.message
    assert verified.data["before_tokens_per_s"] == pytest.approx(4 * 560, rel=0.01)
    assert verified.data["after_tokens_per_s"] == pytest.approx(4 * 1065, rel=0.01)


def test_a_canary_still_filling_is_not_judged_and_not_rolled_back():
    """Issue 9 §2: a canary up with 72 slots while its worker keeps 36 in flight looks slower than its
    peers; judged then, a change that gains would be rolled back. Not full = not measured."""
    pilot = seed_pilot()
    acts = drive(pilot, [restarting(1), *canary_windows(range(2, 8), tps=347, fill=lambda k, t: 36)],
                 control(seen_generation=1))
    assert not emitted(acts, "rollback") and not emitted(acts, "canary")
    assert pilot.state.phase == "canary" and "not full (36 of 72 in flight)" in pilot.state.confounded
    acts = drive(pilot, canary_windows([8, 9]), control(seen_generation=1))  # it fills: now it is judged
    assert emitted(acts, "canary")[0].data["measured_ratio"] == pytest.approx(1.9, rel=0.01)


def test_the_canary_is_measured_only_after_it_filled_within_a_window():
    pilot = seed_pilot()
    # Window 2: filling until t=10, full after; its rate before filling must not count.
    fill = lambda k, t: 72 if t >= 10 else 40  # noqa: E731
    drive(pilot, [restarting(1), *canary_windows([2], fill=fill)], control(seen_generation=1))
    assert pilot.state.measured and pilot.state.measured[0][0] == pytest.approx(2.0)


def test_peers_not_steady_confound_the_measure():
    pilot = seed_pilot()
    acts = drive(pilot, [restarting(1), *canary_windows([2, 3, 4], peer_fill=lambda k, t: 10)],
                 control(seen_generation=1))
    assert not emitted(acts, "rollback") and not emitted(acts, "canary")
    assert "no peer is steady" in pilot.state.confounded


def test_a_confounded_canary_times_out_as_inconclusive_and_may_be_retried_without_a_higher_bar():
    pilot = seed_pilot(phase_timeout_s=20, retry_after_s=30)
    acts = drive(pilot, [restarting(1), *canary_windows(range(2, 9), fill=lambda k, t: 36)], control(seen_generation=1))
    (rb,) = emitted(acts, "rollback")
    assert rb.data["verdict"] == "inconclusive" and "inconclusive" in rb.message
    t = pilot.state.tried[spec_key(NO_BUFFER)]
    assert t["bar"] == pytest.approx(0.2) and t["tries"] == 0
    # Within the back-off the rung is not proposed; after it, it is tried again at the same bar.
    acts = drive(pilot, [stalled(9, facts=SEED)], control(seen_generation=2))
    assert not [a for a in acts if isinstance(a, SetOverride)]
    assert "inconclusive" in emitted(acts, "decision")[0].message
    acts = drive(pilot, [stalled(20, facts=SEED)], control(seen_generation=2))
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu0"] and pilot.state.bar == pytest.approx(0.2)


def test_a_canary_that_does_not_gain_is_rolled_back_and_retried_after_a_back_off_with_a_higher_bar():
    pilot = seed_pilot(retry_after_s=100)
    acts = drive(pilot, [restarting(1), *canary_windows([2, 3], tps=400)], control(seen_generation=1))
    (back,) = [a for a in acts if isinstance(a, SetOverride)]
    assert back.queue == "gpu0" and back.spec.strategy == "default" and back.spec.generation == 2
    (rb,) = emitted(acts, "rollback")
    assert "did not gain" in rb.message and rb.data["canary_tokens_per_s"] == pytest.approx(400)
    assert rb.data["verdict"] == "failed"
    # A restarted supervisor reads its state back: the rung is in back-off, not banned.
    again = Autopilot(pilot.s, LadderConfig(forbid=frozenset({"no_radix"})),
                      PilotState.from_json(pilot.state.to_json()))
    acts = drive(again, [stalled(k, facts=SEED) for k in (4, 5)], control(seen_generation=2))
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert any("did not gain" in e.message and "retry after" in e.message for e in emitted(acts, "decision"))
    acts = drive(again, [stalled(40, facts=SEED)], control(seen_generation=2))  # 160 s later: back-off over
    (decision,) = emitted(acts, "decision")
    assert "try 2, bar x1.30" in decision.message and again.state.bar == pytest.approx(0.3)


# A state as a supervisor stores it in Redis (`Keys.autopilot`), in the middle of a canary.
STORED_STATE = (
    '{"phase":"canary","stall":1,"stall_since":0.0,"fleet_tps":[],"server_tps":[],"baseline":{"generation":0,'
    '"strategy":"default","mem_fraction_static":null,"max_running_requests":null},"target":{"generation":1,'
    '"strategy":"no_buffer","mem_fraction_static":0.9,"max_running_requests":128},"predicted":1.0,"bar":0.2,'
    '"canary":"gpu0","canary_label":"gpu0","phase_since":0.0,"progress_since":0.0,"served_since":0.0,'
    '"measured":[[2.0,1065.0,560.0]],"confounded":"","baseline_capacity":0.0,"before_tps":0.0,'
    '"before_server_tps":0.0,"decide_s":0.0,"rolled":[],"tried":{"no_buffer|0.9|128":{"tries":1,"bar":0.3,'
    '"until":700.0,"why":"did not gain"}},"restart_costs":[6.5],"canary_restart":{},"notes":{},"classes":{},'
    '"control":{},"shape":"tp1","recalled":false,"consulted":["gpu0"]}')


def test_a_stored_state_reads_back_and_is_written_again_in_the_same_shape():
    st = PilotState.from_json(STORED_STATE)
    assert (st.phase, st.canary, st.shape, st.restart_costs) == ("canary", "gpu0", "tp1", [6.5])
    assert st.target_spec == replace(NO_BUFFER, generation=1) and st.tried["no_buffer|0.9|128"]["tries"] == 1
    # written back as it was, with the fields added since (their defaults) at the end
    assert st.to_json().decode() == STORED_STATE[:-1] + ',"keep":[]}'

    pilot = Autopilot(Settings(), LadderConfig(), st)  # a restarted supervisor carries on with the canary
    assert pilot.restart_cost_s() == pytest.approx(6.5) and pilot.state.measured == [[2.0, 1065.0, 560.0]]


def test_a_canary_that_fails_to_start_is_rolled_back():
    pilot = seed_pilot()
    down = window(lambda t: [ws(0, t=t, generation=1, state="down", message="CUDA out of memory")]
                  + [ws(g, t=t, facts=SEED) for g in (1, 2, 3)], 1)
    acts = drive(pilot, [down])
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu0"]
    assert "CUDA out of memory" in emitted(acts, "rollback")[0].message


def test_the_canary_that_never_serves_times_out():
    pilot = seed_pilot(phase_timeout_s=10)
    acts = drive(pilot, [restarting(k) for k in (1, 2, 3, 4)])
    assert "did not serve" in emitted(acts, "rollback")[0].message


def test_the_canarys_measured_restart_replaces_the_assumed_cost():
    pilot = seed_pilot(restart_cost_s=300)
    restarted = Event("restarted", "gpu0 now serves", source="w0", ts=6.0,
                      data={"downtime_s": 3.5, "generation": 1, "queue": "gpu0"})
    fill = lambda k, t: 72 if t >= 9 else 50  # noqa: E731
    drive(pilot, [restarting(1), *canary_windows([2, 3, 4], fill=fill)], control(seen_generation=1),
          events={1: [restarted]})
    assert pilot.state.restart_costs == [pytest.approx(3.5 + 3.0)]  # downtime + time to fill again
    assert pilot.restart_cost_s() == pytest.approx(6.5)


def test_the_run_draining_during_the_canary_ends_it_without_rollback_or_rollout():
    pilot = seed_pilot()
    acts = drive(pilot, [restarting(1), *canary_windows([2], backlog=0)], control(seen_generation=1))
    assert emitted(acts, "canary")[0].data["verdict"] == "draining"
    assert not [a for a in acts if not isinstance(a, Emit)] and pilot.state.phase == "observing"


def rolling_pilot() -> Autopilot:
    pilot = seed_pilot(rollout_batch=1, phase_timeout_s=30)
    drive(pilot, [restarting(1), *canary_windows([2, 3])], control(seen_generation=1))
    assert pilot.state.phase == "rolling_out" and pilot.state.rolled == ["gpu0", "gpu1"]
    return pilot


NEW = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0, facts=NB)


def test_rollout_survives_a_worker_restarted_under_a_new_name():
    pilot = rolling_pilot()
    ctl = control(seen_generation=1)
    # gpu1's worker was killed -9 and restarted as w1-new: it reads the override of its queue.
    w = window(lambda t: [ws(0, t=t, **NEW), ws(1, t=t, worker="w1-new", **NEW)]
               + [ws(g, t=t, facts=SEED) for g in (2, 3)], 4)
    acts = drive(pilot, [w], ctl)
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu2"]


def test_rollout_is_not_blocked_by_a_gpu_whose_worker_is_gone_and_carries_on_after_its_timeout():
    pilot = rolling_pilot()
    ctl = control(seen_generation=1, overrides={"gpu0": NO_BUFFER, "gpu1": NO_BUFFER})
    # gpu1's worker died and nobody restarted it: its record expired. The rollout goes on without it.
    w = [window(lambda t: [ws(0, t=t, **NEW), ws(2, t=t, **NEW), ws(3, t=t, **NEW)], k) for k in (4, 5)]
    acts = drive(pilot, w, ctl)
    assert not [a for a in acts if isinstance(a, DropFields)]  # gpu1's override waits for its worker
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu2", "gpu3"]
    assert pilot.state.phase == "verifying" and [a for a in acts if isinstance(a, SetFleet)]
    # A GPU that stays on the old spec past the phase timeout does not keep the rollout waiting forever.
    pilot = rolling_pilot()
    stuck = [window(lambda t: [ws(0, t=t, **NEW), ws(1, t=t, state="restarting", generation=0)]
                    + [ws(g, t=t, facts=SEED) for g in (2, 3)], k) for k in range(4, 14)]
    acts = drive(pilot, stuck, ctl)
    (rolled,) = emitted(acts, "rolled_out")
    assert "carrying on" in rolled.message and pilot.state.phase == "verifying"


def test_a_server_down_on_the_new_spec_during_rollout_rolls_every_moved_gpu_back():
    pilot = rolling_pilot()
    down = window(lambda t: [ws(0, t=t, **NEW), ws(1, t=t, generation=1, state="down", message="CUDA out of memory")]
                  + [ws(g, t=t, facts=SEED) for g in (2, 3)], 4)
    acts = drive(pilot, [down], control(seen_generation=1))
    backs = [a for a in acts if isinstance(a, SetOverride)]
    assert [a.queue for a in backs] == ["gpu0", "gpu1"] and {a.spec.strategy for a in backs} == {"default"}
    assert {a.spec.generation for a in backs} == {2} and pilot.state.phase == "observing"


def test_stale_overrides_are_removed():
    pilot = Autopilot(Settings(), LadderConfig())
    ctl = control(overrides={"gpu0": NO_BUFFER, "gpu9": NO_BUFFER},
                  legacy={"w0": NO_BUFFER, "dead.gpu1.123": NO_BUFFER})
    acts = drive(pilot, [stalled(0, n=2)], ctl)
    (drop,) = [a for a in acts if isinstance(a, DropFields)]
    assert drop.fields == ("queue:gpu9", "worker:dead.gpu1.123")


def test_verification_waits_for_steady_windows_and_says_so_when_there_are_none():
    pilot = rolling_pilot()
    ctl = control(seen_generation=1)
    all_new = [window(lambda t: [ws(g, t=t, **NEW) for g in range(4)], 4)]
    drive(pilot, all_new, ctl)
    drive(pilot, [window(lambda t: [ws(g, t=t, **NEW) for g in range(4)], 5)], ctl)
    assert pilot.state.phase == "verifying"
    filling = [window(lambda t: [ws(g, t=t, **{**NEW, "in_flight": 40}) for g in range(4)], k) for k in range(6, 16)]
    acts = drive(pilot, filling, ctl)
    (v,) = emitted(acts, "verified")
    assert v.message.startswith("unverified") and "not every server is full" in v.message


def test_a_server_that_began_serving_late_in_the_window_is_filling_not_slow():
    def make(t: float) -> list[WorkerStatus]:
        return [ws(0, t=t, in_flight=0, state="serving" if t >= 3 else "starting")]
    (v,) = classify_window(window(make)).servers
    assert v.cls == "client-bound" and v.filling
    pilot = Autopilot(Settings(), LadderConfig())
    assert not emitted(pilot.step(classify_window(window(make)), control(), 4.0), "diagnosis")


def test_a_canary_whose_worker_went_silent_is_waited_for_not_judged():
    """Its last record says serving at full capacity, but its counter is frozen: judging it would
    roll back a change that may well gain."""
    pilot = seed_pilot()
    snaps = canary_windows([2, 3, 4], tps=0)
    snaps = [[replace(s, silent=frozenset({"w0"})) for s in w] for w in snaps]
    acts = drive(pilot, [restarting(1), *snaps], control(seen_generation=1))
    assert not emitted(acts, "rollback") and not emitted(acts, "canary") and pilot.state.phase == "canary"


# --- issue 22: restart cost from what the workers measured; servers of several shapes -------------------
def test_before_any_canary_the_restart_cost_is_the_median_the_workers_measured_not_300():
    """§2: servers that start in ~2 s: the supervisor prices a restart at what its workers measured
    (start + drain, median over the canary's shape), names that figure, and switches; without the
    workers' figures it assumes 300 s and would not move on the same window."""
    def fleet(k: int, **kw) -> list[FleetSnapshot]:
        # 2,000 prompts left at 4 x 560 tok/s: ~270 s left; x1.95 saves ~130 s: worth 2 x 2.5 s, not 2 x 300 s
        return window(lambda t: [replace(ws(g, t=t, facts=SEED), **kw) for g in range(4)], k, backlog=2000)

    assumed = Autopilot(Settings(windows=1), LadderConfig())
    acts = drive(assumed, [fleet(0)])
    assert not [a for a in acts if isinstance(a, SetOverride)]
    assert "vs restart cost 300.0 s (assumed)" in emitted(acts, "decision")[0].message

    measured = Autopilot(Settings(windows=1), LadderConfig())
    acts = drive(measured, [fleet(0, start_s=2.1, shape="tp1")])
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu0"]
    (decision,) = emitted(acts, "decision")
    assert "restart cost 2.1 s (measured: start 2.1 s, no drain measured yet, median of 4 tp1 server(s))" \
        in decision.message  # the printed reason names the measured figure
    assert decision.data["restart_cost_s"] == pytest.approx(2.1)

    with_drain = Autopilot(Settings(windows=1), LadderConfig())
    rep = classify_window(fleet(0, start_s=2.0, drain_s=0.5))
    assert with_drain.restart_cost(rep, "tp1") == (pytest.approx(2.5), "measured: start 2.0 s + drain 0.5 s, "
                                                                          "median of 4 tp1 server(s)")
    # --restart-cost stays an override
    override = Autopilot(Settings(windows=1, restart_cost_s=10_000), LadderConfig())
    acts = drive(override, [fleet(0, start_s=2.0)])
    assert not [a for a in acts if isinstance(a, SetOverride)]
    assert "(--restart-cost)" in emitted(acts, "decision")[0].message


TP4 = ServerFacts(effective_max_running=64, cap_cause="kv", max_total_num_tokens=128, context_len=131072)


def mixed(t: float, *, tp1=None, tp4_tps: float = 2400.0, tp1_kw=None) -> list[WorkerStatus]:
    """One TP4 server (a dense 70B on gpu4-7, KV-capped at 64, queue gpu4) and four TP1 servers
    (gpu0-3, mamba-capped at 37): one fleet, two shapes."""
    tp1_kw = tp1_kw or {}
    out = [replace(ws(g, t=t, **{"facts": SEED, **tp1_kw.get(g, {})}), shape="tp1", start_s=2.0) for g in range(4)]
    out.append(replace(ws(4, t=t, cap=64, in_flight=64, tps=tp4_tps, kv=0.3, mamba=0.0, facts=TP4),
                       shape="tp4", start_s=60.0))
    return out


def test_a_server_is_compared_only_with_peers_of_its_shape():
    """§1: the TP4 server's capacity (64) and tokens/s (2,400) are far from the TP1 servers' (37, 560),
    and that is no fault of it: it is not an outlier. A slow TP1 server still is, among its shape."""
    slow = {3: {"tps": 300.0}}
    rep = classify_window(window(lambda t: mixed(t, tp1_kw=slow)))
    assert {v.worker: v.shape for v in rep.servers} == {"w0": "tp1", "w1": "tp1", "w2": "tp1", "w3": "tp1",
                                                        "w4": "tp4"}
    outliers = {v.worker: v.outliers for v in rep.servers if v.outliers}
    assert set(outliers) == {"w3"} and "tokens/s 300 vs peers' median 560" in outliers["w3"][0]


def test_a_fleet_of_two_shapes_moves_only_the_stalled_shape_measured_against_its_own_peers():
    """§1: one TP4 server beside four mamba-bound TP1 servers. The canary is a TP1 server; the
    prediction and the baseline capacity are the TP1 servers' own; the restart cost is the TP1
    workers' (not the 60 s TP4 start); the canary is judged against TP1 peers only; the rollout
    moves the TP1 queues only, and the TP4 server keeps its spec (no fleet-wide spec)."""
    pilot = Autopilot(Settings(windows=1, verify_windows=2, rollout_batch=2),
                      LadderConfig(forbid=frozenset({"no_radix"})))
    (decision,) = emitted(drive(pilot, [window(lambda t: mixed(t), 0)]), "decision")
    assert pilot.state.canary == "gpu0" and pilot.state.shape == "tp1"
    assert decision.data["predicted_ratio"] == pytest.approx(72 / 37, rel=1e-3)
    assert pilot.state.baseline_capacity == 37
    assert decision.data["restart_cost_s"] == pytest.approx(2.0)
    assert "of 4 tp1 server(s)" in decision.data["restart_cost"]
    ctl = control(seen_generation=1)
    new = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0, facts=NB)
    canary = {0: new}
    acts = drive(pilot, [window(lambda t: mixed(t, tp1_kw=canary), k) for k in (1, 2)], ctl)
    (verdict,) = emitted(acts, "canary")
    assert verdict.data["peers_tokens_per_s"] == pytest.approx(560, rel=0.01)  # the TP1 peers, not the TP4's 2,400
    assert [a.queue for a in acts if isinstance(a, SetOverride)] == ["gpu1", "gpu2"]
    moved = {g: new for g in range(4)}
    acts = drive(pilot, [window(lambda t: mixed(t, tp1_kw=moved), k) for k in (3, 4, 5, 6)], ctl)
    overrides = [a.queue for a in acts if isinstance(a, SetOverride)]
    assert overrides == ["gpu3"] and not [a for a in acts if isinstance(a, SetFleet)]
    (rolled,) = emitted(acts, "rolled_out")
    assert "of shape tp1" in rolled.message and "other shapes keep their spec" in rolled.message
    (verified,) = emitted(acts, "verified")
    assert verified.data["ratio"] == pytest.approx(1065 / 560, rel=0.01) and verified.data["slots"] == [72]


# --- issue 22 §4: the fleet's memory ---------------------------------------------------------------------
def kind(w: WorkerStatus, *, version: str = "0.5.23", gpu: str = "NVIDIA RTX PRO 6000", mib: int = 97887,
         shape: str = "tp1") -> WorkerStatus:
    facts = replace(w.facts or SEED, version=version)
    return replace(w, facts=facts, gpu_name=gpu, gpu_memory_mib=mib, shape=shape,
                   server_flags=["--model-path", "Qwen/Qwen3.6-27B", *w.server_flags])


def test_a_verified_move_is_remembered_by_model_gpu_version_and_shape():
    from supervisor.autopilot import Remember

    pilot = seed_pilot()
    ctl = control(seen_generation=1)
    drive(pilot, [restarting(1), *canary_windows([2, 3])], ctl)
    new = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, tps=1065.0, facts=NB)
    acts = drive(pilot, [window(lambda t: [kind(ws(g, t=t, **new)) for g in range(4)], k) for k in (4, 5, 6, 7)],
                 ctl)
    (verified,) = emitted(acts, "verified")
    (remember,) = [a for a in acts if isinstance(a, Remember)]
    (key,) = remember.entries
    assert key == '["Qwen/Qwen3.6-27B","NVIDIA RTX PRO 6000",97887,"0.5.23","tp1"]'
    entry = remember.entries[key]
    assert entry.spec == replace(NO_BUFFER, generation=0) and entry.slots == [72]
    assert entry.ratio == pytest.approx(verified.data["ratio"])


def memory(**kw) -> dict:
    from supervisor.memory import Remembered

    key = '["Qwen/Qwen3.6-27B","NVIDIA RTX PRO 6000",97887,"0.5.23","tp1"]'
    return {key: Remembered(spec=NO_BUFFER, run="yesterday", ratio=1.9, slots=[72], **kw)}


def test_a_second_run_of_the_same_kind_starts_on_the_remembered_spec_and_keeps_watching():
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1), LadderConfig(forbid=frozenset({"no_radix"})))
    starting = classify_window([snap([kind(ws(g, state="starting", facts=None)) for g in range(4)])])
    assert pilot.recall(starting, control(), memory()) == [] and not pilot.state.consulted  # wait: nothing serves
    rep = classify_window([snap([kind(ws(g, facts=SEED)) for g in range(4)])])
    acts = pilot.recall(rep, control(), memory())
    (fleet,) = [a for a in acts if isinstance(a, SetFleet)]
    assert fleet.spec == replace(NO_BUFFER, generation=1)
    (decision,) = emitted(acts, "decision")
    assert "the fleet's memory: run yesterday verified no_buffer, mem 0.9, max 128 as best, verified x1.90" in \
        decision.message and "Qwen/Qwen3.6-27B on NVIDIA RTX PRO 6000 (96 GiB), SGLang 0.5.23, tp1" in decision.message
    assert pilot.state.consulted == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert pilot.recall(rep, control(), memory()) == []  # once per server and run
    # ... and the autopilot still watches: a stall on the remembered spec is diagnosed as ever.
    on_it = dict(generation=1, strategy="no_buffer", cap=72, in_flight=72, facts=NB)
    acts = drive(pilot, [window(lambda t: [kind(ws(g, t=t, **on_it)) for g in range(4)], 1)],
                 control(fleet=replace(NO_BUFFER, generation=1), current=replace(NO_BUFFER, generation=1)))
    assert "no change to try" in emitted(acts, "decision")[0].message


@pytest.mark.parametrize("other", [{"version": "0.5.22"}, {"gpu": "NVIDIA H100 80GB HBM3"}, {"mib": 81559},
                                   {"shape": "tp2"}])
def test_another_kind_of_server_does_not_use_the_memory(other):
    pilot = Autopilot(Settings(windows=1), LadderConfig())
    rep = classify_window([snap([kind(ws(g, facts=SEED), **other) for g in range(4)])])
    assert pilot.recall(rep, control(), memory()) == [] and len(pilot.state.consulted) == 4


def test_fresh_start_ignores_the_memory_and_a_mixed_fleet_recalls_per_queue():
    rep = classify_window([snap([kind(ws(g, facts=SEED)) for g in range(4)])])
    fresh = Autopilot(Settings(windows=1, fresh_start=True), LadderConfig())
    acts = fresh.recall(rep, control(), memory())
    assert not [a for a in acts if not isinstance(a, Emit)] and "fresh start" in emitted(acts, "decision")[0].message
    tp4 = kind(ws(4, cap=64, facts=TP4), shape="tp4")
    mixed_rep = classify_window([snap([kind(ws(g, facts=SEED)) for g in range(4)] + [tp4])])
    acts = Autopilot(Settings(windows=1), LadderConfig()).recall(mixed_rep, control(), memory())
    assert [(a.queue, a.spec.strategy) for a in acts if isinstance(a, SetOverride)] == \
        [(f"gpu{g}", "no_buffer") for g in range(4)]  # the TP4 server's kind has no memory: it keeps its spec
    assert not [a for a in acts if isinstance(a, SetFleet)]


def test_a_server_that_serves_later_or_whose_worker_started_on_the_memory_is_handled_on_its_own():
    """gpu0's worker started on the remembered spec (its state dir knew its kind): nothing to do for it;
    gpu1 serves later on the default (a new host): an override moves it alone."""
    pilot = Autopilot(Settings(windows=1), LadderConfig())
    on_it = kind(ws(0, facts=NB, strategy="no_buffer", flags=["--mem-fraction-static", "0.9",
                                                             "--max-running-requests", "128"]))
    acts = pilot.recall(classify_window([snap([on_it, kind(ws(1, state="starting", facts=None))])]), control(),
                        memory())
    assert not [a for a in acts if not isinstance(a, Emit)]
    assert "1 server(s) already run no_buffer, mem 0.9, max 128" in emitted(acts, "decision")[0].message
    acts = pilot.recall(classify_window([snap([on_it, kind(ws(1, facts=SEED))])]),
                        control(overrides={}), memory())
    assert [(a.queue, a.spec.strategy, a.spec.generation) for a in acts if isinstance(a, SetOverride)] == \
        [("gpu1", "no_buffer", 1)]


# --- the prefix plan's prediction in the decision ------------------------------------------------------
def plan_window(predicted: dict[int, float], k: int = 0, *, prompt: float = 3000.0, completion: float = 64.0,
                n: int = 4) -> list[FleetSnapshot]:
    """Mamba-bound seed servers gpu0..n-1, the run's stats saying what the plan predicted for each queue
    (`plan_shared:q` of `plan_bytes:q`) and a request's prompt and completion tokens."""
    stats = {"succeeded": 1000, "completion_tokens": int(1000 * completion), "prompt_tokens": int(1000 * prompt)}
    for g, hit in predicted.items():
        stats[f"plan_bytes:gpu{g}"] = 1_000_000
        stats[f"plan_shared:gpu{g}"] = int(1_000_000 * hit)
    ts = [k * 4.0 + i for i in range(5)]
    return [FleetSnapshot(ts=t, workers=[ws(g, t=t, facts=SEED) for g in range(n)], backlog={"gpu0": 10_000},
                          stats=stats) for t in ts]


def test_a_plan_that_predicts_prefix_reuse_keeps_a_strategy_that_reuses_it():
    """Long shared prompts, short answers: no_buffer's capacity (x1.95) does not pay for prefilling
    the 75% of prompt tokens the cache would have given; extra_buffer_lazy (4 slots a request, the same
    reuse) does. The decision says what the plan predicted."""
    from supervisor.decision import Workload
    from supervisor.ladder import Reuse

    heavy = next_rung(ServerSpec(), LadderConfig(), facts=SEED, cache_hit_rate=0.7,
                      reuse=Reuse(hit=0.75, prompt_tokens=3000, completion_tokens=64))
    assert heavy.target is not None and heavy.target.strategy == "extra_buffer_lazy"
    assert "the plan predicts 75% of prompt tokens" in heavy.reasons[0] and "no_buffer x0.9" in heavy.reasons[0]
    none = next_rung(ServerSpec(), LadderConfig(), facts=SEED, cache_hit_rate=0.0,
                     reuse=Reuse(hit=0.0, prompt_tokens=3000, completion_tokens=64))
    assert none.target is not None and none.target.strategy == "no_buffer"  # nothing to lose: capacity
    assert Workload(predicted_hit=0.5, prompt_tokens=None, completion_tokens=64).reuse is None  # tokens unknown

    pilot = Autopilot(Settings(windows=1, restart_cost_s=1), LadderConfig(forbid=frozenset({"no_radix"})))
    acts = drive(pilot, [plan_window({g: 0.75 for g in range(4)})])
    (override,) = [a for a in acts if isinstance(a, SetOverride)]
    assert override.spec.strategy == "extra_buffer_lazy"
    (decision,) = emitted(acts, "decision")
    assert "the plan predicted 75%" in decision.message and decision.data["predicted_hit"] == pytest.approx(0.75)


def test_no_rung_is_tried_when_the_plan_predicts_every_one_would_lose_its_reuse():
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1),
                      LadderConfig(forbid=frozenset({"no_radix", "extra_buffer_lazy"})))
    acts = drive(pilot, [plan_window({g: 0.8 for g in range(4)})])
    assert not [a for a in acts if isinstance(a, SetOverride)]
    (decision,) = emitted(acts, "decision")
    assert "no change to try" in decision.message and "keeping default" in decision.message
    assert "the plan predicts 80%" in decision.message


def test_servers_whose_queues_the_plan_predicts_other_work_for_keep_their_spec():
    """gpu0, gpu1 get prompts sharing long prefixes (75% predicted), gpu2, gpu3 none: no_buffer is the
    change for gpu2 and gpu3 only; gpu0 and gpu1 keep extra_buffer, and the rollout ends per queue."""
    pilot = Autopilot(Settings(windows=1, restart_cost_s=1, verify_windows=1, rollout_batch=4),
                      LadderConfig(forbid=frozenset({"no_radix", "extra_buffer_lazy"})))
    predicted = {0: 0.75, 1: 0.75, 2: 0.0, 3: 0.0}
    acts = drive(pilot, [plan_window(predicted)])
    (override,) = [a for a in acts if isinstance(a, SetOverride)]
    assert override.queue == "gpu2" and override.spec.strategy == "no_buffer"
    (decision,) = emitted(acts, "decision")
    assert "gpu0, gpu1 keep their spec" in decision.message and decision.data["keep"] == ["gpu0", "gpu1"]
    assert pilot.state.keep == ["gpu0", "gpu1"]
