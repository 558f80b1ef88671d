"""What holds each server back, judged over one observation window of fleet snapshots. Pure: no Redis.

Classes, checked in this order (the first that fits wins):

| class | meaning | the fix is |
| --- | --- | --- |
| down | the worker reports its server down (e.g. failed to start) | the worker's message |
| silent | the worker's status record was not rewritten for 10 s: it is gone or stuck | its host |
| restarting | starting, draining for a new spec, or restarting | wait |
| hung | in flight but no token and no finished prompt over the whole window | the worker's health check |
| idle | the run has ended (its marker says so): nothing left to serve | nothing |
| draining | no backlog in Redis, or too little for the fleet's free slots or (all fed) within its reach | nothing |
| client-bound | the worker offers its server fewer requests than it can run | ours: worker cap, dispatch, Redis |
| kv-bound | retractions, full-KV usage high, or a queue in the server with KV near full | fewer slots |
| mamba-bound | offered its capacity, capped by the mamba state pool, KV mostly free | a cheaper strategy |
| saturated-healthy | offered its capacity, nothing else stands out | nothing |

Everything is judged from **window aggregates**, never from one gauge reading: with short generations
requests turn over every few steps, so an instantaneous `num_running_reqs` sits a few below the cap
while the next requests wait in the server's queue or are in transit. The worker's own in-flight
count (what it offers the server) against the server's capacity tells client-bound from the rest;
the server's time-averaged running + queued, KV usage projected to the cap, and retractions tell
KV-bound; and the **static facts** the server gave at start-up (`ServerFacts`: the cap and its cause,
the mamba pool and its slots per request) tell mamba-bound at once, whatever the gauges flicker
(evidence "static"). Without facts (a worker that does not publish them) mamba-bound falls back on
the gauges (evidence "gauges": `sglang:mamba_usage` ≥ 50 % — evictable cached states count as free,
so a capped pool reads ~60-70 %, not 100 %).

Peer outliers are flagged separately, only among servers that are steady (offered their capacity,
backlog waiting) and served the same generation for the whole window: a server that is draining, filling
or restarted within the window is not compared.
Across hosts, a host whose GPUs are all far below the other hosts' is flagged once, as a host.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from batchfleet.keys import PROMPT_TOKENS, STORE_WAITING
from batchfleet.records import CapCause, ServerFacts, ServerSpec, Strategy, WorkerState, WorkerStatus
from batchfleet.sglang import flag_value

from .fleet import FleetSnapshot
from .ladder import current_spec

__all__ = ["CLASSES", "Point", "ServerClass", "ServerView", "Thresholds", "WindowReport", "classify_window"]


class ServerClass(StrEnum):
    DOWN = "down"
    RESTARTING = "restarting"
    SILENT = "silent"
    HUNG = "hung"
    DRAINING = "draining"
    IDLE = "idle"
    CLIENT_BOUND = "client-bound"
    KV_BOUND = "kv-bound"
    MAMBA_BOUND = "mamba-bound"
    SATURATED = "saturated-healthy"


C = ServerClass
DOWN, RESTARTING, SILENT, HUNG, DRAINING, IDLE = C.DOWN, C.RESTARTING, C.SILENT, C.HUNG, C.DRAINING, C.IDLE
KV_BOUND, CLIENT_BOUND, MAMBA_BOUND, SATURATED = C.KV_BOUND, C.CLIENT_BOUND, C.MAMBA_BOUND, C.SATURATED
del C
CLASSES = tuple(ServerClass)
STEADY = (MAMBA_BOUND, SATURATED, KV_BOUND)  # offered their capacity with a backlog: comparable


@dataclass(frozen=True, slots=True)
class Thresholds:
    pinned: float = 0.9  # offered/running within max(1, 10 %) of the capacity: the server is full
    mamba_high: float = 0.5  # sglang:mamba_usage (evictable states count as free); gauge fallback only
    kv_low: float = 0.5  # KV usage projected to the cap below this: KV has room to spare
    kv_high: float = 0.9  # full-KV usage peak at or above this: KV binds
    kv_admit: float = 0.7  # below the cap with a queue inside and projected KV above this: KV admission binds
    outlier: float = 0.25  # |value - peers' median| / median beyond this: flag the GPU (or the host)

    def tolerance(self, cap: int) -> float:
        """Slots a full server may show free (one refilling is not a stall on a small server)."""
        return max(1.0, (1 - self.pinned) * cap)


@dataclass(frozen=True, slots=True)
class Point:
    """One server in one snapshot, as much as the autopilot needs to measure steady intervals."""

    ts: float  # the supervisor's clock (snapshot time)
    serving: bool
    generation: int
    filled: bool  # the worker offered (nearly) its server's capacity
    tokens: float | None  # the server's generation_tokens_total counter
    tokens_ts: float | None  # when the worker scraped it (the worker's clock: rates never mix clocks)
    gen_tps: float | None  # sglang:gen_throughput


def _rate(points: Sequence[Point]) -> float | None:
    """Tokens/s over `points` from the counter (one server process: restarts reset it), else the
    mean gen_throughput gauge; None when neither says."""
    pairs: list[tuple[float, float]] = []
    for p in points:
        if p.tokens is None or p.tokens_ts is None or not p.serving:
            continue
        if pairs and p.tokens < pairs[-1][1]:
            pairs = []  # a new server process: its counter started over
        if not pairs or p.tokens_ts > pairs[-1][0]:
            pairs.append((p.tokens_ts, p.tokens))
    if len(pairs) >= 2 and pairs[-1][0] - pairs[0][0] >= 0.5:
        return (pairs[-1][1] - pairs[0][1]) / (pairs[-1][0] - pairs[0][0])
    gauges = [p.gen_tps for p in points if p.serving and p.gen_tps is not None]
    return statistics.fmean(gauges) if gauges else None


@dataclass(frozen=True, slots=True)
class ServerView:
    """One server over one window (means over the window's serving samples unless said otherwise)."""

    worker: str
    queue: str
    host: str
    gpu: int | None
    label: str  # gpuN, or host/gpuN when the fleet spans hosts
    cls: ServerClass
    reasons: list[str]
    state: WorkerState  # at the end of the window
    strategy: Strategy
    generation: int
    effective_max: int
    slots: int  # the worker's in-flight limit
    in_flight: float
    running: float | None
    queued: float | None
    kv: float | None
    mamba: float | None
    cache_hit_rate: float | None  # its prompt tokens given by the radix cache (the run's, else the gauge)
    tokens_per_s: float  # over the window: the server's counter, else its gauge, else the worker's measure
    retracted: float  # retractions during the window
    evidence: str = ""  # mamba-bound: "static" (start-up facts) or "gauges"
    filling: bool = False  # client-bound only because its worker is still filling new slots
    facts: ServerFacts | None = None
    points: tuple[Point, ...] = ()
    outliers: list[str] = field(default_factory=list)
    # The server's parallel layout ("tp1", "tp4", "tp2dp2+dpattn"; a record without one, "", reads "tp1"):
    # servers are compared only with peers of the same shape.
    shape: str = "tp1"
    start_s: float | None = None  # its worker's measure of its last start, launch to healthy
    drain_s: float | None = None  # ... of its last drain for a restart
    model: str = ""  # --model-path of its command line
    spec: ServerSpec | None = None  # what it runs, read back from its command line (generation: the worker's)
    gpu_name: str = ""
    gpu_memory_mib: int | None = None
    predicted_hit: float | None = None  # the prefix plan's prediction for its queue (`FleetView.predicted_hit`)

    @property
    def serving(self) -> bool:
        """Serving, as far as anyone can tell: a silent record (its worker gone) says nothing now."""
        return self.state is WorkerState.SERVING and self.cls != ServerClass.SILENT

    def steady_since(self, generation: int | None = None) -> float | None:
        """The start of the trailing run of samples where this server served (`generation`) and its
        worker offered its capacity; None if the last sample is not such a one."""
        since = None
        for p in reversed(self.points):
            if not (p.serving and p.filled and (generation is None or p.generation == generation)):
                break
            since = p.ts
        return since

    def rate(self, t0: float, t1: float) -> float | None:
        """Tokens/s between two supervisor times (samples at or inside the bounds)."""
        return _rate([p for p in self.points if t0 <= p.ts <= t1])


@dataclass(frozen=True, slots=True)
class WindowReport:
    start: float
    end: float
    servers: list[ServerView]
    backlog: int  # prompts waiting in Redis at the end of the window
    eta_s: float | None
    hosts: dict[str, list[str]] = field(default_factory=dict)  # host -> why it stands out (as a host)
    eta_lower: bool = False  # eta_s is only a lower bound (no prompt had succeeded): see FleetView.eta
    prompt_tokens: float | None = None  # per finished request, as the servers count them (the run's)
    completion_tokens: float | None = None  # ... and their completion tokens

    @property
    def serving(self) -> list[ServerView]:
        return [s for s in self.servers if s.serving]

    @property
    def fleet_tokens_per_s(self) -> float:
        return sum(s.tokens_per_s for s in self.serving)

    @property
    def length(self) -> float:
        return max(self.end - self.start, 1e-6)

    def by_class(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for s in self.servers:
            out.setdefault(str(s.cls), []).append(s.label)
        return out

    def majority(self, cls: str) -> bool:
        """More than half of the serving servers are in `cls`."""
        serving = self.serving
        return bool(serving) and 2 * sum(s.cls == cls for s in serving) > len(serving)

    def get(self, worker: str) -> ServerView | None:
        return next((s for s in self.servers if s.worker == worker), None)

    def by_queue(self, queue: str) -> ServerView | None:
        return next((s for s in self.servers if s.queue == queue), None)


def _or(first: float | None, then: float | None) -> float | None:
    return first if first is not None else then


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.0%}"


@dataclass(frozen=True, slots=True)
class _Agg:
    """Window aggregates of one server's serving samples."""

    cap: int
    offered: float  # mean in-flight the worker keeps (requests it offers the server)
    limit: int  # the worker's in-flight limit
    running: float
    queued: float
    kv: float | None
    kv_peak: float
    kv_at_cap: float | None  # KV usage projected to a full server
    mamba: float | None
    retracted: float
    surplus: int


def _aggregate(serving: list[WorkerStatus]) -> _Agg:
    last = serving[-1]
    cap = max(last.effective_max, 1)
    running = _mean([s.metrics.running if s.metrics.running is not None else s.in_flight for s in serving]) or 0.0
    kv = _mean([s.metrics.full_kv_usage for s in serving])
    retracted = [s.metrics.retracted for s in serving if s.metrics.retracted is not None]
    return _Agg(
        cap=cap, offered=statistics.fmean(s.in_flight for s in serving), limit=last.slots or cap, running=running,
        queued=_mean([s.metrics.queued for s in serving]) or 0.0, kv=kv,
        kv_peak=max((s.metrics.full_kv_usage or 0.0) for s in serving),
        kv_at_cap=None if kv is None else kv * cap / max(running, 1.0),
        mamba=_mean([s.metrics.mamba_usage for s in serving]),
        retracted=(retracted[-1] - retracted[0]) if retracted else 0.0, surplus=last.surplus)


Judged = tuple[ServerClass, list[str], str]  # (class, reasons, evidence)


def _classify_one(samples: list[WorkerStatus], backlog: int, short_of: float, silent: bool, ended: bool,
                  th: Thresholds, reach: int | None = None) -> Judged:
    """(class, reasons, evidence), checked in the order of the module docstring's table; evidence is
    "static"/"gauges" for mamba-bound, "filling" for a client-bound server whose worker is still filling
    its slots, else "". `reach`: the prompts waiting that its worker may claim (`FleetView.within_reach`),
    None while the store holds prompts not fed yet (an empty queue is then the feed's lag, our side)."""
    last = samples[-1]
    off = _not_serving(last, silent)
    if off is not None:
        return off
    serving = [s for s in samples if s.state is WorkerState.SERVING and s.generation == last.generation]
    if len(serving) >= 2 and all(s.in_flight > 0 for s in serving) and not _progressed(serving):
        return HUNG, [f"{last.in_flight} in flight, no token and no finished prompt over the window"], ""
    if backlog == 0:
        return (IDLE, ["the run has ended: nothing left to serve"], "") if ended else (
            DRAINING, ["no backlog left in Redis"], "")
    a = _aggregate(serving)
    # Offered less than its capacity, and the server runs what it is offered (no more waits inside than
    # the surplus): our side. A worker holding fewer than the server's slots because its KV pool holds
    # no more (worker/slots.py KvBound) leaves a queue inside: the server's, below.
    if a.offered < a.cap - th.tolerance(a.cap) and a.queued <= a.surplus + 1:
        return _offered_less(a, serving, late=2 * len(serving) < len(samples), backlog=backlog, short_of=short_of,
                             reach=reach, th=th)
    # The worker offers the server its capacity: what the server does with it is the server's.
    return _kv_bound(a, th) or _mamba_bound(a, last, backlog, th) or _saturated(a, last.facts)


def _not_serving(last: WorkerStatus, silent: bool) -> Judged | None:
    """Down (failed: its GPU takes no work), silent, or between two servers; None while it serves."""
    if last.state is WorkerState.DOWN or last.state is WorkerState.FAILED:
        return DOWN, [(f"{last.state}: " if last.state is WorkerState.FAILED else "")
                      + (last.message or "the worker reports its server down")], ""
    if silent:
        return SILENT, ["its status record stopped changing: the worker is gone or stuck"], ""
    if last.state is not WorkerState.SERVING:
        return RESTARTING, [f"state {last.state}" + (f": {last.message}" if last.message else "")], ""
    return None


def _progressed(serving: list[WorkerStatus]) -> bool:
    """A prompt finished, or the server's token counter moved, between the first and the last sample."""
    first, last = serving[0], serving[-1]
    tokens = [s.metrics.generation_tokens_total for s in serving]
    return last.done + last.failed > first.done + first.failed or (None not in tokens and tokens[-1] != tokens[0])


def _offered_less(a: _Agg, serving: list[WorkerStatus], *, late: bool, backlog: int, short_of: float,
                  reach: int | None, th: Thresholds) -> Judged:
    """The worker offers its server less than its capacity: our side, unless the run is ending."""
    tol = th.tolerance(a.cap)
    first, last = serving[0], serving[-1]
    if late:  # it began serving (again) late in this window: its worker is still taking work, not slow
        return CLIENT_BOUND, [f"running {a.running:.0f} of {a.cap}: serving since late in this window",
                              f"the worker is still filling its {a.limit} slots"], "filling"
    if backlog < short_of:
        return DRAINING, [f"the backlog ({backlog}) no longer fills the fleet's free slots ({short_of:.0f})"], ""
    if reach is not None and reach < a.cap - a.offered:
        # the run's tail: what is left waits in other GPUs' queues, for their own workers (worker/steal.py)
        return DRAINING, [f"all is fed; of the {backlog} prompt(s) waiting, {reach} are within its worker's reach "
                          f"(the rest wait for their own GPUs' workers): too few for its free slots "
                          f"({a.cap - a.offered:.0f})"], ""
    why = [f"running {a.running:.0f} of {a.cap} while Redis holds {backlog} prompt(s): our side is slow"]
    if a.limit < a.cap - tol:
        why.append(f"the worker's in-flight limit is {a.limit} (BATCHFLEET_MAX_IN_FLIGHT), under the server's {a.cap}")
        return CLIENT_BOUND, why, ""
    if last.in_flight > first.in_flight + tol:
        why.append(f"the worker is still filling its {a.limit} slots ({first.in_flight} -> {last.in_flight} in flight)")
        return CLIENT_BOUND, why, "filling"
    why.append(f"the worker keeps only {a.offered:.0f} of its {a.limit} slots busy (dispatch or Redis), not the server")
    return CLIENT_BOUND, why, ""


def _kv_bound(a: _Agg, th: Thresholds) -> Judged | None:
    """Retractions or a full-KV peak; or, below the cap with a queue inside, a KV pool that admits no more."""
    if a.retracted > 0 or a.kv_peak >= th.kv_high:
        why = [f"full-KV usage up to {a.kv_peak:.0%}"]
        if a.retracted > 0:
            why.append(f"{a.retracted:.0f} request(s) retracted")
        return KV_BOUND, why, ""
    below = a.running < a.cap - th.tolerance(a.cap)
    if below and a.queued > a.surplus + 1 and a.kv_at_cap is not None and a.kv_at_cap >= th.kv_admit:
        return KV_BOUND, [f"running {a.running:.0f} of {a.cap} with {a.queued:.0f} waiting in the server: its KV pool "
                          f"admits no more (full-KV usage {a.kv:.0%}, {a.kv_at_cap:.0%} at the cap)"], ""
    return None


def _mamba_bound(a: _Agg, last: WorkerStatus, backlog: int, th: Thresholds) -> Judged | None:
    """Capped by its mamba state pool with KV mostly free: from its start-up facts ("static"), or, when
    the server did not say what caps it (a worker or server without facts), from its gauges."""
    facts = last.facts
    kv_free = a.kv_at_cap is None or a.kv_at_cap < th.kv_low
    if facts is not None and facts.cap_cause is CapCause.MAMBA and facts.effective_max_running == last.effective_max \
            and kv_free:
        pool = (f"{facts.mamba_pool} state slots, {facts.slots_per_request} per request" if facts.mamba_pool
                else "its pool")
        return MAMBA_BOUND, [f"capped at {a.cap} by its mamba state pool ({pool}) with KV mostly free "
                             f"({_pct(a.kv)} used, {_pct(a.kv_at_cap)} at the cap); {backlog} waiting; "
                             f"the worker offers {a.offered:.0f}"], "static"
    if (facts is None or facts.cap_cause is CapCause.UNKNOWN) and a.running + a.queued >= a.cap - th.tolerance(a.cap) \
            and a.mamba is not None and a.mamba >= th.mamba_high and a.kv is not None and a.kv < th.kv_low:
        return MAMBA_BOUND, [f"running pinned at {a.cap}, {backlog} waiting, mamba usage {a.mamba:.0%}, "
                             f"KV usage {a.kv:.0%}: the mamba state pool caps concurrency"], "gauges"
    return None


def _saturated(a: _Agg, facts: ServerFacts | None) -> Judged:
    cause = f" (capped by {facts.cap_cause})" if facts is not None and facts.cap_cause is not CapCause.UNKNOWN else ""
    return SATURATED, [f"running {a.running:.0f} of {a.cap}{cause}; mamba {_pct(a.mamba)}, KV {_pct(a.kv)}: "
                       "nothing to gain by restarting"], ""


def _flag(views: list[ServerView], th: Thresholds) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(worker -> flags, host -> flags). Only steady servers are compared, and only with servers of the
    same generation (a canary is not an outlier). A host whose GPUs all sit far below the other hosts'
    median is flagged once, as a host, and its GPUs are then neither flagged nor used as peers."""
    gpus: dict[str, list[str]] = {}
    hosts: dict[str, list[str]] = {}
    # Steady for the whole window, on its generation: a server restarted within the window (a rollout's)
    # has a window rate that counts its downtime, far below its peers' for no fault of its own, and it
    # would drag the peers' median with it (with three GPUs, every one would read as an outlier).
    steady = [v for v in views if v.cls in STEADY and v.effective_max > 0 and v.points
              and all(p.serving and p.generation == v.generation for p in v.points)]
    # Peers: same generation AND same shape (a TP4 server runs another model size at another speed
    # than a TP1 one: it is not an outlier among them).
    for gen, shape in sorted({(v.generation, v.shape) for v in steady}):
        group = [v for v in steady if v.generation == gen and v.shape == shape]
        for name, value in (("capacity", lambda v: float(v.effective_max)), ("tokens/s", lambda v: v.tokens_per_s)):
            slow_hosts: set[str] = set()
            names = {v.host for v in group}
            if len(names) >= 2:
                for h in sorted(names):
                    mine = [value(v) for v in group if v.host == h]
                    theirs = [value(v) for v in group if v.host != h]
                    med = statistics.median(theirs)
                    if len(mine) >= 2 and med > 0 and all(x < (1 - th.outlier) * med for x in mine):
                        slow_hosts.add(h)
                        hosts.setdefault(h, []).append(
                            f"{name}: its {len(mine)} GPUs {statistics.median(mine):,.0f} vs other hosts' median "
                            f"{med:,.0f}")
            rest = [v for v in group if v.host not in slow_hosts]
            if len(rest) < 3:  # with two, "far from the other" does not say which one is odd
                continue
            for v in rest:
                med = statistics.median([value(p) for p in rest if p is not v])
                if med > 0 and abs(value(v) - med) / med > th.outlier:
                    gpus.setdefault(v.worker, []).append(f"{name} {value(v):,.0f} vs peers' median {med:,.0f}")
    return gpus, hosts


def classify_window(snapshots: Sequence[FleetSnapshot], th: Thresholds | None = None) -> WindowReport:
    """Classify every server seen in the last snapshot over all of `snapshots` (oldest first)."""
    if not snapshots:
        raise ValueError("classify_window needs at least one snapshot; sample the fleet first")
    th = th or Thresholds()
    last = snapshots[-1]
    backlog = last.total_backlog
    multihost = len({w.host for w in last.workers}) > 1
    series = {w.worker: [s for snap in snapshots for s in snap.workers if s.worker == w.worker] for w in last.workers}
    # Slots the serving fleet leaves unoffered: a backlog smaller than that is the run ending, not our side.
    short_of = 0.0
    for samples in series.values():
        serving = [s for s in samples if s.state is WorkerState.SERVING]
        if serving:
            short_of += max(0.0, serving[-1].effective_max - statistics.fmean(s.in_flight for s in serving))
    # the store's prompts not fed yet, as the head last published them (none when no head publishes)
    fed_all = int(last.stats.get(STORE_WAITING, 0) or 0) <= 0
    views = []
    for w in last.workers:
        samples = series[w.worker]
        reach = last.within_reach(w.queue) if fed_all else None
        cls, reasons, evidence = _classify_one(samples, backlog, short_of, w.worker in last.silent, last.finished, th,
                                               reach)
        serving = [s for s in samples if s.state is WorkerState.SERVING] or samples
        retracted = [s.metrics.retracted for s in serving if s.metrics.retracted is not None]
        points = []
        for snap in snapshots:
            s = next((x for x in snap.workers if x.worker == w.worker), None)
            if s is None:
                continue
            points.append(Point(ts=snap.ts, serving=s.state is WorkerState.SERVING, generation=s.generation,
                                filled=s.effective_max > 0
                                and s.in_flight >= s.effective_max - th.tolerance(s.effective_max),
                                tokens=s.metrics.generation_tokens_total, tokens_ts=s.metrics.ts,
                                gen_tps=s.metrics.gen_throughput))
        rate = _rate(points)
        label = f"gpu{w.gpu}" if w.gpu is not None else w.queue
        views.append(ServerView(
            worker=w.worker, queue=w.queue, host=w.host, gpu=w.gpu, label=f"{w.host}/{label}" if multihost else label,
            cls=cls, reasons=reasons, state=w.state, strategy=w.strategy, generation=w.generation,
            effective_max=w.effective_max, slots=w.slots or w.effective_max,
            in_flight=statistics.fmean(s.in_flight for s in serving),
            running=_mean([s.metrics.running for s in serving]), queued=_mean([s.metrics.queued for s in serving]),
            kv=_mean([s.metrics.full_kv_usage for s in serving]), mamba=_mean([s.metrics.mamba_usage for s in serving]),
            cache_hit_rate=_or(last.hit_rate(w.queue), w.metrics.cache_hit_rate),
            predicted_hit=last.predicted_hit(w.queue),
            tokens_per_s=rate if rate is not None else statistics.fmean(s.tokens_per_s for s in serving),
            retracted=(retracted[-1] - retracted[0]) if retracted else 0.0,
            evidence=evidence if cls == MAMBA_BOUND else "", filling=evidence == "filling", facts=w.facts,
            points=tuple(points), shape=w.shape or "tp1", start_s=w.start_s, drain_s=w.drain_s,
            model=flag_value(w.server_flags, "--model-path", "--model") or "", gpu_name=w.gpu_name,
            gpu_memory_mib=w.gpu_memory_mib, spec=current_spec(None, [w])))
    gpu_flags, host_flags = _flag(views, th)
    views = [replace(v, outliers=gpu_flags.get(v.worker, [])) for v in views]
    eta = last.eta()
    succeeded = last.stats.get("succeeded", 0)
    prompt = last.stats.get(PROMPT_TOKENS, 0) / succeeded if succeeded > 0 and last.stats.get(PROMPT_TOKENS) else None
    return WindowReport(start=snapshots[0].ts, end=last.ts, servers=views, backlog=backlog, eta_s=eta.seconds,
                        hosts=host_flags, eta_lower=eta.lower_bound, prompt_tokens=prompt,
                        completion_tokens=last.mean_completion_tokens)
