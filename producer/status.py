"""`producer status`: where the run stands. Runs a collect pass first so the counts are current.

`--json` prints one object:

    run, redis                       the run name and the (redacted) Redis URL
    queues: {q: {queued, in_flight, succeeded, failed, failed_registry}}
        queued = LLEN of the queue, in_flight = RQ's started registry, succeeded/failed = the
        workers' counters for that queue (every final result ever), failed_registry = jobs in RQ's
        failed registry now (what `rq requeue` would run again)
    totals: {prompts, succeeded, failed, pending, queued, in_flight, enqueued}
        prompts/succeeded/failed/pending from the results store (pending = no final result yet),
        queued/in_flight summed over queues, enqueued = the Redis counter of jobs ever created
    workers: {fresh, known}          live status records (Redis expires them after keys.STATUS_TTL_S) / names known
    fleet_tokens_per_s               sum of `tokens_per_s` over fresh worker records
    mean_completion_tokens           completion tokens per succeeded prompt so far (null: none yet)
    prompts_per_s                    fleet_tokens_per_s / mean_completion_tokens (null: unknown)
    eta_s, eta                       pending / prompts_per_s, and as text ("unknown" when unknown)
"""

from __future__ import annotations

from typing import Any

import orjson
import redis

from batchfleet.config import Config
from batchfleet.connection import redacted
from batchfleet.keys import Keys
from batchfleet.records import WorkerStatus

from .collect import collect_once
from .store import Store

__all__ = ["format_status", "gather_status"]


def _num(v: bytes) -> int | float:
    f = float(v)
    return int(f) if f.is_integer() else f


def gather_status(config: Config, r: redis.Redis, store: Store) -> dict[str, Any]:
    keys = Keys(config.run)
    collect_once(r, store, keys)
    stats = {k.decode(): _num(v) for k, v in r.hgetall(keys.stats).items()}
    queues = list(config.queues)
    for field in stats:  # queues this run used, even when not in the current configuration
        kind, _, q = field.partition(":")
        if kind in ("enqueued", "succeeded", "failed") and q and q not in queues:
            queues.append(q)
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.llen(Keys.queue(q))
        pipe.zcard(Keys.started(q))
        pipe.zcard(Keys.failed(q))
    depth = pipe.execute()
    per_queue = {
        q: {"queued": depth[3 * i], "in_flight": depth[3 * i + 1],
            "succeeded": stats.get(f"succeeded:{q}", 0), "failed": stats.get(f"failed:{q}", 0),
            "failed_registry": depth[3 * i + 2]}
        for i, q in enumerate(queues)
    }

    names = sorted(n.decode() for n in r.smembers(keys.workers))
    records = r.mget([keys.status(n) for n in names]) if names else []
    tps, fresh = 0.0, 0
    for raw in records:
        # A record exists only while fresh: Redis expires it STATUS_TTL_S after the worker's last
        # write. Its own `ts` is the worker host's clock, never compared with this host's.
        if raw is None:
            continue
        try:
            ws = WorkerStatus.from_json(raw)
        except (TypeError, ValueError):
            continue
        fresh += 1
        tps += ws.tokens_per_s

    counts = store.counts()
    succeeded = stats.get("succeeded", 0)
    mean_ct = stats.get("completion_tokens", 0) / succeeded if succeeded else None
    rate = tps / mean_ct if mean_ct and tps > 0 else None
    eta_s = counts["pending"] / rate if rate else (0.0 if counts["pending"] == 0 else None)
    return {
        "run": config.run,
        "redis": redacted(config.redis_url),
        "queues": per_queue,
        "totals": {
            **counts,
            "queued": sum(v["queued"] for v in per_queue.values()),
            "in_flight": sum(v["in_flight"] for v in per_queue.values()),
            "enqueued": stats.get("enqueued", 0),
        },
        "workers": {"fresh": fresh, "known": len(names)},
        "fleet_tokens_per_s": round(tps, 1),
        "mean_completion_tokens": None if mean_ct is None else round(mean_ct, 1),
        "prompts_per_s": None if rate is None else round(rate, 2),
        "eta_s": None if eta_s is None else round(eta_s),
        "eta": _eta_text(eta_s),
    }


def _eta_text(eta_s: float | None) -> str:
    if eta_s is None:
        return "unknown"
    s = round(eta_s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_status(st: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return orjson.dumps(st).decode()
    rows = [("queue", "queued", "in flight", "succeeded", "failed", "failed now")]
    for q, v in st["queues"].items():
        rows.append((q, *(f"{v[k]:,}" for k in ("queued", "in_flight", "succeeded", "failed", "failed_registry"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"run {st['run']} on {st['redis']}"]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in rows]
    t = st["totals"]
    rate = "unknown" if st["prompts_per_s"] is None else f"{st['prompts_per_s']:,} prompts/s"
    lines.append(f"prompts {t['prompts']:,}: {t['succeeded']:,} succeeded, {t['failed']:,} failed, "
                 f"{t['pending']:,} pending ({t['queued']:,} queued, {t['in_flight']:,} in flight)")
    lines.append(f"workers {st['workers']['fresh']} fresh of {st['workers']['known']}; "
                 f"{st['fleet_tokens_per_s']:,} tokens/s; {rate}; ETA {st['eta']}")
    return "\n".join(lines)
