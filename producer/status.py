"""`producer status`: where every prompt of the run is. Read-only: it collects nothing, opens the store
read-only, and works from the store alone when Redis is down. The keys of `--json` are documented in
docs/store.md ("Status"); every pending prompt is in exactly one of the totals' places:

    pending = waiting + queued + in_flight + done_not_collected + failed_foreign + lost
"""

from __future__ import annotations

from typing import Any

import orjson
import redis

from batchfleet.config import Config
from batchfleet.connection import redacted
from batchfleet.fleetview import SILENT_AFTER_S, FleetView, read_fleet_view
from batchfleet.keys import Keys, valid_queue_name
from batchfleet.marker import repair_command
from batchfleet.records import WorkerState

from .locate import Located
from .recover import audit
from .runs import input_dict, input_text
from .store import Store

__all__ = ["cache_text", "cannot_serve", "format_status", "gather_progress", "gather_status"]

_CANNOT_SERVE = {WorkerState.FAILED: "GPU FAILED (takes no work)", WorkerState.DOWN: "server DOWN"}


def cannot_serve(state: str) -> str | None:
    """What to say of a worker whose server cannot serve, from its `state` (a `WorkerState` value, as in
    the `not_serving` of `workers`): "GPU FAILED (takes no work)", "server DOWN", or None while it starts
    or restarts (it will serve)."""
    try:
        return _CANNOT_SERVE.get(WorkerState(state))
    except ValueError:
        return None


def gather_status(config: Config, r: redis.Redis, loc: Located) -> dict[str, Any]:
    store, keys = loc.store, Keys(config.run)
    with store.read():
        counts = store.counts()
        rejected = store.rejected_results()
        cancelled_at = store.cancelled_at()
        inputs = [input_dict(i) for i in store.inputs()]
    repair = repair_command(config.run, str(store.path.parent))
    out: dict[str, Any] = {
        "run": config.run,
        "redis": redacted(config.redis_url),
        "redis_up": loc.redis_error is None,
        "redis_error": loc.redis_error,
        "store": {"path": str(store.path), "id": store.id, "host": loc.marker.host if loc.marker else None},
        "inputs": inputs,
        "marker": "unknown" if loc.redis_error else ("present" if loc.marker else "missing"),
        "redis_lost_data": loc.lost,
        "repair": repair if loc.lost else None,
        "rejected_results": rejected,
        "cancelled_at": cancelled_at,
    }
    totals: dict[str, Any] = {**{k: counts[k] for k in ("prompts", "succeeded", "failed", "cancelled", "pending",
                                                        "waiting")}}
    if loc.redis_error is not None:
        totals.update({k: None for k in ("queued", "in_flight", "done_not_collected", "failed_foreign", "lost")})
        totals["in_redis"] = counts["fed"]
        out.update(totals=totals, queues={}, foreign_failures=[], workers=None, fleet_tokens_per_s=None,
                   mean_completion_tokens=None, prompts_per_s=None, eta_s=None, eta="unknown", eta_lower_bound=False)
        return out

    a = audit(r, store, keys)
    totals.update(queued=a.counts["queued"], in_flight=a.counts["in_flight"], done_not_collected=a.counts["done"],
                  failed_foreign=a.counts["failed_foreign"], lost=a.counts["lost"], in_redis=counts["fed"])
    foreign = a.foreign_by_worker(r)
    view = read_fleet_view(r, keys)
    stats = view.stats
    queues = list(loc.marker.queues if loc.marker else ())
    for name in stats:  # queues this run used
        kind, _, q = name.partition(":")
        if kind in ("enqueued", "succeeded", "failed") and valid_queue_name(q) and q not in queues:
            queues.append(q)
    queues += [q for q in view.capacity if q not in queues]
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.llen(Keys.queue(q))
        pipe.zcard(Keys.started(q))
        pipe.zcard(Keys.failed(q))
    depth = pipe.execute()
    rows = {
        q: {"queued": depth[3 * i], "in_flight": depth[3 * i + 1], "succeeded": stats.get(f"succeeded:{q}", 0),
            "failed": stats.get(f"failed:{q}", 0), "failed_registry": depth[3 * i + 2],
            "workers_capacity": view.capacity.get(q, 0)}
        for i, q in enumerate(queues)
    }
    # a queue only named (e.g. the default gpu0 of an enqueue before any worker) that holds nothing,
    # served nothing and has no live worker says nothing: no row
    out["queues"] = {q: v for q, v in rows.items() if any(v.values()) or q in view.capacity}
    out.update(
        totals=totals, foreign_failures=foreign,
        repair=repair if (loc.lost or a.counts["lost"] or foreign) else None,
        workers=_workers(view),
        **_rate(view, counts["pending"]),
    )
    return out


