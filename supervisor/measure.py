"""Steady measurement: how fast the canary (or, verifying, the moved fleet) serves, on the part of each
window where it and its peers were full. Pure.

A window's steady part starts at the latest of the window's start and the samples from which every
server compared was filled to its capacity on its generation (`ServerView.steady_since`); it counts
when it spans at least STEADY_SHARE of the window. Rates are the servers' own generation counters over
that very interval, so the canary and its peers feel the same CPU contention and the same Redis. A
window that does not count is *confounded*: the reason is kept (`PilotState.confounded`) and the
autopilot measures longer rather than judge. Each counted window adds a row
`[seconds, rate, peers' rate]` to `PilotState.measured`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .classify import ServerView, WindowReport
from .pilotstate import PilotState

__all__ = ["STEADY_SHARE", "Measured", "enough", "measure_canary", "measure_fleet"]

STEADY_SHARE = 0.3  # of a window that must be steady for it to count


@dataclass(frozen=True, slots=True)
class Measured:
    """The rows measured so far, weighted by their seconds."""

    seconds: float
    rate: float  # the canary's tokens/s (verifying: the moved fleet's total)
    peers: float  # its peers' tokens/s per server (verifying: the moved fleet's, per server)

    @classmethod
    def of(cls, rows: list[list[float]]) -> Measured | None:
        seconds = sum(m[0] for m in rows)
        if not seconds:
            return None
        return cls(seconds, sum(m[0] * m[1] for m in rows) / seconds, sum(m[0] * m[2] for m in rows) / seconds)


def enough(seconds: float, windows: int, report: WindowReport) -> bool:
    """`seconds` of steady measurement make `windows` windows' worth (within a tenth: windows are sampled)."""
    return seconds >= 0.9 * windows * report.length


def measure_canary(st: PilotState, report: WindowReport, canary: ServerView, since: float | None) -> bool:
    """Add this window's steady part (the canary full from `since`, against its steady peers of the same
    shape on the old spec) to the measurement; False, with the reason kept, when there is none so far."""
    if since is None:
        st.confounded = f"the canary is not full ({canary.in_flight:.0f} of {canary.effective_max} in flight)"
        return bool(st.measured)
    gen = st.target_spec.generation
    peers = [p for p in report.serving if p.queue != st.canary and p.generation != gen and st.of_shape(p)]
    steady = [(p, s) for p, s in ((p, p.steady_since(p.generation)) for p in peers) if s is not None]
    if peers and not steady:
        st.confounded = "no peer is steady (" + ", ".join(f"{p.label} {p.cls}" for p in peers) + ")"
        return bool(st.measured)
    t0, t1 = max([report.start, since, *(s for _, s in steady)]), report.end
    if t1 - t0 < STEADY_SHARE * report.length:
        st.confounded = f"only {t1 - t0:.1f} s of this window were steady"
        return bool(st.measured)
    mine = canary.rate(t0, t1)
    theirs = [r for r in (p.rate(t0, t1) for p, _ in steady) if r is not None]
    if mine is None or (steady and not theirs):
        st.confounded = "no tokens/s figure for the canary or its peers"
        return bool(st.measured)
    # With no peer at all (a one-GPU fleet) the stalled windows' per-server rate stands in.
    st.measured.append([round(t1 - t0, 3), mine, statistics.fmean(theirs) if theirs else st.before_server_tps])
    st.confounded = ""
    return True


def measure_fleet(st: PilotState, report: WindowReport, serving: list[ServerView]) -> None:
    """Verifying: add this window's steady part, every one of `serving` full on the target, to the
    measurement (the fleet's total and its per-server mean); otherwise keep why not."""
    if not serving or report.backlog == 0:
        return
    steady = [v.steady_since(st.target_spec.generation) for v in serving]
    if None in steady:
        st.confounded = "not every server is full yet: " + ", ".join(
            f"{v.label} {v.cls}" for v, s in zip(serving, steady, strict=True) if s is None)
        return
    t0, t1 = max([report.start, *(s for s in steady if s is not None)]), report.end
    rates = [v.rate(t0, t1) for v in serving]
    if t1 - t0 >= STEADY_SHARE * report.length and None not in rates:
        st.measured.append([round(t1 - t0, 3), sum(r or 0.0 for r in rates), statistics.fmean(r or 0.0 for r in rates)])
    else:
        st.confounded = f"only {t1 - t0:.1f} s of this window were steady"
