"""The phases of a change, after the decision (`decision.Observing`): the canary, the rollout, the
verification, and the rollback any of them may end in. Pure: each phase step reads one classified
window and adds actions to the step's `Outbox`; `autopilot.Autopilot` dispatches on `PilotState.phase`.

- **canary**: one server on the target, judged on steady windows only (`measure.py`) against its peers
  of the same shape; gained (capacity up and tokens/s over the bar) -> rolling_out; did not gain, down
  on the target, or not serving it within the phase timeout -> rollback (back-off, a higher bar);
  never measured within the phase timeout -> rollback as inconclusive (back-off, the same bar); the run
  draining -> the canary keeps the target, back to observing.
- **rolling_out**: a few queues at a time; a queue whose worker is gone does not block; no progress
  for the phase timeout: carry on. Every server of the shape on the target -> verifying, with the
  target as the fleet's spec (or, in a fleet of several shapes, as per-queue overrides).
- **verifying**: steady windows after every server of the shape filled; a verified gain is remembered
  for the next run of the same kind of server (`memory.py`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from batchfleet.backoff import backoff_s
from batchfleet.records import EventKind, ServerSpec

from .actions import Control, Outbox, Remember, SetFleet, SetOverride
from .classify import DOWN, SILENT, ServerView, WindowReport
from .ladder import spec_key
from .measure import Measured, enough, measure_canary, measure_fleet
from .memory import Remembered, memory_field
from .pilotstate import Phase, PilotState
from .pricing import price_restart, restart_filled
from .settings import Settings

__all__ = ["CanaryPhase", "PhaseStep", "RollingOut", "Verifying", "by_gpu", "clock"]


def by_gpu(v: ServerView) -> tuple[int, str, str]:
    """Sort key: lowest GPU first (the canary is the first stalled one), then host and queue."""
    return (v.gpu if v.gpu is not None else 1 << 30, v.host, v.queue)


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


class PhaseStep:
    """What every phase works with: the settings, the autopilot's state, the step's outbox."""

    def __init__(self, settings: Settings, state: PilotState, out: Outbox) -> None:
        self.s = settings
        self.st = state
        self.out = out

    def step(self, report: WindowReport, control: Control, now: float) -> None:
        raise NotImplementedError

    def timed_out(self, since: float, now: float) -> bool:
        return now - since > self.s.phase_timeout_s

    def rollback(self, control: Control, now: float, why: str, *, failed: bool, **data: Any) -> None:
        """Put the queues that moved back on the old spec (newer generation). The rung is not banned: it
        may be tried again after a back-off (doubling), with a higher bar if it failed to gain."""
        st, s = self.st, self.s
        baseline = replace(st.baseline_spec, generation=control.next_generation())
        target = st.target_spec
        moved = st.rolled or [st.canary]
        for q in moved:
            self.out.add(SetOverride(q, baseline))
        key = spec_key(target)
        t = dict(st.tried.get(key) or {"tries": 0, "bar": s.margin})
        if failed:
            t["tries"] = int(t["tries"]) + 1
            t["bar"] = s.margin + s.margin_step * t["tries"]
            t["until"] = now + backoff_s(int(t["tries"]), base_s=s.retry_after_s)
            t["why"] = "did not gain" if "did not gain" in why else why.split(":")[0][:80]
        else:
            t["until"] = now + s.retry_after_s
            t["why"] = "inconclusive"
        st.tried[key] = t
        self.out.emit(EventKind.ROLLBACK, f"{why}; back to {baseline.describe()} (generation {baseline.generation}) "
                      f"on {', '.join(moved)}; {target.describe()} may be retried after {clock(t['until'])} with a "
                      f"bar of x{1 + t['bar']:.2f}", **data, verdict="failed" if failed else "inconclusive",
                      tried={key: t}, queues=moved)
        st.back_to_observing()


class CanaryPhase(PhaseStep):
    """One server on the target, measured against its peers until it gained, did not, or timed out."""

    def step(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.st
        target = st.target_spec
        v = report.by_queue(st.canary)
        if v is not None and v.cls == DOWN and v.generation == target.generation:
            self.rollback(control, now, f"the canary {st.canary_label} is down on {target.describe()}: "
                          f"{'; '.join(v.reasons)}", failed=True)
            return
        if v is None or v.generation != target.generation or not v.serving:
            if self.timed_out(st.phase_since, now):
                self.rollback(control, now, f"the canary {st.canary_label} did not serve {target.describe()} "
                              f"within {self.s.phase_timeout_s:g} s", failed=True)
            return
        if not st.served_since:
            st.served_since = now
        if report.backlog == 0:
            self.out.emit(EventKind.CANARY, f"the run is draining: nothing left to gain from {target.describe()}; "
                          f"the canary {st.canary_label} keeps it, no rollout", canary=st.canary, verdict="draining")
            st.back_to_observing()
            return
        since = v.steady_since(target.generation)
        if since is not None:
            restart_filled(st, since)
        if not measure_canary(st, report, v, since):
            if self.timed_out(st.served_since, now):
                self.rollback(control, now, f"inconclusive: the canary {st.canary_label} was never measured on "
                              f"steady windows within {self.s.phase_timeout_s:g} s ({st.confounded})", failed=False)
            return
        measured = Measured.of(st.measured)
        if measured is not None and enough(measured.seconds, self.s.verify_windows, report):
            self.judge(report, control, now, v, measured)

    def judge(self, report: WindowReport, control: Control, now: float, v: ServerView, m: Measured) -> None:
        """Gained: its capacity rose and its tokens/s beat its peers' by the bar. Then roll out."""
        st = self.st
        ratio = m.rate / m.peers if m.peers > 0 else None
        data = {"canary": st.canary, "canary_tokens_per_s": round(m.rate, 1), "peers_tokens_per_s": round(m.peers, 1),
                "capacity_before": st.baseline_capacity, "capacity_after": v.effective_max,
                "predicted_ratio": round(st.predicted, 3), "measured_ratio": round(ratio, 3) if ratio else None,
                "measured_s": round(m.seconds, 1), "bar": st.bar,
                "restart_cost_s": round(price_restart(st.restart_costs, self.s.restart_cost_s, report, st.shape)[0], 1)}
        gained = ratio is not None and v.effective_max > st.baseline_capacity and ratio >= 1 + st.bar
        versus = (f"{v.effective_max} slots (was {st.baseline_capacity:.0f}), {m.rate:,.0f} vs peers' {m.peers:,.0f} "
                  f"tok/s over {m.seconds:.0f} s of steady windows (x{ratio or 0:.2f}")
        if not gained:
            self.rollback(control, now, f"the canary did not gain: {versus}, needs x{1 + st.bar:.2f})", failed=True,
                          **data)
            return
        if m.peers > 0 and any(p.queue != st.canary and st.of_shape(p) for p in report.serving):
            # The verification's "before" is the peers' steady rate on the old spec, measured beside the
            # canary, not the stalled windows: a decision on start-up facts comes after one window, which
            # may hold the fleet's ramp-up at a fraction of its steady rate and overstate the gain.
            n = st.before_tps / st.before_server_tps if st.before_server_tps else len(report.serving)
            st.before_server_tps, st.before_tps = m.peers, m.peers * n
        self.out.emit(EventKind.CANARY, f"canary {st.canary_label} gained: {versus}); rolling out "
                      f"{self.s.rollout_batch} at a time", **data)
        st.phase, st.phase_since, st.progress_since, st.rolled = Phase.ROLLING_OUT, now, now, [st.canary]
        RollingOut(self.s, st, self.out).step(report, control, now)