def _workers(view: FleetView) -> dict[str, Any]:
    return {"live": len(view.live), "known": view.known, "silent": len(view.silent), "unreadable": view.unreadable,
            "not_serving": [{"worker": w, "queue": q, "state": st, "message": m} for w, q, st, m in view.not_serving]}


def _rate(view: FleetView, pending: int) -> dict[str, Any]:
    """The fleet's figures (`batchfleet.fleetview`), the ETA of the store's `pending` prompts."""
    mean_ct, rate, eta = view.mean_completion_tokens, view.prompts_per_s, view.eta(pending)
    hit, predicted = view.hit_rate(), view.predicted_hit_fleet
    return {"fleet_tokens_per_s": round(view.tokens_per_s, 1),
            "mean_completion_tokens": None if mean_ct is None else round(mean_ct, 1),
            "prompts_per_s": None if rate is None else round(rate, 2),
            "eta_s": None if eta.seconds is None else round(eta.seconds), "eta": eta.text,
            "eta_lower_bound": eta.lower_bound,
            "cache_hit_rate": None if hit is None else round(hit, 4),
            "prefill_tokens_saved": view.saved_tokens,
            "predicted_hit_rate": None if predicted is None else round(predicted, 4)}


def cache_text(st: dict[str, Any]) -> str | None:
    """One line on the servers' radix caches: what they gave of the prompts, and what the plan predicted."""
    hit, predicted = st.get("cache_hit_rate"), st.get("predicted_hit_rate")
    if hit is None and predicted is None:
        return None
    measured = "nothing prefilled yet" if hit is None else (
        f"{hit:.0%} of prompt tokens from the servers' caches ({st['prefill_tokens_saved']:,} not prefilled)")
    return f"prefix cache: {measured}" + ("" if predicted is None else f"; the plan predicted {predicted:.0%}")


def gather_progress(r: redis.Redis, keys: Keys, store: Store) -> dict[str, Any]:
    """The figures of a progress line, from the same sources as `gather_status` (the store's counts,
    the run's counters, the workers' status records) without its audit of every fed prompt: keys
    `prompts`, `done`, `succeeded`, `failed`, `pending`, `completion_tokens` (the run's counter),
    `fleet_tokens_per_s`, `prompts_per_s`, `eta_s`, `eta`, `eta_lower_bound`, `workers` ({live, known,
    silent, unreadable, not_serving})."""
    with store.read():
        counts = store.counts()
    view = read_fleet_view(r, keys)
    return {"prompts": counts["prompts"], "done": counts["succeeded"] + counts["failed"],
            "succeeded": counts["succeeded"], "failed": counts["failed"], "pending": counts["pending"],
            "completion_tokens": max(0, int(view.stats.get("completion_tokens", 0))),
            "workers": _workers(view), **_rate(view, counts["pending"])}


