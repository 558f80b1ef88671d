"""The autopilot's state machine. Pure: it gets one classified window at a time and answers with
actions (write a spec, emit an event); `run.py` applies them to Redis.

    observing ──N stalled windows, a rung to climb, worth it──▶ canary ──gained──▶ rolling_out ──▶ verifying
        ▲                          (--dry-run: advice only)        │ not gained / down       (a few        │
        │                                                          ▼                         at a time)    │
        └──────────────────────────── rolled back (change remembered as failed) ◀───────────────────────────┘

Generations only ever increase: the canary and each rolled-out worker get a per-worker override
with the new generation; when all serve it, the same spec becomes the fleet's and the overrides
go. A rollback writes the old spec under a newer generation to the workers that moved.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from batchfleet.records import Event, ServerSpec

from .classify import CLIENT_BOUND, DOWN, HUNG, KV_BOUND, MAMBA_BOUND, WindowReport
from .ladder import LadderConfig, next_rung, spec_key

__all__ = ["Autopilot", "Control", "Emit", "SetFleet", "SetOverride", "Settings", "State"]

PROBLEMS = (CLIENT_BOUND, HUNG, DOWN, KV_BOUND)  # worth a diagnosis line when a server enters one


@dataclass(frozen=True, slots=True)
class Settings:
    windows: int = 3  # consecutive mamba-bound windows (for most serving servers) before acting
    dry_run: bool = False
    restart_cost_s: float = 300.0  # one server's downtime when restarted (drain + load + warm-up), a guess
    worth_factor: float = 2.0  # the time saved must exceed the restart cost this many times
    margin: float = 0.2  # the canary must beat its peers' tokens/s by this share
    verify_windows: int = 2  # windows of measurement for the canary and after the rollout
    rollout_batch: int = 2  # workers restarting at once during the rollout
    canary_timeout_s: float = 900.0  # a canary not serving the new spec after this is rolled back


@dataclass(frozen=True, slots=True)
class Control:
    """What the control hash holds now, and what the fleet runs (see ladder.current_spec)."""

    fleet: ServerSpec | None
    overrides: dict[str, ServerSpec]
    current: ServerSpec
    seen_generation: int = 0  # the highest generation any worker reports

    def next_generation(self) -> int:
        gens = [self.seen_generation, self.current.generation, *(s.generation for s in self.overrides.values())]
        if self.fleet is not None:
            gens.append(self.fleet.generation)
        return max(gens) + 1


@dataclass(frozen=True, slots=True)
class SetOverride:
    worker: str
    spec: ServerSpec


@dataclass(frozen=True, slots=True)
class SetFleet:
    spec: ServerSpec  # becomes field `fleet`; every per-worker override is removed


@dataclass(frozen=True, slots=True)
class Emit:
    event: Event


Action = SetOverride | SetFleet | Emit


@dataclass
class State:
    """Everything the autopilot remembers; stored in Redis so a restarted supervisor carries on."""

    phase: str = "observing"  # observing | canary | rolling_out | verifying
    stall: int = 0
    stall_since: float = 0.0
    fleet_tps: list[float] = field(default_factory=list)  # recent windows, newest last
    baseline: dict[str, Any] | None = None  # ServerSpec before the change
    target: dict[str, Any] | None = None  # ServerSpec being tried
    predicted: float = 1.0
    canary: str = ""
    canary_label: str = ""  # gpuN, for people
    phase_since: float = 0.0
    warm: bool = False  # the first window on a new spec is a ramp-up; it is not measured
    canary_tps: list[float] = field(default_factory=list)
    peers_tps: list[float] = field(default_factory=list)
    baseline_capacity: float = 0.0
    baseline_server_tps: float = 0.0
    before_tps: float = 0.0
    decide_s: float = 0.0
    rolled: list[str] = field(default_factory=list)
    after_tps: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # spec_key()s that did not gain in this run
    notes: dict[str, str] = field(default_factory=dict)  # last diagnosis per topic: say things once
    classes: dict[str, str] = field(default_factory=dict)  # last window's class per worker (for watch)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> State:
        return cls(**orjson.loads(raw)) if raw else cls()


class Autopilot:
    def __init__(self, settings: Settings, ladder: LadderConfig, state: State | None = None) -> None:
        self.s = settings
        self.ladder = ladder
        self.state = state or State()
        self._out: list[Action] = []

    def step(self, report: WindowReport, control: Control, now: float) -> list[Action]:
        """One window: diagnose, then advance the state machine. Returns the actions to apply."""
        self._out = []
        st = self.state
        st.classes = {v.worker: v.cls for v in report.servers}
        st.fleet_tps = [*st.fleet_tps, report.fleet_tokens_per_s][-max(self.s.windows, 3):]
        self._diagnose(report)
        getattr(self, "_" + st.phase)(report, control, now)
        return self._out

    # --- helpers -------------------------------------------------------------------------------
    def _emit(self, kind: str, message: str, **data: Any) -> None:
        self._out.append(Emit(Event(kind=kind, message=message, source="supervisor", data=data)))

    def _note(self, topic: str, key: str, kind: str, message: str, **data: Any) -> None:
        """Emit only when what there is to say on `topic` changed in substance (`key`, not the figures
        in `message`), so a steady state is said once."""
        if self.state.notes.get(topic) != key:
            self.state.notes[topic] = key
            self._emit(kind, message, **data)

    def _diagnose(self, report: WindowReport) -> None:
        for v in report.servers:
            text = f"{v.label}: {v.cls}: {'; '.join(v.reasons)}" if v.cls in PROBLEMS else ""
            if v.outliers:
                text += ("; " if text else f"{v.label}: ") + "far from its peers: " + "; ".join(v.outliers)
            if text or v.worker in self.state.notes:
                if not text:
                    self.state.notes.pop(v.worker, None)
                    continue
                key = "|".join([v.cls if v.cls in PROBLEMS else "", *(o.split(" ")[0] for o in v.outliers)])
                self._note(v.worker, key, "diagnosis", text, worker=v.worker, cls=v.cls, reasons=v.reasons,
                           outliers=v.outliers, ours=v.cls == CLIENT_BOUND)

    @staticmethod
    def _seen(report: WindowReport) -> dict[str, Any]:
        return {"classes": report.by_class(), "backlog": report.backlog, "eta_s": report.eta_s,
                "fleet_tokens_per_s": round(report.fleet_tokens_per_s, 1)}

    def _reset(self) -> None:
        st = self.state
        st.phase, st.stall, st.canary, st.rolled, st.warm = "observing", 0, "", [], False
        st.canary_tps, st.peers_tps, st.after_tps = [], [], []

    # --- phases ----------------------------------------------------------------------------------
    def _observing(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        if not report.majority(MAMBA_BOUND):
            st.stall = 0
            return
        st.stall += 1
        if st.stall == 1:
            st.stall_since = report.start
        stalled = [v for v in report.serving if v.cls == MAMBA_BOUND]
        if st.stall < self.s.windows:
            self._emit("stall", f"mamba-bound on {len(stalled)}/{len(report.serving)} serving GPUs "
                       f"(window {st.stall} of {self.s.windows})", seen=self._seen(report))
            return
        hits = [v.cache_hit_rate for v in report.serving if v.cache_hit_rate is not None]
        prop = next_rung(control.current, self.ladder, failed=st.failed,
                         cache_hit_rate=statistics.fmean(hits) if hits else None)
        cur, seen = control.current.describe(), self._seen(report)
        if prop.target is None:
            self._note("fleet", "no-rung", "decision", f"stalled on {cur}, but no change to try: "
                       + "; ".join(prop.reasons), seen=seen)
            return
        eta = report.eta_s
        if eta is None:
            self._note("fleet", "eta-unknown", "decision",
                       "stalled, but the work left cannot be estimated yet (no tokens generated yet)")
            return
        saved = eta * (1 - 1 / prop.ratio)
        cost = self.s.restart_cost_s * self.s.worth_factor
        worth = (f"~{saved:,.0f} s saved of {eta:,.0f} s left vs restart cost {self.s.restart_cost_s:g} s "
                 f"x{self.s.worth_factor:g}")
        if saved <= cost:
            self._note("fleet", "not-worth", "decision", f"stalled, {prop.target.describe()} would gain "
                       f"x{prop.ratio:.2f} but it is not worth a restart: {worth}", seen=seen)
            return
        why = [*{r for v in stalled for r in v.reasons[:1]}][:3] + prop.reasons + [worth]
        decide_s = round(now - st.stall_since, 1)
        if self.s.dry_run:
            self._note("fleet", "advice:" + prop.target.describe(), "advice", f"advice (dry run): move {cur} -> "
                       f"{prop.target.describe()}, predicted capacity x{prop.ratio:.2f}", seen=seen,
                       why=why, windows=st.stall, decide_s=decide_s)
            return
        target = replace(prop.target, generation=control.next_generation())
        canary = min(stalled, key=lambda v: (v.gpu if v.gpu is not None else 1 << 30, v.worker))
        st.baseline, st.target, st.predicted = asdict(control.current), asdict(target), prop.ratio
        st.canary, st.canary_label = canary.worker, canary.label
        st.baseline_capacity = statistics.fmean(v.effective_max for v in report.serving)
        st.baseline_server_tps = statistics.fmean(v.tokens_per_s for v in report.serving)
        st.before_tps = statistics.fmean(st.fleet_tps[-self.s.windows:])
        st.decide_s, st.phase, st.phase_since, st.warm = decide_s, "canary", now, False
        st.canary_tps, st.peers_tps = [], []
        st.notes.pop("fleet", None)
        self._emit("decision", f"mamba-bound for {st.stall} windows on {len(stalled)}/{len(report.serving)} GPUs; "
                   f"canary {canary.label}: {control.current.describe()} -> {target.describe()} (generation "
                   f"{target.generation}), predicted capacity x{prop.ratio:.2f}", seen=self._seen(report), why=why,
                   done=f"override {canary.label} ({canary.worker})", windows=st.stall, decide_s=decide_s,
                   before_tokens_per_s=round(st.before_tps, 1), target=st.target, predicted_ratio=prop.ratio)
        self._out.append(SetOverride(canary.worker, target))

    def _canary(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        target = ServerSpec(**st.target or {})
        v = report.get(st.canary)
        if v is not None and v.state == "down" and now - st.phase_since > 1:
            self._rollback(control, f"the canary {st.canary_label} is down: {'; '.join(v.reasons)}")
            return
        if v is None or v.generation != target.generation or not v.serving:
            if now - st.phase_since > self.s.canary_timeout_s:
                self._rollback(control, f"the canary {st.canary_label} did not serve {target.describe()} within "
                               f"{self.s.canary_timeout_s:g} s")
            return
        if not st.warm:  # its semaphore is still filling: not a fair measure
            st.warm = True
            return
        peers = [p.tokens_per_s for p in report.serving if p.generation != target.generation]
        st.canary_tps.append(v.tokens_per_s)
        st.peers_tps.append(statistics.fmean(peers) if peers else st.baseline_server_tps)
        if len(st.canary_tps) < self.s.verify_windows:
            return
        mine, theirs = statistics.fmean(st.canary_tps), statistics.fmean(st.peers_tps)
        measured = {"canary": st.canary, "canary_tokens_per_s": round(mine, 1), "peers_tokens_per_s": round(theirs, 1),
                    "capacity_before": st.baseline_capacity, "capacity_after": v.effective_max,
                    "predicted_ratio": st.predicted, "measured_ratio": round(mine / theirs, 3) if theirs else None}
        if v.effective_max > st.baseline_capacity and mine >= (1 + self.s.margin) * theirs:
            self._emit("canary", f"canary {st.canary_label} gained: {v.effective_max} slots (was "
                       f"{st.baseline_capacity:.0f}), {mine:,.0f} vs peers' {theirs:,.0f} tok/s "
                       f"(x{mine / theirs:.2f}); rolling out {self.s.rollout_batch} at a time", **measured)
            st.phase, st.phase_since, st.rolled = "rolling_out", now, [st.canary]
            self._rolling_out(report, control, now)
        else:
            self._rollback(control, f"the canary did not gain: {v.effective_max} slots (was "
                           f"{st.baseline_capacity:.0f}), {mine:,.0f} vs peers' {theirs:,.0f} tok/s "
                           f"(needs x{1 + self.s.margin:.2f})", **measured)

    def _rolling_out(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        target = ServerSpec(**st.target or {})
        broken = [v for v in report.servers if v.worker in st.rolled and v.state == "down"]
        if broken:
            self._rollback(control, "; ".join(f"{v.worker} failed on the new spec: {'; '.join(v.reasons)}"
                                              for v in broken))
            return
        moved = {v.worker for v in report.servers if v.serving and v.generation == target.generation}
        pending = [w for w in st.rolled if w not in moved]
        order = sorted(report.servers, key=lambda v: (v.gpu if v.gpu is not None else 1 << 30, v.worker))
        todo = [v.worker for v in order if v.worker not in st.rolled]
        for w in todo[:max(0, self.s.rollout_batch - len(pending))]:
            st.rolled.append(w)
            self._out.append(SetOverride(w, target))
            label = next((v.label for v in report.servers if v.worker == w), w)
            self._emit("rollout", f"{label} -> {target.describe()} (generation {target.generation})", worker=w)
        if not pending and not todo:
            self._out.append(SetFleet(target))
            self._emit("rolled_out", f"all {len(st.rolled)} GPUs serve {target.describe()}; it is now the fleet's "
                       f"spec (generation {target.generation})", target=st.target)
            st.phase, st.phase_since, st.warm, st.after_tps = "verifying", now, False, []

    def _verifying(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.state
        if not st.warm:
            # The last servers back are still filling their new slots: measure once all are full (or
            # after three windows, so a fleet that never fills is still judged).
            ramping = [v for v in report.servers if v.cls in (CLIENT_BOUND, "restarting")]
            st.warm = (not ramping and now - st.phase_since > 0) or now - st.phase_since > 3 * self._window(report)
            return
        if report.backlog > 0:
            st.after_tps.append(report.fleet_tokens_per_s)
        if len(st.after_tps) < self.s.verify_windows and report.backlog > 0:
            return
        after = statistics.fmean(st.after_tps) if st.after_tps else report.fleet_tokens_per_s
        slots = sorted({v.effective_max for v in report.serving})
        ratio = after / st.before_tps if st.before_tps else None
        self._emit("verified", f"fleet {st.before_tps:,.0f} -> {after:,.0f} tok/s"
                   + (f" (x{ratio:.2f})" if ratio else "") + f", slots per GPU {slots} (predicted x{st.predicted:.2f})",
                   before_tokens_per_s=round(st.before_tps, 1), after_tokens_per_s=round(after, 1),
                   ratio=round(ratio, 3) if ratio else None, slots=slots, target=st.target, decide_s=st.decide_s)
        self._reset()

    @staticmethod
    def _window(report: WindowReport) -> float:
        return max(report.end - report.start, 1.0)

    def _rollback(self, control: Control, why: str, **data: Any) -> None:
        st = self.state
        baseline = replace(ServerSpec(**st.baseline or {}), generation=control.next_generation())
        target = ServerSpec(**st.target or {})
        for w in st.rolled or [st.canary]:
            self._out.append(SetOverride(w, baseline))
        st.failed = sorted({*st.failed, spec_key(target)})
        self._emit("rollback", f"{why}; back to {baseline.describe()} (generation {baseline.generation}) on "
                   f"{', '.join(st.rolled or [st.canary])}; {target.describe()} will not be tried again in this run",
                   **data, failed=st.failed)
        self._reset()