class RollingOut(PhaseStep):
    """A few queues at a time onto the target, until every present server of the shape serves it."""

    def step(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.st
        target = st.target_spec
        broken = [v for v in report.servers if v.queue in st.rolled and v.cls == DOWN
                  and v.generation == target.generation]
        if broken:
            self.rollback(control, now, "; ".join(f"{v.label} failed on {target.describe()}: {'; '.join(v.reasons)}"
                                                  for v in broken), failed=True)
            return
        present = [v for v in sorted(report.servers, key=by_gpu) if v.cls != SILENT and st.of_shape(v)]
        moved = {v.queue for v in present if v.serving and v.generation == target.generation}
        # A queue whose worker is gone does not block the rollout: its override waits for it.
        pending = [v.queue for v in present if v.queue in st.rolled and v.queue not in moved]
        todo = [v for v in present if v.queue not in st.rolled]
        for v in todo[:max(0, self.s.rollout_batch - len(pending))]:
            st.rolled.append(v.queue)
            st.progress_since = now
            self.out.add(SetOverride(v.queue, target))
            self.out.emit(EventKind.ROLLOUT, f"{v.label} -> {target.describe()} (generation {target.generation})",
                          queue=v.queue, worker=v.worker)
        todo = [v for v in todo if v.queue not in st.rolled]
        pending = [v.queue for v in present if v.queue in st.rolled and v.queue not in moved]
        mixed = any(not st.of_shape(v) for v in report.servers if v.cls != SILENT)
        if not pending and not todo:
            of_shape = f" of shape {st.shape}" if mixed else ""
            self.to_verifying(target, now, f"all {len(moved)} serving GPUs{of_shape} serve {target.describe()}",
                              mixed=mixed)
        elif self.timed_out(st.progress_since, now):
            late = ", ".join(v.label for v in present if v.queue in pending)
            self.to_verifying(target, now, f"carrying on after {self.s.phase_timeout_s:g} s without progress "
                              f"({late or 'nobody'} not serving it yet: the fleet spec will move them)", mixed=mixed)

    def to_verifying(self, target: ServerSpec, now: float, why: str, *, mixed: bool) -> None:
        st = self.st
        if mixed:  # servers of other shapes (or work) keep theirs: the change stays as per-queue overrides
            others = "servers of other shapes" if not st.keep else "the other servers (other shapes, or work the " \
                     "plan predicts another rung for)"
            self.out.emit(EventKind.ROLLED_OUT, f"{why}; {others} keep their spec (generation "
                          f"{target.generation} is per queue)", target=st.target, rolled=st.rolled, shape=st.shape,
                          keep=st.keep)
        else:
            self.out.add(SetFleet(target))
            self.out.emit(EventKind.ROLLED_OUT, f"{why}; it is now the fleet's spec (generation "
                          f"{target.generation})", target=st.target, rolled=st.rolled, shape=st.shape)
        st.phase, st.phase_since, st.measured, st.confounded = Phase.VERIFYING, now, [], ""


class Verifying(PhaseStep):
    """The moved servers' per-server tokens/s on steady windows against the old spec's steady rate."""

    def step(self, report: WindowReport, control: Control, now: float) -> None:
        st = self.st
        serving = [v for v in report.serving if st.of_shape(v)]
        measure_fleet(st, report, serving)
        done = enough(st.measured_s, self.s.verify_windows, report)
        if not done and report.backlog > 0 and not self.timed_out(st.phase_since, now):
            return
        slots = sorted({v.effective_max for v in serving})
        measured = Measured.of(st.measured)
        if measured is None:
            why = "the run drained first" if report.backlog == 0 else st.confounded
            self.out.emit(EventKind.VERIFIED, f"unverified: no steady window after the rollout ({why}); slots per "
                          f"GPU {slots}", ratio=None, slots=slots, target=st.target, decide_s=st.decide_s)
        else:
            self.verdict(serving, slots, measured)
        st.back_to_observing()

    def verdict(self, serving: list[ServerView], slots: list[int], m: Measured) -> None:
        st = self.st
        target = st.target_spec
        ratio = m.peers / st.before_server_tps if st.before_server_tps else None
        if ratio is not None and ratio > 1:
            # The fleet's memory: the next run of the same kind of server starts here.
            entry = Remembered(spec=replace(target, generation=0), ratio=round(ratio, 3), slots=slots)
            keys = {f for f in (memory_field(v) for v in serving if v.generation == target.generation) if f}
            if keys:
                self.out.add(Remember({f: entry for f in sorted(keys)}))
        hits = [v.cache_hit_rate for v in serving if v.cache_hit_rate is not None]
        predicted = [v.predicted_hit for v in serving if v.predicted_hit is not None]
        hit = f"; hit rate {statistics.fmean(hits):.0%} measured" if hits else ""
        hit += f", {statistics.fmean(predicted):.0%} predicted by the plan" if hits and predicted else ""
        self.out.emit(EventKind.VERIFIED, f"fleet {st.before_tps:,.0f} -> {m.rate:,.0f} tok/s"
                      + (f" (x{ratio:.2f} per server)" if ratio else "")
                      + f" over {m.seconds:.0f} s of steady windows, slots per GPU {slots} (predicted "
                      f"x{st.predicted:.2f}){hit}", before_tokens_per_s=round(st.before_tps, 1),
                      measured_hit=round(statistics.fmean(hits), 4) if hits else None,
                      predicted_hit=round(statistics.fmean(predicted), 4) if predicted else None,
                      after_tokens_per_s=round(m.rate, 1), before_server_tokens_per_s=round(st.before_server_tps, 1),
                      after_server_tokens_per_s=round(m.peers, 1), ratio=round(ratio, 3) if ratio else None,
                      measured_s=round(m.seconds, 1), slots=slots, target=st.target, decide_s=st.decide_s,
                      predicted_ratio=round(st.predicted, 3))