def format_status(st: dict[str, Any], *, as_json: bool) -> str:
    if as_json:
        return orjson.dumps(st).decode()
    where = st["store"]["path"] + (f" on {st['store']['host']}" if st["store"]["host"] else "")
    lines = [f"run {st['run']}: store {where}; Redis {st['redis']}"
             + ("" if st["redis_up"] else f" is DOWN ({st['redis_error']}): counts from the store only")]
    for i in st["inputs"][-3:]:
        lines.append(f"input {input_text(i)}")
    if st["redis_lost_data"]:
        lines.append(f"REDIS LOST THIS RUN'S DATA: its marker is gone while the store has fed prompts "
                     f"(restart without persistence, or failover). Repair: {st['repair']} "
                     "(a running `producer head` does it by itself)")
    if st["queues"]:
        rows = [("queue", "queued", "in flight", "succeeded", "failed", "failed now")]
        for q, v in st["queues"].items():
            rows.append((q, *(f"{v[k]:,}" for k in ("queued", "in_flight", "succeeded", "failed",
                                                      "failed_registry"))))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                  for row in rows]
    t = st["totals"]
    lines.append(f"prompts {t['prompts']:,}: {t['succeeded']:,} succeeded, {t['failed']:,} failed, "
                 + (f"{t['cancelled']:,} cancelled, " if t["cancelled"] else "") + f"{t['pending']:,} pending")
    if st["cancelled_at"] is not None:
        lines.append("  the run was cancelled (producer cancel): its workers take no more of its work; export marks "
                     "the cancelled prompts with error code 'cancelled'")
    if st["redis_up"]:
        parts = [f"{t['waiting']:,} waiting in the store", f"{t['queued']:,} queued", f"{t['in_flight']:,} in flight",
                 f"{t['done_not_collected']:,} done, not collected yet"]
        parts += [f"{t['failed_foreign']:,} failed by a foreign worker"] if t["failed_foreign"] else []
        parts += [f"{t['lost']:,} LOST from Redis"] if t["lost"] else []
        lines.append("  pending: " + ", ".join(parts))
        for f in st["foreign_failures"]:
            lines.append(f"  {f['count']:,} prompt(s) on queue {f['queue']} were failed by worker {f['worker']}, "
                         "which is not a batchfleet worker (start workers with RQ_WORKER_CLASS=worker.GPUWorker); "
                         f"stop it, then requeue them: {st['repair']}")
        if t["lost"] and not st["redis_lost_data"]:
            lines.append(f"  {t['lost']:,} fed prompt(s) are nowhere in Redis: a running `producer head` requeues "
                         f"them, or: {st['repair']}")
        w = st["workers"]
        if t["pending"] == 0:
            speed = "nothing pending"
        elif st["eta_s"] is None:
            speed = "no throughput measured yet (no live worker is generating); ETA unknown"
        else:
            per_prompt = f", {st['prompts_per_s']:,} prompts/s" if st["prompts_per_s"] is not None else ""
            speed = f"fleet {st['fleet_tokens_per_s']:,} tok/s{per_prompt}; ETA {st['eta']}"
        lines.append(f"workers {w['live']} live of {w['known']}; {speed}")
        if (cache := cache_text(st)) is not None:
            lines.append(f"  {cache}")
        if w["silent"]:
            lines.append(f"  {w['silent']} worker(s) silent: their status record was not rewritten for "
                         f"{SILENT_AFTER_S:g} s (gone or stuck)")
        if w["unreadable"]:
            lines.append(f"  {w['unreadable']} status record(s) this version cannot read (a newer worker?): skipped, "
                         "see the warning")
        for d in w.get("not_serving", []):
            if (what := cannot_serve(d["state"])) is not None:
                why = (d["message"] or "?").rstrip().replace("\n", "\n    ")
                lines.append(f"  worker {d['worker']} (queue {d['queue']}): {what}: {why}")
        starting = sum(1 for d in w.get("not_serving", []) if cannot_serve(d["state"]) is None)
        if starting:
            lines.append(f"  {starting} worker(s) starting or restarting their server")
    else:
        lines.append(f"  pending: {t['waiting']:,} waiting in the store, {t['in_redis']:,} fed to Redis "
                     "(where in Redis: unknown while it is down)")
    if st["rejected_results"]:
        lines.append(f"{st['rejected_results']:,} result(s) answered no prompt of this run (forged or foreign) and "
                     "were dropped")
    return "\n".join(lines)
