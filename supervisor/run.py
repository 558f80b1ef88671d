"""`supervisor run`: sample the fleet, classify each window, let the autopilot decide, apply its
actions to Redis, and keep the record (events, a history stream for `supervisor report`, Prometheus).
Also the operator's `supervisor restart`."""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
import redis

from batchfleet import keys
from batchfleet.config import DEFAULT_QUEUE_PATTERN
from batchfleet.keys import Keys
from batchfleet.records import Event, RecordError, ServerSpec

from .autopilot import Autopilot, Control, Emit, SetFleet, SetOverride, Settings, State
from .classify import Thresholds, WindowReport, classify_window, server_tokens_per_s
from .fleet import FleetSnapshot, read_fleet, skip_record
from .ladder import LadderConfig, current_spec
from .prom import FleetMetrics

__all__ = ["apply", "log_event", "manual_restart", "read_control", "run_autopilot"]

WORKER_FIELD = Keys.control_worker("")


def read_control(r: redis.Redis, k: Keys, snap: FleetSnapshot) -> Control:
    """The control hash; a field that does not hold a valid spec is ignored (workers refuse it too)."""
    raw = {f.decode(): v for f, v in r.hgetall(k.control).items()}
    specs: dict[str, ServerSpec] = {}
    for name, value in raw.items():
        try:
            specs[name] = ServerSpec.from_json(value)
        except RecordError as exc:
            skip_record(f"control field {name!r}", exc)
    fleet = specs.get(Keys.CONTROL_FLEET)
    overrides = {f[len(WORKER_FIELD):]: v for f, v in specs.items() if f.startswith(WORKER_FIELD)}
    return Control(fleet=fleet, overrides=overrides, current=current_spec(fleet, snap.workers),
                   seen_generation=max((w.generation for w in snap.workers), default=0))


def log_event(r: redis.Redis, k: Keys, event: Event) -> None:
    r.xadd(k.events, {"e": event.to_json()}, maxlen=keys.EVENTS_MAXLEN, approximate=True)


def apply(r: redis.Redis, k: Keys, actions: list, *, say: Callable[[str], None] = print) -> None:
    """Write the autopilot's actions: specs first, so an event never announces what Redis lacks."""
    for a in actions:
        if isinstance(a, SetOverride):
            r.hset(k.control, Keys.control_worker(a.worker), a.spec.to_json())
        elif isinstance(a, SetFleet):
            stale = [f for f in r.hkeys(k.control) if f.decode().startswith(WORKER_FIELD)]
            pipe = r.pipeline(transaction=True)  # one step: no worker sees the fleet spec and an old override
            pipe.hset(k.control, Keys.CONTROL_FLEET, a.spec.to_json())
            if stale:
                pipe.hdel(k.control, *stale)
            pipe.execute()
    for a in actions:
        if isinstance(a, Emit):
            log_event(r, k, a.event)
            say(f"{time.strftime('%H:%M:%S', time.localtime(a.event.ts))} {a.event.kind}: {a.event.message}")


def history_sample(snap: FleetSnapshot, classes: dict[str, str]) -> bytes:
    """One point of the report's time series (server-reported tokens/s, and the worker's wall-clock figure)."""
    fleet = sum(server_tokens_per_s(w) for w in snap.workers if w.state == "serving")
    return orjson.dumps({
        "ts": snap.ts, "tokens_per_s": round(fleet, 1),
        "wall_tokens_per_s": round(snap.tokens_per_s, 1), "backlog": snap.total_backlog,
        "done": snap.stats.get("succeeded", 0),
        "gpus": {w.worker: {"gpu": w.gpu, "in_flight": w.in_flight, "effective_max": w.effective_max,
                            "state": w.state, "strategy": w.strategy, "class": classes.get(w.worker, "")}
                 for w in snap.workers}})


def run_autopilot(r: redis.Redis, k: Keys, *, settings: Settings, ladder: LadderConfig,
                  thresholds: Thresholds | None = None, window_s: float = 10.0, sample_s: float = 1.0,
                  queue_pattern: str = DEFAULT_QUEUE_PATTERN, metrics: FleetMetrics | None = None,
                  say: Callable[[str], None] = print, should_stop: Callable[[], bool] = lambda: False) -> None:
    """The loop. State lives in Redis (`Keys.autopilot`), so a restarted supervisor carries on."""
    pilot = Autopilot(settings, ladder, State.from_json(r.get(k.autopilot)))
    say(f"supervisor: {'advising (dry run)' if settings.dry_run else 'autopilot on'}; window {window_s:g} s, "
        f"act after {settings.windows} stalled windows; phase {pilot.state.phase}; "
        f"failed before: {', '.join(pilot.state.failed) or 'none'}")
    window: list[FleetSnapshot] = []
    started = time.monotonic()
    while not should_stop():
        snap = read_fleet(r, k, queue_pattern=queue_pattern, events=20)
        window.append(snap)
        r.xadd(k.history, {"s": history_sample(snap, pilot.state.classes)}, maxlen=keys.HISTORY_MAXLEN,
               approximate=True)
        report: WindowReport | None = None
        if time.monotonic() - started >= window_s and snap.workers:
            report = classify_window(window, thresholds)
            actions = pilot.step(report, read_control(r, k, snap), snap.ts)  # Redis's clock, as the state's times
            apply(r, k, actions, say=say)
            r.set(k.autopilot, pilot.state.to_json())
            window, started = [snap], time.monotonic()  # windows share their edge sample
        if metrics is not None:
            metrics.update(snap, report, pilot.state)
        time.sleep(sample_s)


def manual_restart(r: redis.Redis, k: Keys, spec: ServerSpec, *, canary: str | None = None,
                   queue_pattern: str = DEFAULT_QUEUE_PATTERN) -> ServerSpec:
    """Write `spec` with the next generation: for one worker (canary) or the whole fleet."""
    snap = read_fleet(r, k, queue_pattern=queue_pattern, events=1)
    control = read_control(r, k, snap)
    spec = ServerSpec(generation=control.next_generation(), strategy=spec.strategy,
                      mem_fraction_static=spec.mem_fraction_static, max_running_requests=spec.max_running_requests)
    if canary is not None:
        apply(r, k, [SetOverride(canary, spec)], say=lambda _: None)
        what = f"operator: canary {canary} -> {spec.describe()} (generation {spec.generation})"
    else:
        apply(r, k, [SetFleet(spec)], say=lambda _: None)
        what = f"operator: fleet -> {spec.describe()} (generation {spec.generation})"
    log_event(r, k, Event(kind="manual", message=what, source="supervisor",
                          data={"spec": orjson.loads(spec.to_json()), "canary": canary,
                                "previous": control.current.describe()}))
    return spec
