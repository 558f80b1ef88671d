"""The autopilot loop (`supervisor watch`, `supervisor run`): sample the fleet, classify each window,
let the autopilot decide, apply its actions to Redis, and keep the record (events, a history stream
for `supervisor report`, Prometheus). Also the operator's `supervisor restart`.

Redis may go away (a restart, a failover, a network blip): the loop says so in one line, keeps its
state in memory, retries, and says one line when Redis is back. A window that spans an outage is not
a window. If Redis came back without the supervisor's state (restarted without persistence), the
state and the control specs the autopilot owns are written back from memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import orjson
import redis

from batchfleet import keys
from batchfleet.config import DEFAULT_QUEUE_PATTERN
from batchfleet.keys import Keys
from batchfleet.records import Event, EventKind, RecordError, ServerSpec

from .autopilot import (
    Action,
    Autopilot,
    Control,
    DropFields,
    Emit,
    PilotState,
    Remember,
    SetFleet,
    SetOverride,
    Settings,
)
from .classify import Thresholds, WindowReport, classify_window
from .fleet import FleetSnapshot, read_events, read_fleet, skip_record
from .ladder import LadderConfig, current_spec
from .memory import parse_memory
from .prom import FleetMetrics

__all__ = ["RedisWatch", "apply", "history_sample", "log_event", "manual_restart", "read_control", "run_autopilot"]

OVERRIDE_PREFIXES = (Keys.CONTROL_QUEUE_PREFIX, Keys.CONTROL_WORKER_PREFIX)
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError)


def read_control(r: redis.Redis, k: Keys, snap: FleetSnapshot) -> Control:
    """The control hash; a field that does not hold a valid spec is ignored (workers refuse it too)."""
    raw = {f.decode(): v for f, v in r.hgetall(k.control).items()}
    specs: dict[str, ServerSpec] = {}
    for name, value in raw.items():
        if name == Keys.CONTROL_FRESH:
            continue  # not a spec: workers start without the fleet's memory
        try:
            specs[name] = ServerSpec.from_json(value)
        except RecordError as exc:
            skip_record(f"control field {name!r}", exc)
    fleet = specs.get(Keys.CONTROL_FLEET)
    q, w = Keys.CONTROL_QUEUE_PREFIX, Keys.CONTROL_WORKER_PREFIX
    return Control(fleet=fleet, overrides={f[len(q):]: v for f, v in specs.items() if f.startswith(q)},
                   legacy={f[len(w):]: v for f, v in specs.items() if f.startswith(w)},
                   current=current_spec(fleet, snap.workers),
                   seen_generation=max((w.generation for w in snap.workers), default=0))


def log_event(r: redis.Redis, k: Keys, event: Event) -> None:
    r.xadd(k.events, {"e": event.to_json()}, maxlen=keys.EVENTS_MAXLEN, approximate=True)


def apply(r: redis.Redis, k: Keys, actions: Sequence[Action], *, say: Callable[[str], None] = print,
          state: PilotState | None = None) -> None:
    """Write the autopilot's actions: specs first, so an event never announces what Redis lacks.
    `state.control` keeps what was written, to restore it after Redis lost its data."""
    written = state.control if state is not None else {}
    for a in actions:
        if isinstance(a, SetOverride):
            field = Keys.control_queue(a.queue)
            r.hset(k.control, field, a.spec.to_json())
            written[field] = a.spec.to_json().decode()
        elif isinstance(a, SetFleet):
            stale = [f for f in r.hkeys(k.control) if f.decode().startswith(OVERRIDE_PREFIXES)]
            pipe = r.pipeline(transaction=True)  # one step: no worker sees the fleet spec and an old override
            pipe.hset(k.control, Keys.CONTROL_FLEET, a.spec.to_json())
            if stale:
                pipe.hdel(k.control, *stale)
            pipe.execute()
            written.clear()
            written[Keys.CONTROL_FLEET] = a.spec.to_json().decode()
        elif isinstance(a, DropFields):
            r.hdel(k.control, *a.fields)
            for f in a.fields:
                written.pop(f, None)
        elif isinstance(a, Remember):
            r.hset(Keys.MEMORY, mapping={f: replace(e, run=k.run).to_json() for f, e in a.entries.items()})
    for a in actions:
        if isinstance(a, Emit):
            log_event(r, k, a.event)
            say(f"{time.strftime('%H:%M:%S', time.localtime(a.event.ts))} {a.event.kind}: {a.event.message}")


def history_sample(snap: FleetSnapshot, classes: dict[str, str]) -> bytes:
    """One point of the report's time series: the fleet's tokens/s (`FleetView.tokens_per_s`), backlog,
    and each GPU's."""
    return orjson.dumps({
        "ts": snap.ts, "tokens_per_s": round(snap.tokens_per_s, 1), "backlog": snap.total_backlog,
        "done": snap.stats.get("succeeded", 0),
        "gpus": {w.worker: {"gpu": w.gpu, "host": w.host, "queue": w.queue, "in_flight": w.in_flight,
                            "effective_max": w.effective_max, "state": w.state, "strategy": w.strategy,
                            "class": classes.get(w.worker, "")}
                 for w in snap.workers}})


