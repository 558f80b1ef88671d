"""`supervisor report OUT.png`: fleet tokens/s and per-GPU in-flight over time with restarts marked,
from the history stream `supervisor watch` writes, plus a short text summary."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis

from batchfleet.keys import Keys
from batchfleet.records import Event, EventKind

from .fleet import read_events

__all__ = ["Summary", "load", "plot", "summarize"]

MARKED = {EventKind.DECISION: "tab:orange", EventKind.CANARY: "tab:green", EventKind.ROLLBACK: "tab:red",
          EventKind.ROLLED_OUT: "tab:blue", EventKind.VERIFIED: "tab:purple", EventKind.MANUAL: "tab:brown"}


@dataclass(frozen=True, slots=True)
class Summary:
    samples: int
    span_s: float
    restarts: int
    downtime_s: list[float]
    decisions: list[str]
    before_tokens_per_s: float | None
    after_tokens_per_s: float | None
    decide_s: float | None

    def text(self) -> str:
        lines = [f"{self.samples} samples over {self.span_s:,.0f} s; {self.restarts} server restart(s)"]
        if self.downtime_s:
            lines.append(f"restart downtime per server: median {statistics.median(self.downtime_s):.1f} s, "
                         f"max {max(self.downtime_s):.1f} s")
        if self.before_tokens_per_s is not None and self.after_tokens_per_s is not None:
            ratio = self.after_tokens_per_s / self.before_tokens_per_s if self.before_tokens_per_s else 0
            lines.append(f"fleet tokens/s (server-reported): {self.before_tokens_per_s:,.0f} -> "
                         f"{self.after_tokens_per_s:,.0f} (x{ratio:.2f})")
        if self.decide_s is not None:
            lines.append(f"time to decide: {self.decide_s:.1f} s from the first stalled window")
        lines += [f"  {d}" for d in self.decisions]
        return "\n".join(lines)


def load(r: redis.Redis, k: Keys) -> tuple[list[dict[str, Any]], list[Event]]:
    samples = [orjson.loads(f[b"s"]) for _, f in r.xrange(k.history)]
    return samples, read_events(r.xrevrange(k.events))


def summarize(samples: list[dict[str, Any]], events: list[Event]) -> Summary:
    restarted = [e for e in events if e.kind is EventKind.RESTARTED]
    verified = [e for e in events if e.kind is EventKind.VERIFIED]
    decision = next((e for e in events if e.kind is EventKind.DECISION and "decide_s" in e.data), None)
    span = samples[-1]["ts"] - samples[0]["ts"] if len(samples) > 1 else 0.0
    return Summary(
        samples=len(samples), span_s=span, restarts=len(restarted),
        downtime_s=[float(e.data.get("downtime_s", 0)) for e in restarted],
        decisions=[f"{e.kind}: {e.message}" for e in events if e.kind in MARKED],
        before_tokens_per_s=verified[-1].data.get("before_tokens_per_s") if verified else None,
        after_tokens_per_s=verified[-1].data.get("after_tokens_per_s") if verified else None,
        decide_s=decision.data["decide_s"] if decision else None)


def plot(samples: list[dict[str, Any]], events: list[Event], out: Path, *, title: str = "batchfleet") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not samples:
        raise ValueError("no history to plot: run `supervisor watch` while the fleet works (it writes the history)")
    t0 = samples[0]["ts"]
    ts = [s["ts"] - t0 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 7))
    top.plot(ts, [s["tokens_per_s"] for s in samples], color="black", lw=1.2, label="fleet")
    top.set_ylabel("fleet tokens/s (completion, wall clock)")
    top.set_title(title)
    hosts = {g.get("host") for s in samples for g in s["gpus"].values()}
    labels = {w: (f"{g.get('host')}/" if len(hosts) > 1 else "") + (f"gpu{g['gpu']}" if g.get("gpu") is not None else w)
              for s in samples for w, g in s["gpus"].items()}
    for w in sorted(labels, key=lambda w: (len(labels[w]), labels[w])):
        bottom.plot(ts, [s["gpus"].get(w, {}).get("in_flight", float("nan")) for s in samples], lw=0.9,
                    label=labels[w])
    bottom.set_ylabel("in flight per GPU")
    bottom.set_xlabel("seconds")
    for e in events:
        x = e.ts - t0
        if not 0 <= x <= ts[-1]:
            continue
        if e.kind is EventKind.RESTARTED:
            bottom.axvline(x, color="grey", ls=":", lw=0.8)
        elif e.kind in MARKED:
            for ax in (top, bottom):
                ax.axvline(x, color=MARKED[e.kind], ls="--", lw=1)
            top.annotate(e.kind, (x, top.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8,
                         color=MARKED[e.kind])
    top.legend(loc="lower right", fontsize=8)
    bottom.legend(loc="lower right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
