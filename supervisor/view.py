"""The terminal view of the fleet (rich), made to fit the terminal it is shown in.

Columns come in priority order: the GPU, its state, slots used/capacity, tokens/s, mamba and KV use
and its class always show; strategy, running, waiting, hit rate, done and failed are added while
they fit. The diagnosis is never a column: each problem is a line of its own under the table,
wrapped to the width, so it stays readable at 80 columns. A fleet on several hosts is shown host by
host (a header line per host), every host's GPUs in one view.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Group
from rich.text import Text

from batchfleet.records import WorkerStatus

from .classify import ServerClass, ServerView, WindowReport
from .fleet import FleetSnapshot
from .pilotstate import Phase, PilotState

__all__ = ["phase_line", "render"]

_C = ServerClass
PROBLEM = {_C.CLIENT_BOUND, _C.HUNG, _C.DOWN, _C.KV_BOUND, _C.SILENT}
STYLE = {_C.MAMBA_BOUND: "yellow", _C.CLIENT_BOUND: "magenta", _C.KV_BOUND: "cyan", _C.DOWN: "red", _C.HUNG: "red",
         _C.SILENT: "red", _C.SATURATED: "green", _C.DRAINING: "dim", _C.IDLE: "dim", _C.RESTARTING: "blue"}
GAP = 2


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _queues(backlog: dict[str, int]) -> str:
    """`q:n` per queue, without a prefix all of them share (`jobA.gpu0` -> `gpu0`)."""
    prefixes = {q.rpartition(".")[0] for q in backlog}
    shared = prefixes.pop() if len(prefixes) == 1 else ""
    return ", ".join(f"{q[len(shared) + 1:] if shared else q}:{n}" for q, n in backlog.items())


@dataclass(frozen=True, slots=True)
class _Col:
    name: str
    cell: Callable[[WorkerStatus, ServerView | None], str]
    required: bool
    left: bool = False


def _tps(w: WorkerStatus, v: ServerView | None) -> str:
    return f"{(v.tokens_per_s if v is not None else w.tokens_per_s):,.0f}"


COLUMNS = (  # in the order they are shown; optional ones are dropped from the end of OPTIONAL first
    _Col("gpu", lambda w, v: str(w.gpu) if w.gpu is not None else w.queue, True),
    _Col("state", lambda w, v: str(w.state), True, left=True),
    _Col("strategy", lambda w, v: w.strategy, False, left=True),
    _Col("slots", lambda w, v: f"{w.in_flight}/{w.effective_max}", True),
    _Col("run", lambda w, v: "-" if w.metrics.running is None else f"{w.metrics.running:.0f}", False),
    _Col("wait", lambda w, v: "-" if w.metrics.queued is None else f"{w.metrics.queued:.0f}", False),
    _Col("tok/s", _tps, True),
    _Col("mamba", lambda w, v: _pct(w.metrics.mamba_usage), True),
    _Col("KV", lambda w, v: _pct(w.metrics.full_kv_usage), True),
    _Col("hit", lambda w, v: _pct(w.metrics.cache_hit_rate), False),
    _Col("done", lambda w, v: str(w.done), False),
    _Col("fail", lambda w, v: str(w.failed), False),
    _Col("class", lambda w, v: str(v.cls) if v is not None else "", True, left=True),
)
OPTIONAL = ("strategy", "run", "wait", "hit", "done", "fail")  # kept first to last while they fit


def _fit(rows: list[list[str]], width: int) -> list[int]:
    """Indexes of the columns to show: every required one, then optional ones while they fit."""
    widths = [max(len(c.name), *(len(r[i]) for r in rows)) if rows else len(c.name) for i, c in enumerate(COLUMNS)]
    keep = [i for i, c in enumerate(COLUMNS) if c.required]

    def total(cols: list[int]) -> int:
        return sum(widths[i] for i in cols) + GAP * (len(cols) - 1)

    for name in OPTIONAL:
        i = next(j for j, c in enumerate(COLUMNS) if c.name == name)
        if total(sorted([*keep, i])) <= width:
            keep = sorted([*keep, i])
    return keep


def _line(cells: list[str], cols: list[int], widths: dict[int, int]) -> str:
    out = []
    for i, cell in zip(cols, cells, strict=True):
        out.append(cell.ljust(widths[i]) if COLUMNS[i].left else cell.rjust(widths[i]))
    return (" " * GAP).join(out).rstrip()


def render(snap: FleetSnapshot, *, classes: dict[str, str] | None = None, report: WindowReport | None = None,
           width: int = 80, phase: str = "") -> Group:
    """The fleet as lines no wider than `width`: table, diagnosis, totals, autopilot phase, events."""
    views = {v.worker: v for v in report.servers} if report is not None else {}
    rows = []
    for w in snap.workers:
        v = views.get(w.worker)
        cells = [c.cell(w, v) for c in COLUMNS]
        if v is None and classes:
            cells[-1] = classes.get(w.worker, "")
        rows.append(cells)
    cols = _fit(rows, width)
    widths = {i: max(len(COLUMNS[i].name), *(len(r[i]) for r in rows)) if rows else len(COLUMNS[i].name)
              for i in cols}
    parts: list[Text] = [Text("batchfleet", style="bold"),
                         Text(_line([COLUMNS[i].name for i in cols], cols, widths), style="bold")]
    hosts = sorted({w.host for w in snap.workers})
    for host in hosts:
        mine = [(w, r) for w, r in zip(snap.workers, rows, strict=True) if w.host == host]
        if len(hosts) > 1:
            tps = sum(views[w.worker].tokens_per_s if w.worker in views else w.tokens_per_s for w, _ in mine)
            slow = report is not None and host in report.hosts
            parts.append(Text(f"{host}: {len(mine)} GPU(s), {tps:,.0f} tok/s{' (slow host)' if slow else ''}"[:width],
                              style="bold red" if slow else "bold"))
        for _, r in mine:
            parts.append(Text(_line([r[i] for i in cols], cols, widths), style=STYLE.get(r[-1], "")))
    # Diagnosis: one wrapped line per host or server with something to say.
    for host, why in (report.hosts.items() if report is not None else []):
        parts.append(Text(f"host {host}: all its GPUs are slower than the other hosts': " + "; ".join(why),
                          style="red"))
    servers = report.servers if report is not None else []
    stalled = [v for v in servers if v.cls == ServerClass.MAMBA_BOUND]
    if stalled:  # the autopilot's business: one line for all of them
        names = ", ".join(v.label for v in stalled)
        parts.append(Text(f"{names} {ServerClass.MAMBA_BOUND}: {'; '.join(stalled[0].reasons)}",
                          style=STYLE[ServerClass.MAMBA_BOUND]))
    for v in servers:
        said = []
        if v.cls in PROBLEM:
            said.append(f"{v.cls}: {'; '.join(v.reasons)}")
        if v.outliers:
            said.append("far from its peers: " + "; ".join(v.outliers))
        if said:
            parts.append(Text(f"{v.label} " + "; ".join(said), style=STYLE.get(v.cls, "")))
    s = snap.stats
    done = f"done {s.get('succeeded', 0):,} | failed {s.get('failed', 0):,}"
    if snap.finished:
        how = "was cancelled" if snap.cancelled else "has finished"
        parts.append(Text(f"the run {how}: {done}", style="bold"))
    else:
        parts.append(Text(
            f"fleet {snap.tokens_per_s:,.0f} tok/s | in flight {snap.in_flight} | backlog {snap.total_backlog} "
            f"({_queues(snap.backlog) or 'no queues'}) | {done} | ETA {snap.eta().text}"))
    if phase:
        parts.append(Text(phase, style="bold"))
    for e in snap.events[-6:]:
        parts.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(e.ts))} {e.kind}: {e.message}", style="dim"))
    if snap.unreadable:
        parts.append(Text(f"{snap.unreadable} status record(s) this version cannot read (a newer worker?): skipped, "
                          "see the warning", style="yellow"))
    if not snap.workers and not snap.finished:
        parts.append(Text("no live workers: none has reported yet, or their records expired", style="yellow"))
    return Group(*parts)


def phase_line(state: PilotState, *, dry_run: bool = False) -> str:
    """What the autopilot is doing, in one line."""
    head = "autopilot (dry run)" if dry_run else "autopilot"
    if state.phase == Phase.OBSERVING:
        stall = f", {state.stall} stalled window(s)" if state.stall else ""
        backoff = f"; backing off: {', '.join(state.tried)}" if state.tried else ""
        return f"{head}: observing{stall}{backoff}"
    target = (state.target or {}).get("strategy", "?")
    done = state.measured_s
    extra = f"; not measured: {state.confounded}" if state.confounded else ""
    if state.phase == Phase.CANARY:
        return f"{head}: canary {state.canary_label} on {target}, {done:.0f} s measured{extra}"
    if state.phase == Phase.ROLLING_OUT:
        return f"{head}: rolling out {target}: {len(state.rolled)} GPU(s) so far"
    return f"{head}: verifying {target}, {done:.0f} s measured{extra}"