class RedisWatch:
    """One line when Redis is lost, one when it is back; nothing in between."""

    def __init__(self, url: str, say: Callable[[str], None]) -> None:
        self.url = url
        self.say = say
        self.lost_since: float | None = None

    def lost(self, exc: BaseException) -> None:
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            self.say(f"supervisor: lost Redis at {self.url} ({type(exc).__name__}: {str(exc)[:120]}); keeping "
                     "state, retrying")

    def ok(self) -> bool:
        """True when this is the first success after an outage."""
        if self.lost_since is None:
            return False
        self.say(f"supervisor: Redis at {self.url} is back after {time.monotonic() - self.lost_since:.0f} s")
        self.lost_since = None
        return True


def _restore(r: redis.Redis, k: Keys, state: PilotState, say: Callable[[str], None]) -> None:
    """After an outage: if Redis lost the autopilot's state, write it back with the specs we own."""
    if r.exists(k.autopilot):
        return
    say("supervisor: Redis came back without the autopilot's state (restarted without persistence?): "
        f"restoring it from memory (phase {state.phase}, {len(state.control)} control field(s))")
    if state.control:
        r.hset(k.control, mapping={f: v.encode() for f, v in state.control.items()})
    r.set(k.autopilot, state.to_json())


def _write_fresh(r: redis.Redis, k: Keys, say: Callable[[str], None]) -> None:
    try:
        r.hset(k.control, Keys.CONTROL_FRESH, b"1")
    except REDIS_DOWN as exc:
        say(f"supervisor: could not tell the workers to start fresh ({type(exc).__name__}): they may start on the "
            "fleet's memory")


