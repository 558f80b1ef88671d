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


def render(snap: FleetSnapshot, *, classes: dict[str, str] | None = None) -> Group:
    table = Table(title="batchfleet", title_justify="left", expand=False)
    for col in ("GPU", "worker", "state", "strategy", "in flight / max", "running", "queued", "KV", "mamba",
                "hit", "tok/s", "done", "failed"):
        table.add_column(col, justify="right" if col not in {"worker", "state", "strategy"} else "left")
    if classes:
        table.add_column("class")
    for w in snap.workers:
        m = w.metrics
        row = [
            str(w.gpu) if w.gpu is not None else "-", f"{w.worker[:10]}@{w.host[:12]}", w.state, w.strategy,
            f"{w.in_flight} / {w.effective_max}", "-" if m.running is None else f"{m.running:.0f}",
            "-" if m.queued is None else f"{m.queued:.0f}", _pct(m.full_kv_usage), _pct(m.mamba_usage),
            _pct(m.cache_hit_rate), f"{w.tokens_per_s:,.0f}", str(w.done), str(w.failed),
        ]
        if classes:
            row.append(classes.get(w.worker, ""))
        table.add_row(*row)
    s = snap.stats
    footer = Text(
        f"fleet {snap.tokens_per_s:,.0f} tok/s | in flight {snap.in_flight} | backlog {snap.total_backlog} "
        f"({', '.join(f'{q}:{n}' for q, n in snap.backlog.items()) or 'no queues'}) | done {s.get('succeeded', 0)} "
        f"| failed {s.get('failed', 0)} | ETA {_eta(snap.eta_s())}")
    parts: list = [table, footer]
    for e in snap.events[-8:]:
        parts.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(e.ts))} {e.kind}: {e.message}", style="dim"))
    if not snap.workers:
        parts.append(Text("no workers have reported yet", style="yellow"))
    return Group(*parts)
