"""The terminal view of a fleet snapshot (rich)."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .fleet import FleetSnapshot

__all__ = ["render"]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _eta(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _queues(backlog: dict[str, int]) -> str:
    """`q:n` per queue, without a prefix all of them share (`jobA.gpu0` -> `gpu0`)."""
    prefixes = {q.rpartition(".")[0] for q in backlog}
    shared = prefixes.pop() if len(prefixes) == 1 else ""
    return ", ".join(f"{q[len(shared) + 1:] if shared else q}:{n}" for q, n in backlog.items())


def render(snap: FleetSnapshot, *, classes: dict[str, str] | None = None) -> Group:
    table = Table(title="batchfleet", title_justify="left", expand=False, pad_edge=False)
    # "tok/s" is what the worker measured (wall clock); "gen" is the server's own sglang:gen_throughput.
    # On real GPUs they agree; under the simulator's time scale "gen" is in simulated time.
    for col in ("gpu", "host", "state", "strategy", "slots", "run", "wait", "KV", "mamba", "hit", "tok/s", "gen",
                "done", "fail"):
        table.add_column(col, justify="left" if col in {"host", "state", "strategy"} else "right", no_wrap=True)
    if classes:
        table.add_column("class")
    for w in snap.workers:
        m = w.metrics
        row = [
            str(w.gpu) if w.gpu is not None else "-", w.host[:12], w.state, w.strategy,
            f"{w.in_flight}/{w.effective_max}", "-" if m.running is None else f"{m.running:.0f}",
            "-" if m.queued is None else f"{m.queued:.0f}", _pct(m.full_kv_usage), _pct(m.mamba_usage),
            _pct(m.cache_hit_rate), f"{w.tokens_per_s:,.0f}",
            "-" if m.gen_throughput is None else f"{m.gen_throughput:,.0f}", str(w.done), str(w.failed),
        ]
        if classes:
            row.append(classes.get(w.worker, ""))
        table.add_row(*row)
    s = snap.stats
    gen = sum(w.metrics.gen_throughput or 0 for w in snap.workers)
    footer = Text(
        f"fleet {snap.tokens_per_s:,.0f} tok/s (servers: {gen:,.0f} gen) | in flight {snap.in_flight} "
        f"| backlog {snap.total_backlog} "
        f"({_queues(snap.backlog) or 'no queues'}) | done {s.get('succeeded', 0)} "
        f"| failed {s.get('failed', 0)} | ETA {_eta(snap.eta_s())}")
    parts: list = [table, footer]
    for e in snap.events[-8:]:
        parts.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(e.ts))} {e.kind}: {e.message}", style="dim"))
    if not snap.workers:
        parts.append(Text("no workers have reported yet", style="yellow"))
    return Group(*parts)
