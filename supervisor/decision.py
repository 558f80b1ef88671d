"""The decision, made while observing: is the fleet stalled, which change would help, what is it expected
to buy, and does that pay for the restarts? If so, a canary. Pure.

A window counts as stalled when most serving servers are mamba-bound. After `static_windows` stalled
windows when every stalled server's start-up facts prove it (else `windows`), the next rung of the
ladder not in back-off is chosen (`choose_rung`), with its predicted capacity ratio; the change must
save more than `worth_factor` times one server's restart cost (`pricing.py`). `--dry-run` stops at an
`advice` event. The canary is the stalled server on the lowest GPU; the change is then about its shape.

What the decision knows of the work ahead is a `Workload`: what the servers measured, and the prefix
plan's prediction of how much of the prompt tokens ahead their radix caches will give (producer/plan.py;
per queue). With a prediction, `choose_rung` weighs each rung by what it keeps of that reuse too
(`ladder.Reuse`): a run the plan groups by shared prefixes keeps a strategy that reuses them. Where the
prediction differs between servers, the change goes only to those for which it chooses the same rung:
the others keep their spec (`PilotState.keep`), and the decision says so.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from batchfleet.records import EventKind, ServerFacts, ServerSpec

from .actions import Control, Outbox, SetOverride
from .classify import MAMBA_BOUND, ServerView, WindowReport
from .ladder import LadderConfig, Proposal, Reuse, next_rung, spec_key
from .phases import PhaseStep, by_gpu, clock
from .pilotstate import Phase, PilotState
from .pricing import Worth, price_restart, worth
from .settings import Settings

__all__ = ["Observing", "Stall", "Workload", "choose_rung", "in_back_off"]


@dataclass(frozen=True, slots=True)
class Workload:
    """What the decision knows of the work ahead of the fleet (or of some of its servers)."""

    cache_hit_rate: float | None = None  # measured: the servers' mean share of prompt tokens from their caches
    predicted_hit: float | None = None  # the prefix plan's prediction of that share for the work ahead
    prompt_tokens: float | None = None  # per request
    completion_tokens: float | None = None  # per request

    @classmethod
    def measured(cls, report: WindowReport, servers: list[ServerView] | None = None) -> Workload:
        """Of `servers` (default: every serving one) in this window."""
        servers = report.serving if servers is None else servers
        hits = [v.cache_hit_rate for v in servers if v.cache_hit_rate is not None]
        predicted = [v.predicted_hit for v in servers if v.predicted_hit is not None]
        return cls(cache_hit_rate=statistics.fmean(hits) if hits else None,
                   predicted_hit=statistics.fmean(predicted) if predicted else None,
                   prompt_tokens=report.prompt_tokens, completion_tokens=report.completion_tokens)

    @property
    def reuse(self) -> Reuse | None:
        """What the work ahead reuses, when the plan predicted it and a request's tokens are known."""
        if self.predicted_hit is None or not self.prompt_tokens or self.completion_tokens is None:
            return None
        return Reuse(self.predicted_hit, self.prompt_tokens, self.completion_tokens)

    def describe(self) -> str:
        measured = "n/a" if self.cache_hit_rate is None else f"{self.cache_hit_rate:.0%}"
        predicted = "" if self.predicted_hit is None else f", the plan predicted {self.predicted_hit:.0%}"
        return f"hit rate measured {measured}{predicted}"


def choose_rung(current: ServerSpec, ladder: LadderConfig, workload: Workload, *, blocked: dict[str, str],
                facts: ServerFacts | None) -> Proposal:
    """The change to try and the ratio it is expected to buy (`Proposal.ratio`, which `pricing.worth`
    turns into time saved), or why there is none. `blocked`: rungs in back-off, with why; `facts`: the
    canary's start-up facts, for the prediction. The one place where what is known of the workload
    weighs in the choice and its expected gain."""
    return next_rung(current, ladder, failed=blocked, cache_hit_rate=workload.cache_hit_rate, facts=facts,
                     reuse=workload.reuse)


def in_back_off(tried: dict[str, dict[str, Any]], now: float) -> dict[str, str]:
    """spec_key -> why not yet, for the rungs rolled back whose back-off has not run out."""
    return {key: f"was rolled back ({t.get('why', '')}); retry after {clock(t['until'])} with a bar of "
            f"x{1 + t['bar']:.2f}" for key, t in tried.items() if t.get("until", 0) > now}