def run_autopilot(r: redis.Redis, k: Keys, *, settings: Settings, ladder: LadderConfig,
                  thresholds: Thresholds | None = None, window_s: float = 10.0, sample_s: float = 1.0,
                  queue_pattern: str = DEFAULT_QUEUE_PATTERN, metrics: FleetMetrics | None = None,
                  say: Callable[[str], None] = print, should_stop: Callable[[], bool] = lambda: False,
                  show: Callable[[FleetSnapshot, WindowReport | None, PilotState], None] | None = None,
                  redis_label: str = "") -> None:
    """The loop. Its state lives in Redis (`Keys.autopilot`) and in memory, so a restarted supervisor
    carries on, and an outage of Redis costs nothing but the windows it spans."""
    watch = RedisWatch(redis_label or "Redis", say)
    state: PilotState | None = None
    while state is None and not should_stop():
        try:
            state = PilotState.from_json(r.get(k.autopilot))
            last_event = r.xrevrange(k.events, count=1)
        except REDIS_DOWN as exc:
            watch.lost(exc)
            time.sleep(min(5.0, sample_s * 2))
            continue
        watch.ok()
    if state is None:
        return
    pilot = Autopilot(settings, ladder, state)
    if settings.fresh_start:  # workers too: none starts on the fleet's memory (worker/spec.py)
        _write_fresh(r, k, say)
    say(f"supervisor: {'advising (dry run)' if settings.dry_run else 'autopilot on'}; window {window_s:g} s, "
        f"act after {settings.static_windows} window(s) on start-up facts or {settings.windows} on gauges; "
        f"phase {pilot.state.phase}; back-offs: {', '.join(pilot.state.tried) or 'none'}")
    after_id = last_event[0][0] if last_event else b"0-0"
    window: list[FleetSnapshot] = []
    started = time.monotonic()
    report: WindowReport | None = None
    while not should_stop():
        try:
            snap = read_fleet(r, k, queue_pattern=queue_pattern, events=20)
            if watch.ok():
                _restore(r, k, pilot.state, say)
            window.append(snap)
            if not pilot.state.recalled and snap.workers:  # the fleet's memory, as soon as servers say what they are
                actions = pilot.recall(classify_window([snap], thresholds), read_control(r, k, snap),
                                       parse_memory(r.hgetall(Keys.MEMORY)))
                if actions or pilot.state.recalled:
                    apply(r, k, actions, say=say, state=pilot.state)
                    r.set(k.autopilot, pilot.state.to_json())
            r.xadd(k.history, {"s": history_sample(snap, pilot.state.classes)}, maxlen=keys.HISTORY_MAXLEN,
                   approximate=True)
            if time.monotonic() - started >= window_s and snap.workers:
                entries = r.xrange(k.events, min=b"(" + after_id)
                if entries:
                    after_id = entries[-1][0]
                report = classify_window(window, thresholds)
                actions = pilot.step(report, read_control(r, k, snap), snap.ts,  # Redis's clock
                                    read_events(entries[::-1]))
                apply(r, k, actions, say=say, state=pilot.state)
                r.set(k.autopilot, pilot.state.to_json())
                window, started = [snap], time.monotonic()  # windows share their edge sample
            if metrics is not None:
                metrics.update(snap, report, pilot.state)
            if show is not None:
                show(snap, report, pilot.state)
        except REDIS_DOWN as exc:
            watch.lost(exc)
            window, started = [], time.monotonic()  # a window that spans an outage is not a window
        time.sleep(sample_s)


def manual_restart(r: redis.Redis, k: Keys, spec: ServerSpec, *, canary: str | None = None,
                   queue_pattern: str = DEFAULT_QUEUE_PATTERN) -> ServerSpec:
    """Write `spec` with the next generation: for one GPU (canary: its queue, or a worker's name) or
    the whole fleet."""
    snap = read_fleet(r, k, queue_pattern=queue_pattern, events=1)
    control = read_control(r, k, snap)
    spec = ServerSpec(generation=control.next_generation(), strategy=spec.strategy,
                      mem_fraction_static=spec.mem_fraction_static, max_running_requests=spec.max_running_requests)
    if canary is not None:
        queue = next((w.queue for w in snap.workers if canary in (w.worker, w.queue)), canary)
        apply(r, k, [SetOverride(queue, spec)], say=lambda _: None)
        what = f"operator: canary {queue} -> {spec.describe()} (generation {spec.generation})"
    else:
        apply(r, k, [SetFleet(spec)], say=lambda _: None)
        what = f"operator: fleet -> {spec.describe()} (generation {spec.generation})"
    log_event(r, k, Event(kind=EventKind.MANUAL, message=what, source="supervisor",
                          data={"spec": orjson.loads(spec.to_json()), "canary": canary,
                                "previous": control.current.describe()}))
    return spec
