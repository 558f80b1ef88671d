"""What one server's restart costs, and whether a change pays for its restarts. Pure.

The cost, in order of trust: what the canary's own restart measured (its downtime plus its time to fill
again; the median once there are several); `--restart-cost`; the median of what the workers of the
canary's shape measured (their servers' last start, launch to healthy, plus their last drain);
ASSUMED_COST_S. A change pays when the time it saves on the work left exceeds the cost `factor` times.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from batchfleet.records import Event, EventKind

from .classify import WindowReport
from .pilotstate import Phase, PilotState

__all__ = ["ASSUMED_COST_S", "Worth", "learn_canary_restart", "price_restart", "restart_filled", "worth"]

ASSUMED_COST_S = 300.0  # a real 27B load, when no worker published how long its server takes


def price_restart(learned: Sequence[float], override_s: float | None, report: WindowReport | None = None,
                  shape: str = "") -> tuple[float, str]:
    """(one server's restart cost, where it comes from): `learned` are the canaries' measures,
    `override_s` is `--restart-cost`, `report` holds the workers' measures (see the module docstring)."""
    if learned:
        return statistics.median(learned), "measured by the canary"
    if override_s is not None:
        return override_s, "--restart-cost"
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


def learn_canary_restart(st: PilotState, report: WindowReport, events: Sequence[Event]) -> None:
    """Keep the canary's `restarted` event (its downtime) until it has filled again (`restart_filled`)."""
    if st.phase != Phase.CANARY or not st.target:
        return
    gen = st.target_spec.generation
    names = {v.worker: v.queue for v in report.servers}
    for e in events:
        if e.kind is not EventKind.RESTARTED or e.data.get("generation") != gen:
            continue
        queue = e.data.get("queue") or names.get(e.source)
        if queue == st.canary and isinstance(e.data.get("downtime_s"), int | float):
            st.canary_restart = {"ts": e.ts, "downtime_s": float(e.data["downtime_s"])}


def restart_filled(st: PilotState, since: float) -> None:
    """The canary is full again from `since`: its restart cost is its downtime plus the time to fill."""
    restart = st.canary_restart
    if restart and "filled" not in restart:
        restart["filled"] = since
        st.restart_costs = [*st.restart_costs, round(restart["downtime_s"] + max(0.0, since - restart["ts"]), 2)]


@dataclass(frozen=True, slots=True)
class Worth:
    """A change's worth: the time it saves on the work left against what a restart costs."""

    eta_s: float  # the work left, seconds at the fleet's rate
    saved_s: float
    cost_s: float
    cost_how: str  # where the cost comes from (price_restart)
    factor: float

    @property
    def pays(self) -> bool:
        return self.saved_s > self.cost_s * self.factor

    def describe(self) -> str:
        return (f"~{self.saved_s:,.0f} s saved of {self.eta_s:,.0f} s left vs restart cost {self.cost_s:,.1f} s "
                f"({self.cost_how}) x{self.factor:g}")


def worth(eta_s: float, ratio: float, cost: tuple[float, str], factor: float) -> Worth:
    """What a change expected to multiply capacity by `ratio` saves of `eta_s`, against `cost`."""
    saved = eta_s * (1 - 1 / ratio) if ratio > 1 else 0.0
    return Worth(eta_s=eta_s, saved_s=saved, cost_s=cost[0], cost_how=cost[1], factor=factor)