def seen(report: WindowReport) -> dict[str, Any]:
    """What the window showed, for the event that says what was decided on it."""
    return {"classes": report.by_class(), "backlog": report.backlog, "eta_s": report.eta_s,
            "fleet_tokens_per_s": round(report.fleet_tokens_per_s, 1)}


@dataclass(frozen=True, slots=True)
class Stall:
    """Enough stalled windows to act on."""

    servers: list[ServerView]  # the mamba-bound serving servers, lowest GPU first
    evidence: str  # "start-up facts" or "gauges"

    @property
    def canary(self) -> ServerView:
        return self.servers[0]


class Observing(PhaseStep):
    """Counts stalled windows and decides: nothing, advice (dry run), or a canary."""

    def __init__(self, settings: Settings, ladder: LadderConfig, state: PilotState, out: Outbox) -> None:
        super().__init__(settings, state, out)
        self.ladder = ladder

    def step(self, report: WindowReport, control: Control, now: float) -> None:
        stall = self.stalled(report)
        if stall is None:
            return
        blocked = in_back_off(self.st.tried, now)
        workload = Workload.measured(report, stall.servers)
        prop = choose_rung(control.current, self.ladder, workload, blocked=blocked, facts=stall.canary.facts)
        if prop.target is None:
            self.out.note("fleet", "no-rung:" + "|".join(prop.reasons), EventKind.DECISION,
                          f"stalled on {control.current.describe()}, but no change to try: " + "; ".join(prop.reasons),
                          seen=seen(report), predicted_hit=workload.predicted_hit,
                          measured_hit=workload.cache_hit_rate)
            return
        stall, keep = self.agreeing(report, control, stall, prop, blocked)
        gain = self.worth_it(report, prop, prop.target, stall.canary)
        if gain is None:
            return
        why = [*{r for v in stall.servers for r in v.reasons[:1]}][:3] + prop.reasons + [gain.describe()]
        decide_s = round(now - self.st.stall_since, 1)
        if self.s.dry_run:
            self.out.note("fleet", "advice:" + prop.target.describe(), EventKind.ADVICE, f"advice (dry run): move "
                          f"{control.current.describe()} -> {prop.target.describe()}, predicted capacity "
                          f"x{prop.ratio:.2f} ({stall.evidence})", seen=seen(report), why=why, windows=self.st.stall,
                          decide_s=decide_s, evidence=stall.evidence)
            return
        self.start_canary(report, control, now, stall, prop, prop.target, gain, why=why, decide_s=decide_s,
                          workload=workload, keep=keep)

    def agreeing(self, report: WindowReport, control: Control, stall: Stall, prop: Proposal,
                 blocked: dict[str, str]) -> tuple[Stall, list[str]]:
        """The stalled servers the change is for, and the queues it is not for: those whose own work (the
        plan's prediction for their queue) chooses another rung, or none. The canary is one it is for."""
        if prop.target is None:
            return stall, []
        key, keep = spec_key(prop.target), []
        for v in report.serving:
            if v.predicted_hit is None:
                continue  # the plan says nothing of it: the fleet's choice is its choice
            own = choose_rung(control.current, self.ladder, Workload.measured(report, [v]), blocked=blocked,
                              facts=v.facts)
            if own.target is None or spec_key(own.target) != key:
                keep.append(v.queue)
        servers = [v for v in stall.servers if v.queue not in keep] or stall.servers
        return Stall(servers, stall.evidence), keep

    def stalled(self, report: WindowReport) -> Stall | None:
        """Count this window; the stall once it has lasted long enough for its evidence, else None."""
        st = self.st
        if not report.majority(MAMBA_BOUND):
            st.stall = 0
            return None
        st.stall += 1
        if st.stall == 1:
            st.stall_since = report.start
        servers = sorted((v for v in report.serving if v.cls == MAMBA_BOUND), key=by_gpu)
        static = all(v.evidence == "static" for v in servers)
        needed = self.s.static_windows if static else self.s.windows
        evidence = "start-up facts" if static else "gauges"
        if st.stall < needed:
            self.out.emit(EventKind.STALL, f"mamba-bound on {len(servers)}/{len(report.serving)} serving GPUs "
                          f"(window {st.stall} of {needed}, on {evidence})", seen=seen(report))
            return None
        return Stall(servers, evidence)

    def worth_it(self, report: WindowReport, prop: Proposal, target: ServerSpec, canary: ServerView) -> Worth | None:
        """What the change is worth, when it pays for its restarts; else None, said once."""
        eta = report.eta_s
        if eta is None:
            self.out.note("fleet", "eta-unknown", EventKind.DECISION,
                          "stalled, but the work left cannot be estimated yet (no tokens generated yet)")
            return None
        cost = price_restart(self.st.restart_costs, self.s.restart_cost_s, report, canary.shape)
        gain = worth(eta, prop.ratio, cost, self.s.worth_factor)
        if gain.pays:
            return gain
        if report.eta_lower:
            # A lower bound can show that a restart pays, never that it does not: wait for a finished prompt.
            self.out.note("fleet", "eta-lower", EventKind.DECISION, f"stalled, {target.describe()} would gain "
                          f"x{prop.ratio:.2f}; the work left is at least ~{eta:,.0f} s (no prompt has finished yet, "
                          "so tokens per prompt are not known): too early to tell whether a restart pays",
                          seen=seen(report))
        else:
            self.out.note("fleet", "not-worth", EventKind.DECISION, f"stalled, {target.describe()} would gain "
                          f"x{prop.ratio:.2f} but it is not worth a restart: {gain.describe()}", seen=seen(report))
        return None

    def start_canary(self, report: WindowReport, control: Control, now: float, stall: Stall, prop: Proposal,
                     rung: ServerSpec, gain: Worth, *, why: list[str], decide_s: float, workload: Workload,
                     keep: list[str]) -> None:
        """Move the canary to the target (the next generation) and remember what it is compared with."""
        st, canary = self.st, stall.canary
        target = replace(rung, generation=control.next_generation())
        key = spec_key(target)
        retry = f" (try {st.tried[key]['tries'] + 1}, bar x{1 + self.bar(key):.2f})" if key in st.tried else ""
        self.remember_baseline(report, control, target, canary, prop.ratio)
        st.keep = keep
        st.decide_s, st.phase, st.phase_since, st.progress_since = decide_s, Phase.CANARY, now, now
        what = "predicted capacity" if workload.reuse is None else f"{workload.describe()}; predicted"
        kept = f"; {', '.join(keep)} keep their spec (the plan predicts other work there)" if keep else ""
        self.out.emit(EventKind.DECISION, f"mamba-bound for {st.stall} window(s) on {len(stall.servers)}/"
                      f"{len(report.serving)} GPUs ({stall.evidence}); canary {canary.label}: "
                      f"{control.current.describe()} -> {target.describe()} (generation {target.generation}), "
                      f"{what} x{prop.ratio:.2f}{retry}; worth it: {gain.describe()}{kept}", seen=seen(report),
                      why=why, done=f"override {canary.label} (queue {canary.queue})", windows=st.stall,
                      decide_s=decide_s, evidence=stall.evidence, before_tokens_per_s=round(st.before_tps, 1),
                      target=st.target, predicted_ratio=round(prop.ratio, 3), restart_cost_s=round(gain.cost_s, 1),
                      restart_cost=gain.cost_how, bar=st.bar, shape=canary.shape,
                      predicted_hit=workload.predicted_hit, measured_hit=workload.cache_hit_rate, keep=keep)
        self.out.add(SetOverride(canary.queue, target))

    def bar(self, key: str) -> float:
        """The margin the canary must beat its peers by: raised by each rollback of the rung that did not gain."""
        return float(self.st.tried.get(key, {}).get("bar", self.s.margin))

    def remember_baseline(self, report: WindowReport, control: Control, target: ServerSpec, canary: ServerView,
                          predicted: float) -> None:
        """The change (old spec, target, prediction, bar) and what it is measured against: the capacity and
        the tokens/s of the stalled windows among the canary's shape."""
        st = self.st
        st.baseline, st.target, st.predicted, st.bar = asdict(control.current), asdict(target), predicted, \
            self.bar(spec_key(target))
        st.canary, st.canary_label, st.shape = canary.queue, canary.label, canary.shape
        same = [v for v in report.serving if v.shape == canary.shape]  # peers of its shape only
        st.baseline_capacity = statistics.fmean(v.effective_max for v in same)
        n = min(st.stall, len(st.fleet_tps))
        st.before_tps = statistics.fmean(st.fleet_tps[-n:])
        st.before_server_tps = statistics.fmean(st.server_tps[-n:]) if len(same) == len(report.serving) else \
            statistics.fmean(v.tokens_per_s for v in same)
        st.measured, st.served_since, st.confounded, st.canary_restart, st.rolled = [], 0.0, "", {}, []
        st.notes.pop("fleet", None)
