"""The autopilot's state machine. Pure: it gets one classified window at a time (and the events seen
since the last one) and answers with actions (write a spec, drop stale overrides, emit an event);
`run.py` applies them to Redis.

    observing ──stalled (1 window on start-up facts, N on gauges), a rung, worth it──▶ canary
        ▲                                  (--dry-run: advice only)                       │
        │            ┌─────── gained (steady windows, same-window peers, bar) ────────────┘
        │            ▼                                     not gained / down / timed out (back-off)
        │       rolling_out ── a few at a time; absent workers do not block; timeout: carry on
        │            ▼
        └──── verifying ── steady windows after every server filled; timeout: say so
        └──────────────── rolled back: the rung may be retried after a back-off, with a higher bar

**Steady windows only.** The canary is judged on samples taken after its worker filled it to its new
capacity, against its peers over the very same intervals (both feel the same CPU contention, the same
Redis); a window where the canary or every peer is not full is *confounded*: not measured, and the
autopilot measures longer rather than roll back. Rates are the servers' own generation counters over
those intervals (each worker's counter paired with its own clock).

**Stable identity.** Overrides are keyed by queue (`queue:<queue>`): a GPU's identity in the run,
which survives a worker killed and restarted under a new name. Generations only ever increase: the
canary and each rolled-out queue get an override with the new generation; when all present servers
serve it, the same spec becomes the fleet's and the overrides go. A rollback writes the old spec
under a newer generation to the queues that moved. Every phase has a timeout.

**Learned cost.** The worth-it test (time saved ≥ factor × one server's restart cost) starts from
`--restart-cost` and switches to what the canary's restart measured (its downtime plus its time to
fill again) as soon as there is one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any

import orjson

from batchfleet.backoff import backoff_s
from batchfleet.keys import Keys
from batchfleet.records import Event, EventKind, RecordError, ServerSpec, decode

from .classify import CLIENT_BOUND, DOWN, HUNG, KV_BOUND, MAMBA_BOUND, SILENT, ServerView, WindowReport
from .ladder import LadderConfig, next_rung, spec_key
from .memory import Remembered, describe_field, memory_field, remembered_data

__all__ = ["Autopilot", "Control", "DropFields", "Emit", "Phase", "Remember", "SetFleet", "SetOverride", "Settings",
           "State"]

PROBLEMS = (CLIENT_BOUND, HUNG, DOWN, KV_BOUND, SILENT)  # worth a diagnosis line when a server enters one


class Phase(StrEnum):
    OBSERVING = "observing"
    CANARY = "canary"
    ROLLING_OUT = "rolling_out"
    VERIFYING = "verifying"


@dataclass(frozen=True, slots=True)
class Settings:
    windows: int = 3  # consecutive mamba-bound windows (most serving servers) when only gauges say so
    static_windows: int = 1  # ... when the servers' start-up facts say their mamba pool caps them
    dry_run: bool = False
    # One server's restart cost, an override (`--restart-cost`) until the canary measured one; None:
    # the median of what the workers of the canary's shape measured (start + drain), else ASSUMED_COST_S.
    restart_cost_s: float | None = None
    fresh_start: bool = False  # ignore the fleet's memory (`--fresh-start`)
    worth_factor: float = 2.0  # the time saved must exceed the restart cost this many times
    margin: float = 0.2  # the canary must beat its peers' tokens/s by this share (first try)
    margin_step: float = 0.1  # each rollback of a rung that did not gain raises its bar by this
    verify_windows: int = 2  # windows of steady measurement for the canary and after the rollout
    rollout_batch: int = 2  # servers restarting at once during the rollout
    phase_timeout_s: float = 900.0  # canary to serve and measure, rollout progress, verification
    retry_after_s: float = 600.0  # back-off before a rolled-back rung is tried again (doubles per failure)


ASSUMED_COST_S = 300.0  # a real 27B load, when no worker published how long its server takes


@dataclass(frozen=True, slots=True)
class Control:
    """What the control hash holds now, and what the fleet runs (see ladder.current_spec)."""

    fleet: ServerSpec | None
    overrides: dict[str, ServerSpec]  # queue -> spec
    current: ServerSpec
    seen_generation: int = 0  # the highest generation any worker reports
    legacy: dict[str, ServerSpec] = field(default_factory=dict)  # worker name -> spec (older supervisors)

    def next_generation(self) -> int:
        gens = [self.seen_generation, self.current.generation, *(s.generation for s in self.overrides.values()),
                *(s.generation for s in self.legacy.values())]
        if self.fleet is not None:
            gens.append(self.fleet.generation)
        return max(gens) + 1


@dataclass(frozen=True, slots=True)
class SetOverride:
    queue: str
    spec: ServerSpec


@dataclass(frozen=True, slots=True)
class SetFleet:
    spec: ServerSpec  # becomes field `fleet`; every per-queue (and legacy per-worker) override is removed


@dataclass(frozen=True, slots=True)
class DropFields:
    fields: tuple[str, ...]  # control hash fields to delete (stale overrides)


@dataclass(frozen=True, slots=True)
class Emit:
    event: Event


@dataclass(frozen=True, slots=True)
class Remember:
    entries: dict[str, Remembered]  # the fleet's memory (`Keys.MEMORY`): memory_field -> the verified spec


Action = SetOverride | SetFleet | DropFields | Emit | Remember


@dataclass
class State:
    """Everything the autopilot remembers; stored in Redis so a restarted supervisor carries on."""

    phase: str = Phase.OBSERVING
    stall: int = 0
    stall_since: float = 0.0
    fleet_tps: list[float] = field(default_factory=list)  # recent windows' fleet tokens/s, newest last
    server_tps: list[float] = field(default_factory=list)  # recent windows' per-server mean tokens/s
    baseline: dict[str, Any] | None = None  # ServerSpec before the change
    target: dict[str, Any] | None = None  # ServerSpec being tried
    predicted: float = 1.0
    bar: float = 0.2  # the canary's margin on this try
    canary: str = ""  # its queue
    canary_label: str = ""  # gpuN, for people
    phase_since: float = 0.0
    progress_since: float = 0.0
    served_since: float = 0.0  # the canary (or the fleet, verifying) first seen serving the target; 0: not yet
    measured: list[list[float]] = field(default_factory=list)  # [seconds, canary or fleet rate, peers' rate]
    confounded: str = ""  # why the last window was not measured
    baseline_capacity: float = 0.0
    before_tps: float = 0.0  # fleet tokens/s in the stalled windows; once a canary gained, its peers' x servers
    before_server_tps: float = 0.0  # per server; once a canary gained, its peers' steady rate beside it
    decide_s: float = 0.0
    rolled: list[str] = field(default_factory=list)  # queues given the target
    tried: dict[str, dict[str, Any]] = field(default_factory=dict)  # spec_key -> tries, until, bar, why
    restart_costs: list[float] = field(default_factory=list)  # learned: downtime + time to fill, seconds
    canary_restart: dict[str, float] = field(default_factory=dict)  # its restarted event: ts, downtime_s
    notes: dict[str, str] = field(default_factory=dict)  # last diagnosis per topic: say things once
    classes: dict[str, str] = field(default_factory=dict)  # last window's class per worker (for watch)
    control: dict[str, str] = field(default_factory=dict)  # control fields we last wrote (restored after data loss)
    shape: str = ""  # the canary's shape: the change is measured, rolled out and verified among that shape
    recalled: bool = False  # the fleet's memory is not to be consulted (again) in this run (see `recall`)
    consulted: list[str] = field(default_factory=list)  # queues whose servers the memory was consulted for

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> State:
        """The stored state; fields of another version are ignored, a state that does not decode is
        started over (said once by the caller) rather than stopping the supervisor."""
        if not raw:
            return cls()
        try:
            return decode(cls, orjson.loads(raw))
        except (RecordError, orjson.JSONDecodeError):
            return cls()


def _order(v: ServerView) -> tuple[int, str, str]:
    return (v.gpu if v.gpu is not None else 1 << 30, v.host, v.queue)


def _when(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class Autopilot:
    def __init__(self, settings: Settings, ladder: LadderConfig, state: State | None = None) -> None:
        self.s = settings
        self.ladder = ladder
        self.state = state or State()
        self._out: list[Action] = []
        self._phases: dict[str, Callable[[WindowReport, Control, float], None]] = {
            Phase.OBSERVING: self._observing, Phase.CANARY: self._canary,
            Phase.ROLLING_OUT: self._rolling_out, Phase.VERIFYING: self._verifying}

    def step(self, report: WindowReport, control: Control, now: float,
             events: Sequence[Event] = ()) -> list[Action]:
        """One window: learn from events, diagnose, then advance the state machine."""
        self._out = []
        st = self.state
        st.classes = {v.worker: str(v.cls) for v in report.servers}
        st.fleet_tps = [*st.fleet_tps, report.fleet_tokens_per_s][-max(self.s.windows, 3):]
        serving = report.serving
        st.server_tps = [*st.server_tps, statistics.fmean(v.tokens_per_s for v in serving) if serving else 0.0
                         ][-max(self.s.windows, 3):]
        self._learn(report, events)
        self._diagnose(report)
        self._drop_stale(report, control)
        self._phases.get(st.phase, self._observing)(report, control, now)
        return self._out

    def restart_cost_s(self, report: WindowReport | None = None, shape: str = "") -> float:
        return self.restart_cost(report, shape)[0]

    def restart_cost(self, report: WindowReport | None = None, shape: str = "") -> tuple[float, str]:
        """(one server's restart cost, where it comes from). In order: what the canary's restart measured
        (median, once there is one); `--restart-cost`; the median of what the workers of `shape` measured
        (their servers' last start, launch to healthy, plus their last drain); ASSUMED_COST_S."""
        st = self.state
        if st.restart_costs:
            return statistics.median(st.restart_costs), "measured by the canary"
        if self.s.restart_cost_s is not None:
            return self.s.restart_cost_s, "--restart-cost"
        peers = [v for v in (report.servers if report is not None else []) if not shape or v.shape == shape]
        starts = [v.start_s for v in peers if v.start_s is not None]
        if not starts:
            return ASSUMED_COST_S, "assumed"
        drains = [v.drain_s for v in peers if v.drain_s is not None]
        start, drain = statistics.median(starts), statistics.median(drains) if drains else 0.0
        of = f"{len(starts)} {shape + ' ' if shape else ''}server(s)"
        how = (f"measured: start {start:.1f} s" + (f" + drain {drain:.1f} s" if drains else ", no drain measured yet")
               + f", median of {of}")
        return start + drain, how

    def recall(self, report: WindowReport, control: Control, memory: dict[str, Remembered]) -> list[Action]:
        """Each server once per run, as soon as it serves and has said what it is: start it on the spec an
        earlier run verified as best for its kind (model, GPU, SGLang version, shape), if any, and if its
        worker did not already start on it. Not a canary (it was verified); the autopilot goes on
        watching and may move again."""
        self._out = []
        st = self.state
        if st.recalled:
            return []
        if not st.consulted and (self.s.fresh_start or control.fleet is not None or control.overrides):
            st.recalled = True  # asked to start fresh, or this run's control already says what to run
            if self.s.fresh_start:
                self._emit(EventKind.DECISION, "fresh start: the fleet's memory of earlier runs is not used")
            return self._out
        present = [v for v in report.servers if v.cls != SILENT]
        new = [v for v in present if v.serving and v.facts is not None and v.queue not in st.consulted]
        if not new:
            return []
        first = not st.consulted
        st.consulted = [*st.consulted, *(v.queue for v in new)]
        fields = {v.queue: memory_field(v) for v in new}
        found = {q: memory[f] for q, f in fields.items() if f is not None and f in memory}
        mine = {v.queue: spec_key(v.spec or control.current) for v in new}  # what each runs now
        moved = {q: e for q, e in found.items() if spec_key(e.spec) != mine[q]}
        if not moved:
            if found:
                entry = next(iter(found.values()))
                self._emit(EventKind.DECISION, f"the fleet's memory: {len(found)} server(s) already run "
                           f"{entry.spec.describe()}, which run {entry.run or '?'} verified as best (their workers "
                           "started on it)", recalled=True,
                           remembered={q: remembered_data(e) for q, e in found.items()})
            return self._out
        gen = control.next_generation()
        specs = {spec_key(e.spec) for e in moved.values()}
        entry = next(iter(moved.values()))
        where = "; ".join(sorted({describe_field(fields[q] or "") for q in moved}))
        if first and len(moved) == len(present) and len(specs) == 1:
            spec = replace(entry.spec, generation=gen)
            self._out.append(SetFleet(spec))
            what = f"the fleet -> {spec.describe()} (generation {gen})"
        else:
            for q, e in sorted(moved.items()):
                self._out.append(SetOverride(q, replace(e.spec, generation=gen)))
            what = ", ".join(f"{q} -> {e.spec.describe()}" for q, e in sorted(moved.items())) + f" (generation {gen})"
        ratio = f", verified x{entry.ratio:.2f} per server" if entry.ratio else ""
        self._emit(EventKind.DECISION, f"the fleet's memory: run {entry.run or '?'} verified {entry.spec.describe()} "
                   f"as best{ratio} for {where}; starting on it: {what} (--fresh-start ignores this)",
                   remembered={q: remembered_data(e) for q, e in moved.items()}, recalled=True, generation=gen)
        return self._out

    # --- helpers -------------------------------------------------------------------------------
    def _emit(self, kind: EventKind, message: str, **data: Any) -> None:
        self._out.append(Emit(Event(kind=kind, message=message, source="supervisor", data=data)))

    def _note(self, topic: str, key: str, kind: EventKind, message: str, **data: Any) -> None:
        """Emit only when what there is to say on `topic` changed in substance (`key`, not the figures
        in `message`), so a steady state is said once."""
        if self.state.notes.get(topic) != key:
            self.state.notes[topic] = key
            self._emit(kind, message, **data)

    def _learn(self, report: WindowReport, events: Sequence[Event]) -> None:
        st = self.state
        if st.phase != Phase.CANARY or not st.target:
            return
        gen = ServerSpec(**st.target).generation
        names = {v.worker: v.queue for v in report.servers}
        for e in events:
            if e.kind is not EventKind.RESTARTED or e.data.get("generation") != gen:
                continue
            queue = e.data.get("queue") or names.get(e.source)
            if queue == st.canary and isinstance(e.data.get("downtime_s"), int | float):
                st.canary_restart = {"ts": e.ts, "downtime_s": float(e.data["downtime_s"])}

    def _diagnose(self, report: WindowReport) -> None:
        for v in report.servers:
            problem = v.cls in PROBLEMS and not v.filling
            text = f"{v.label}: {v.cls}: {'; '.join(v.reasons)}" if problem else ""
            if v.outliers:
                text += ("; " if text else f"{v.label}: ") + "far from its peers: " + "; ".join(v.outliers)
            if not text:
                self.state.notes.pop(v.worker, None)
                continue
            key = "|".join([v.cls if problem else "", *(o.split(" ")[0] for o in v.outliers)])
            self._note(v.worker, key, EventKind.DIAGNOSIS, text, worker=v.worker, queue=v.queue, cls=str(v.cls),
                       reasons=v.reasons, outliers=v.outliers, ours=v.cls == CLIENT_BOUND)
        for host, why in report.hosts.items():
            self._note("host:" + host, "|".join(w.split(":")[0] for w in why), EventKind.DIAGNOSIS,
                       f"host {host}: slower than the other hosts: " + "; ".join(why), host=host, reasons=why)
        for topic in [t for t in self.state.notes if t.startswith("host:") and t[5:] not in report.hosts]:
            self.state.notes.pop(topic)

    def _drop_stale(self, report: WindowReport, control: Control) -> None:
        """Overrides for queues no worker serves any more (their records expired) and not part of the
        change in progress; legacy per-worker-name overrides of workers that are gone."""
        st = self.state
        live_queues = {v.queue for v in report.servers}
        live_workers = {v.worker for v in report.servers}
        busy = set(st.rolled) | ({st.canary} if st.phase != Phase.OBSERVING else set())
        stale = [Keys.control_queue(q) for q in control.overrides if q not in live_queues and q not in busy]
        stale += [Keys.control_worker(w) for w in control.legacy if w not in live_workers]
        if stale:
            self._out.append(DropFields(tuple(sorted(stale))))
            self._emit(EventKind.DECISION, f"removed {len(stale)} stale override(s) ({', '.join(sorted(stale))}): "
                       "no worker serves them any more", removed=sorted(stale))

    @staticmethod
    def _seen(report: WindowReport) -> dict[str, Any]:
        return {"classes": report.by_class(), "backlog": report.backlog, "eta_s": report.eta_s,
                "fleet_tokens_per_s": round(report.fleet_tokens_per_s, 1)}

    def _reset(self) -> None:
        st = self.state
        st.phase, st.stall, st.canary, st.rolled = Phase.OBSERVING, 0, "", []
        st.measured, st.served_since, st.confounded, st.canary_restart = [], 0.0, "", {}
        st.shape = ""

    def _mine(self, v: ServerView) -> bool:
        """Of the shape the change in progress is about (any, for a state of an older supervisor)."""
        return not self.state.shape or v.shape == self.state.shape

    def _mixed(self, report: WindowReport) -> bool:
        return any(not self._mine(v) for v in report.servers if v.cls != SILENT)

    def _of_shape(self, report: WindowReport) -> str:
        return f" of shape {self.state.shape}" if self._mixed(report) else ""

    def _timed_out(self, since: float, now: float) -> bool:
        return now - since > self.s.phase_timeout_s

    # --- phases ----------------------------------------------------------------------------------
    def _observing(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        if not report.majority(MAMBA_BOUND):
            st.stall = 0
            return
        st.stall += 1
        if st.stall == 1:
            st.stall_since = report.start
        stalled = sorted((v for v in report.serving if v.cls == MAMBA_BOUND), key=_order)
        static = all(v.evidence == "static" for v in stalled)
        needed = self.s.static_windows if static else self.s.windows
        evidence = "start-up facts" if static else "gauges"
        if st.stall < needed:
            self._emit(EventKind.STALL, f"mamba-bound on {len(stalled)}/{len(report.serving)} serving GPUs "
                       f"(window {st.stall} of {needed}, on {evidence})", seen=self._seen(report))
            return
        canary = stalled[0]
        hits = [v.cache_hit_rate for v in report.serving if v.cache_hit_rate is not None]
        blocked = {key: f"was rolled back ({t.get('why', '')}); retry after {_when(t['until'])} with a bar of "
                   f"x{1 + t['bar']:.2f}" for key, t in st.tried.items() if t.get("until", 0) > now}
        prop = next_rung(control.current, self.ladder, failed=blocked,
                         cache_hit_rate=statistics.fmean(hits) if hits else None, facts=canary.facts)
        cur, seen = control.current.describe(), self._seen(report)
        if prop.target is None:
            self._note("fleet", "no-rung:" + "|".join(prop.reasons), EventKind.DECISION,
                       f"stalled on {cur}, but no change to try: " + "; ".join(prop.reasons), seen=seen)
            return
        eta = report.eta_s
        if eta is None:
            self._note("fleet", "eta-unknown", EventKind.DECISION,
                       "stalled, but the work left cannot be estimated yet (no tokens generated yet)")
            return
        saved = eta * (1 - 1 / prop.ratio) if prop.ratio > 1 else 0.0
        cost, learned = self.restart_cost(report, canary.shape)
        worth = (f"~{saved:,.0f} s saved of {eta:,.0f} s left vs restart cost {cost:,.1f} s ({learned}) "
                 f"x{self.s.worth_factor:g}")
        if saved <= cost * self.s.worth_factor and report.eta_lower:
            # A lower bound can show that a restart pays, never that it does not: wait for a finished prompt.
            self._note("fleet", "eta-lower", EventKind.DECISION, f"stalled, {prop.target.describe()} would gain "
                       f"x{prop.ratio:.2f}; the work left is at least ~{eta:,.0f} s (no prompt has finished yet, "
                       "so tokens per prompt are not known): too early to tell whether a restart pays", seen=seen)
            return
        if saved <= cost * self.s.worth_factor:
            self._note("fleet", "not-worth", EventKind.DECISION, f"stalled, {prop.target.describe()} would gain "
                       f"x{prop.ratio:.2f} but it is not worth a restart: {worth}", seen=seen)
            return
        key = spec_key(prop.target)
        bar = float(st.tried.get(key, {}).get("bar", self.s.margin))
        why = [*{r for v in stalled for r in v.reasons[:1]}][:3] + prop.reasons + [worth]
        decide_s = round(now - st.stall_since, 1)
        if self.s.dry_run:
            self._note("fleet", "advice:" + prop.target.describe(), EventKind.ADVICE, f"advice (dry run): move "
                       f"{cur} -> {prop.target.describe()}, predicted capacity x{prop.ratio:.2f} ({evidence})",
                       seen=seen, why=why, windows=st.stall, decide_s=decide_s, evidence=evidence)
            return
        target = replace(prop.target, generation=control.next_generation())
        st.baseline, st.target, st.predicted, st.bar = asdict(control.current), asdict(target), prop.ratio, bar
        st.canary, st.canary_label = canary.queue, canary.label
        st.shape = canary.shape
        same = [v for v in report.serving if v.shape == canary.shape]  # peers of its shape only
        st.baseline_capacity = statistics.fmean(v.effective_max for v in same)
        n = min(st.stall, len(st.fleet_tps))
        st.before_tps = statistics.fmean(st.fleet_tps[-n:])
        st.before_server_tps = statistics.fmean(st.server_tps[-n:]) if len(same) == len(report.serving) else \
            statistics.fmean(v.tokens_per_s for v in same)
        st.decide_s, st.phase, st.phase_since, st.progress_since = decide_s, Phase.CANARY, now, now
        st.measured, st.served_since, st.confounded, st.canary_restart, st.rolled = [], 0.0, "", {}, []
        st.notes.pop("fleet", None)
        retry = f" (try {st.tried[key]['tries'] + 1}, bar x{1 + bar:.2f})" if key in st.tried else ""
        self._emit(EventKind.DECISION, f"mamba-bound for {st.stall} window(s) on {len(stalled)}/{len(report.serving)} "
                   f"GPUs ({evidence}); canary {canary.label}: {cur} -> {target.describe()} (generation "
                   f"{target.generation}), predicted capacity x{prop.ratio:.2f}{retry}; worth it: {worth}", seen=seen,
                   why=why,
                   done=f"override {canary.label} (queue {canary.queue})", windows=st.stall, decide_s=decide_s,
                   evidence=evidence, before_tokens_per_s=round(st.before_tps, 1), target=st.target,
                   predicted_ratio=round(prop.ratio, 3), restart_cost_s=round(cost, 1), restart_cost=learned,
                   bar=bar, shape=canary.shape)
        self._out.append(SetOverride(canary.queue, target))

    def _canary(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        target = ServerSpec(**st.target or {})
        v = report.by_queue(st.canary)
        if v is not None and v.cls == DOWN and v.generation == target.generation:
            self._rollback(control, now, f"the canary {st.canary_label} is down on {target.describe()}: "
                           f"{'; '.join(v.reasons)}", failed=True)
            return
        if v is None or v.generation != target.generation or not v.serving:
            if self._timed_out(st.phase_since, now):
                self._rollback(control, now, f"the canary {st.canary_label} did not serve {target.describe()} within "
                               f"{self.s.phase_timeout_s:g} s", failed=True)
            return
        if not st.served_since:
            st.served_since = now
        if report.backlog == 0:
            self._emit(EventKind.CANARY, f"the run is draining: nothing left to gain from {target.describe()}; the "
                       f"canary {st.canary_label} keeps it, no rollout", canary=st.canary, verdict="draining")
            self._reset()
            return
        since = v.steady_since(target.generation)
        measured = self._measure_canary(report, v, since, target)
        if not measured:
            if self._timed_out(st.served_since, now):
                self._rollback(control, now, f"inconclusive: the canary {st.canary_label} was never measured on "
                               f"steady windows within {self.s.phase_timeout_s:g} s ({st.confounded})", failed=False)
            return
        dur = sum(m[0] for m in st.measured)
        if dur < 0.9 * self.s.verify_windows * report.length:
            return
        mine = sum(m[0] * m[1] for m in st.measured) / dur
        theirs = sum(m[0] * m[2] for m in st.measured) / dur
        ratio = mine / theirs if theirs > 0 else None
        data = {"canary": st.canary, "canary_tokens_per_s": round(mine, 1), "peers_tokens_per_s": round(theirs, 1),
                "capacity_before": st.baseline_capacity, "capacity_after": v.effective_max,
                "predicted_ratio": round(st.predicted, 3), "measured_ratio": round(ratio, 3) if ratio else None,
                "measured_s": round(dur, 1), "bar": st.bar,
                "restart_cost_s": round(self.restart_cost_s(report, st.shape), 1)}
        gained = ratio is not None and v.effective_max > st.baseline_capacity and ratio >= 1 + st.bar
        versus = (f"{v.effective_max} slots (was {st.baseline_capacity:.0f}), {mine:,.0f} vs peers' {theirs:,.0f} "
                  f"tok/s over {dur:.0f} s of steady windows (x{ratio or 0:.2f}")
        if not gained:
            self._rollback(control, now, f"the canary did not gain: {versus}, needs x{1 + st.bar:.2f})", failed=True,
                           **data)
            return
        if theirs > 0 and any(p.queue != st.canary and self._mine(p) for p in report.serving):
            # The verdict's "before" is the peers' steady rate on the old spec, measured beside the canary: the
            # stalled windows may hold the fleet's ramp-up (a decision on start-up facts comes after one window;
            # on a loaded machine that window once read half the rate, and the rollout "gained" x3.79).
            n = st.before_tps / st.before_server_tps if st.before_server_tps else len(report.serving)
            st.before_server_tps, st.before_tps = theirs, theirs * n
        self._emit(EventKind.CANARY, f"canary {st.canary_label} gained: {versus}); rolling out "
                   f"{self.s.rollout_batch} at a time", **data)
        st.phase, st.phase_since, st.progress_since, st.rolled = Phase.ROLLING_OUT, now, now, [st.canary]
        self._rolling_out(report, control, now)

    def _measure_canary(self, report: WindowReport, v: ServerView, since: float | None, target: ServerSpec) -> bool:
        """Add this window's steady part to the measurement; False (with the reason kept) if confounded."""
        st = self.state
        if since is None:
            st.confounded = f"the canary is not full ({v.in_flight:.0f} of {v.effective_max} in flight)"
            return bool(st.measured)
        restart = st.canary_restart
        if restart and "filled" not in restart:
            restart["filled"] = since
            st.restart_costs = [*st.restart_costs, round(restart["downtime_s"] + max(0.0, since - restart["ts"]), 2)]
        peers = [p for p in report.serving if p.queue != st.canary and p.generation != target.generation
                 and self._mine(p)]
        steady = [(p, p.steady_since(p.generation)) for p in peers]
        steady = [(p, s) for p, s in steady if s is not None]
        if peers and not steady:
            st.confounded = "no peer is steady (" + ", ".join(f"{p.label} {p.cls}" for p in peers) + ")"
            return bool(st.measured)
        t0 = max([report.start, since, *(s for _, s in steady)])
        t1 = report.end
        if t1 - t0 < 0.3 * report.length:
            st.confounded = f"only {t1 - t0:.1f} s of this window were steady"
            return bool(st.measured)
        mine = v.rate(t0, t1)
        theirs = [r for r in (p.rate(t0, t1) for p, _ in steady) if r is not None]
        if mine is None or (steady and not theirs):
            st.confounded = "no tokens/s figure for the canary or its peers"
            return bool(st.measured)
        # With no peer at all (a one-GPU fleet) the stalled windows' per-server rate stands in.
        st.measured.append([round(t1 - t0, 3), mine, statistics.fmean(theirs) if theirs else st.before_server_tps])
        st.confounded = ""
        return True

    def _rolling_out(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        target = ServerSpec(**st.target or {})
        broken = [v for v in report.servers if v.queue in st.rolled and v.cls == DOWN
                  and v.generation == target.generation]
        if broken:
            self._rollback(control, now, "; ".join(f"{v.label} failed on {target.describe()}: {'; '.join(v.reasons)}"
                                                   for v in broken), failed=True)
            return
        present = [v for v in sorted(report.servers, key=_order) if v.cls != SILENT and self._mine(v)]
        moved = {v.queue for v in present if v.serving and v.generation == target.generation}
        # A queue whose worker is gone does not block the rollout: its override waits for it.
        pending = [v.queue for v in present if v.queue in st.rolled and v.queue not in moved]
        todo = [v for v in present if v.queue not in st.rolled]
        for v in todo[:max(0, self.s.rollout_batch - len(pending))]:
            st.rolled.append(v.queue)
            st.progress_since = now
            self._out.append(SetOverride(v.queue, target))
            self._emit(EventKind.ROLLOUT, f"{v.label} -> {target.describe()} (generation {target.generation})",
                       queue=v.queue, worker=v.worker)
        todo = [v for v in todo if v.queue not in st.rolled]
        pending = [v.queue for v in present if v.queue in st.rolled and v.queue not in moved]
        if not pending and not todo:
            self._to_verifying(target, now, f"all {len(moved)} serving GPUs{self._of_shape(report)} serve "
                               f"{target.describe()}", mixed=self._mixed(report))
        elif self._timed_out(st.progress_since, now):
            late = ", ".join(v.label for v in present if v.queue in pending)
            self._to_verifying(target, now, f"carrying on after {self.s.phase_timeout_s:g} s without progress "
                               f"({late or 'nobody'} not serving it yet: the fleet spec will move them)",
                               mixed=self._mixed(report))

    def _to_verifying(self, target: ServerSpec, now: float, why: str, *, mixed: bool = False) -> None:
        st = self.state
        if mixed:  # servers of other shapes keep theirs: the change stays as per-queue overrides
            self._emit(EventKind.ROLLED_OUT, f"{why}; servers of other shapes keep their spec (generation "
                       f"{target.generation} is per queue)", target=st.target, rolled=st.rolled, shape=st.shape)
        else:
            self._out.append(SetFleet(target))
            self._emit(EventKind.ROLLED_OUT, f"{why}; it is now the fleet's spec (generation {target.generation})",
                       target=st.target, rolled=st.rolled, shape=st.shape)
        st.phase, st.phase_since, st.measured, st.confounded = Phase.VERIFYING, now, [], ""

    def _verifying(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        target = ServerSpec(**st.target or {})
        serving = [v for v in report.serving if self._mine(v)]
        steady = [v.steady_since(target.generation) for v in serving]
        if serving and report.backlog > 0 and None not in steady:
            t0, t1 = max([report.start, *(s for s in steady if s is not None)]), report.end
            rates = [v.rate(t0, t1) for v in serving]
            if t1 - t0 >= 0.3 * report.length and None not in rates:
                st.measured.append([round(t1 - t0, 3), sum(r or 0.0 for r in rates),
                                    statistics.fmean(r or 0.0 for r in rates)])
            else:
                st.confounded = f"only {t1 - t0:.1f} s of this window were steady"
        elif serving and report.backlog > 0:
            st.confounded = "not every server is full yet: " + ", ".join(
                f"{v.label} {v.cls}" for v, s in zip(serving, steady, strict=True) if s is None)
        dur = sum(m[0] for m in st.measured)
        done = dur >= 0.9 * self.s.verify_windows * report.length
        if not done and report.backlog > 0 and not self._timed_out(st.phase_since, now):
            return
        slots = sorted({v.effective_max for v in serving})
        if not dur:
            why = "the run drained first" if report.backlog == 0 else st.confounded
            self._emit(EventKind.VERIFIED, f"unverified: no steady window after the rollout ({why}); slots per GPU "
                       f"{slots}", ratio=None, slots=slots, target=st.target, decide_s=st.decide_s)
            self._reset()
            return
        after = sum(m[0] * m[1] for m in st.measured) / dur
        after_server = sum(m[0] * m[2] for m in st.measured) / dur
        ratio = after_server / st.before_server_tps if st.before_server_tps else None
        if ratio is not None and ratio > 1:
            # The fleet's memory: the next run of the same kind of server starts here.
            entry = Remembered(spec=replace(target, generation=0), ratio=round(ratio, 3), slots=slots)
            keys = {f for f in (memory_field(v) for v in serving if v.generation == target.generation) if f}
            if keys:
                self._out.append(Remember({f: entry for f in sorted(keys)}))
        self._emit(EventKind.VERIFIED, f"fleet {st.before_tps:,.0f} -> {after:,.0f} tok/s"
                   + (f" (x{ratio:.2f} per server)" if ratio else "")
                   + f" over {dur:.0f} s of steady windows, slots per GPU {slots} (predicted "
                   f"x{st.predicted:.2f})", before_tokens_per_s=round(st.before_tps, 1),
                   after_tokens_per_s=round(after, 1), before_server_tokens_per_s=round(st.before_server_tps, 1),
                   after_server_tokens_per_s=round(after_server, 1), ratio=round(ratio, 3) if ratio else None,
                   measured_s=round(dur, 1), slots=slots, target=st.target, decide_s=st.decide_s,
                   predicted_ratio=round(st.predicted, 3))
        self._reset()

    def _rollback(self, control: Control, now: float, why: str, *, failed: bool, **data: Any) -> None:
        """Put the queues that moved back on the old spec (newer generation). The rung is not banned: it
        may be tried again after a back-off (doubling), with a higher bar if it failed to gain."""
        st = self.state
        baseline = replace(ServerSpec(**st.baseline or {}), generation=control.next_generation())
        target = ServerSpec(**st.target or {})
        moved = st.rolled or [st.canary]
        for q in moved:
            self._out.append(SetOverride(q, baseline))
        key = spec_key(target)
        t = dict(st.tried.get(key) or {"tries": 0, "bar": self.s.margin})
        if failed:
            t["tries"] = int(t["tries"]) + 1
            t["bar"] = self.s.margin + self.s.margin_step * t["tries"]
            t["until"] = now + backoff_s(int(t["tries"]), base_s=self.s.retry_after_s)
            t["why"] = "did not gain" if "did not gain" in why else why.split(":")[0][:80]
        else:
            t["until"] = now + self.s.retry_after_s
            t["why"] = "inconclusive"
        st.tried[key] = t
        self._emit(EventKind.ROLLBACK, f"{why}; back to {baseline.describe()} (generation {baseline.generation}) on "
                   f"{', '.join(moved)}; {target.describe()} may be retried after {_when(t['until'])} with a bar of "
                   f"x{1 + t['bar']:.2f}", **data, verdict="failed" if failed else "inconclusive",
                   tried={key: t}, queues=moved)
        self._reset()
