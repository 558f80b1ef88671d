"""What holds each server back, judged over one observation window of fleet snapshots. Pure: no Redis.

Classes, checked in this order (the first that fits wins):

| class | meaning | the fix is |
| --- | --- | --- |
| down | the worker reports its server down (e.g. failed to start) | the worker's message |
| restarting | starting, draining for a new spec, or restarting | wait |
| hung | in flight but no token and no finished prompt over the whole window | the worker's health check |
| draining | no backlog left in Redis: the run is finishing | nothing |
| kv-bound | full-KV usage high, or the server retracted requests | fewer slots, not more |
| client-bound | the server runs below its capacity while Redis holds work | ours: worker cap, dispatch, Redis |
| mamba-bound | running pinned at the effective max, backlog waiting, mamba high, KV low | a cheaper strategy |
| saturated-healthy | running pinned at the effective max, nothing else stands out | nothing |

Peer outliers are flagged separately: a GPU whose capacity or tokens/s is far from the median of
the others (the seed operator only ever looked at GPU 0).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from batchfleet.records import WorkerStatus

from .fleet import FleetSnapshot

__all__ = ["CLASSES", "ServerView", "Thresholds", "WindowReport", "classify_window", "server_tokens_per_s"]

DOWN, RESTARTING, HUNG, DRAINING = "down", "restarting", "hung", "draining"
KV_BOUND, CLIENT_BOUND, MAMBA_BOUND, SATURATED = "kv-bound", "client-bound", "mamba-bound", "saturated-healthy"
CLASSES = (DOWN, RESTARTING, HUNG, DRAINING, KV_BOUND, CLIENT_BOUND, MAMBA_BOUND, SATURATED)


@dataclass(frozen=True, slots=True)
class Thresholds:
    pinned: float = 0.9  # mean running within max(1, 10 %) of the effective max: the server is full
    mamba_high: float = 0.5  # sglang:mamba_usage (evictable states count as free)
    kv_low: float = 0.5  # full-KV usage below this: KV has room to spare
    kv_high: float = 0.9  # full-KV usage at or above this: KV binds
    outlier: float = 0.25  # |value - peers' median| / median beyond this: flag the GPU


@dataclass(frozen=True, slots=True)
class ServerView:
    """One server over one window (means over the window's samples unless said otherwise)."""

    worker: str
    gpu: int | None
    cls: str
    reasons: list[str]
    state: str  # at the end of the window
    strategy: str
    generation: int
    effective_max: int
    in_flight: float
    running: float | None
    kv: float | None
    mamba: float | None
    cache_hit_rate: float | None
    tokens_per_s: float  # the server's gen_throughput when it reports one, else the worker's measure
    retracted: float  # retractions during the window
    outliers: list[str] = field(default_factory=list)

    @property
    def serving(self) -> bool:
        return self.state == "serving"

    @property
    def label(self) -> str:
        return f"gpu{self.gpu}" if self.gpu is not None else self.worker


@dataclass(frozen=True, slots=True)
class WindowReport:
    start: float
    end: float
    servers: list[ServerView]
    backlog: int  # prompts waiting in Redis at the end of the window
    eta_s: float | None

    @property
    def serving(self) -> list[ServerView]:
        return [s for s in self.servers if s.serving]

    @property
    def fleet_tokens_per_s(self) -> float:
        return sum(s.tokens_per_s for s in self.serving)

    def by_class(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for s in self.servers:
            out.setdefault(s.cls, []).append(s.worker)
        return out

    def majority(self, cls: str) -> bool:
        """More than half of the serving servers are in `cls`."""
        serving = self.serving
        return bool(serving) and 2 * sum(s.cls == cls for s in serving) > len(serving)

    def get(self, worker: str) -> ServerView | None:
        return next((s for s in self.servers if s.worker == worker), None)


def server_tokens_per_s(w: WorkerStatus) -> float:
    """Prefer the server's own gen_throughput (same clock as its peers, simulated time under the
    simulator); fall back to what the worker measured."""
    g = w.metrics.gen_throughput
    return float(g) if g is not None else w.tokens_per_s


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _classify_one(samples: list[WorkerStatus], backlog: int, th: Thresholds) -> tuple[str, list[str]]:
    last = samples[-1]
    if last.state == "down":
        return DOWN, [last.message or "the worker reports its server down"]
    if last.state != "serving":
        return RESTARTING, [f"state {last.state}" + (f": {last.message}" if last.message else "")]
    serving = [s for s in samples if s.state == "serving"]
    first = serving[0]
    tokens = [s.metrics.generation_tokens_total for s in serving]
    progressed = last.done + last.failed > first.done + first.failed or (
        None not in tokens and tokens[-1] != tokens[0])
    if len(serving) >= 2 and all(s.in_flight > 0 for s in serving) and not progressed:
        return HUNG, [f"{last.in_flight} in flight, no token and no finished prompt over the window"]
    if backlog == 0:
        return DRAINING, ["no backlog left in Redis"]
    cap = max(last.effective_max, 1)
    running = _mean([s.metrics.running if s.metrics.running is not None else s.in_flight for s in serving]) or 0.0
    kv = _mean([s.metrics.full_kv_usage for s in serving])
    mamba = _mean([s.metrics.mamba_usage for s in serving])
    retracted = [s.metrics.retracted for s in serving if s.metrics.retracted is not None]
    kv_peak = max((s.metrics.full_kv_usage or 0.0) for s in serving)
    if kv_peak >= th.kv_high or (retracted and retracted[-1] > retracted[0]):
        why = [f"full-KV usage up to {kv_peak:.0%}"]
        if retracted and retracted[-1] > retracted[0]:
            why.append(f"{retracted[-1] - retracted[0]:.0f} request(s) retracted")
        return KV_BOUND, why
    queued = _mean([s.metrics.queued for s in serving])
    if running < cap - max(1.0, (1 - th.pinned) * cap):  # one slot refilling is not a stall on small servers
        if queued is not None and queued >= 1:
            # Below its cap with requests of ours waiting inside it: the server will not admit them
            # (its KV pool's admission budget is spent), so our side is not what holds it back.
            return KV_BOUND, [f"running {running:.0f} of {cap} with {queued:.0f} waiting in the server: its KV "
                              f"pool admits no more (full-KV usage up to {kv_peak:.0%})"]
        in_flight = statistics.fmean(s.in_flight for s in serving)
        why = [f"running {running:.0f} of {cap} while Redis holds {backlog} prompt(s): our side is slow"]
        if in_flight < cap - max(1.0, (1 - th.pinned) * cap):
            why.append(f"the worker keeps only {in_flight:.0f} in flight (BATCHFLEET_MAX_IN_FLIGHT, dispatch or "
                       "Redis), not the server")
        return CLIENT_BOUND, why
    if mamba is not None and mamba >= th.mamba_high and (kv is None or kv < th.kv_low):
        return MAMBA_BOUND, [f"running pinned at {cap}, {backlog} waiting, mamba usage {mamba:.0%}, "
                             f"KV usage {(kv or 0):.0%}: the mamba state pool caps concurrency"]
    return SATURATED, [f"running pinned at {cap}; mamba {_pct(mamba)}, KV {_pct(kv)}: nothing to gain by restarting"]


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


def _outliers(views: list[ServerView], th: Thresholds) -> dict[str, list[str]]:
    serving = [v for v in views if v.serving and v.effective_max > 0]
    out: dict[str, list[str]] = {}
    if len(serving) < 3:  # with two, "far from the other" does not say which one is odd
        return out
    for v in serving:
        peers = [p for p in serving if p is not v]
        for name, mine, theirs in (("capacity", v.effective_max, [p.effective_max for p in peers]),
                                   ("tokens/s", v.tokens_per_s, [p.tokens_per_s for p in peers])):
            med = statistics.median(theirs)
            if med > 0 and abs(mine - med) / med > th.outlier:
                out.setdefault(v.worker, []).append(f"{name} {mine:,.0f} vs peers' median {med:,.0f}")
    return out


def classify_window(snapshots: Sequence[FleetSnapshot], th: Thresholds | None = None) -> WindowReport:
    """Classify every server seen in the last snapshot over all of `snapshots` (oldest first)."""
    if not snapshots:
        raise ValueError("classify_window needs at least one snapshot; sample the fleet first")
    th = th or Thresholds()
    last = snapshots[-1]
    backlog = last.total_backlog
    views = []
    for w in last.workers:
        samples = [s for snap in snapshots for s in snap.workers if s.worker == w.worker]
        cls, reasons = _classify_one(samples, backlog, th)
        serving = [s for s in samples if s.state == "serving"] or samples
        retracted = [s.metrics.retracted for s in serving if s.metrics.retracted is not None]
        views.append(ServerView(
            worker=w.worker, gpu=w.gpu, cls=cls, reasons=reasons, state=w.state, strategy=w.strategy,
            generation=w.generation, effective_max=w.effective_max,
            in_flight=statistics.fmean(s.in_flight for s in serving),
            running=_mean([s.metrics.running for s in serving]), kv=_mean([s.metrics.full_kv_usage for s in serving]),
            mamba=_mean([s.metrics.mamba_usage for s in serving]), cache_hit_rate=w.metrics.cache_hit_rate,
            tokens_per_s=statistics.fmean(server_tokens_per_s(s) for s in serving),
            retracted=(retracted[-1] - retracted[0]) if retracted else 0.0))
    flagged = _outliers(views, th)
    views = [replace(v, outliers=flagged.get(v.worker, [])) for v in views]
    return WindowReport(start=snapshots[0].ts, end=last.ts, servers=views, backlog=backlog, eta_s=last.eta_s())
