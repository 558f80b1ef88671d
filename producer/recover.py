"""Audit where the run's fed prompts are in Redis, and put back the ones that will never finish.

A FED prompt (see store.State) is, in Redis, one of (`scripts.CHECK`):

    queued       its job waits on a queue
    in_flight    a worker holds it (RQ status `started`, leased)
    done         finished: its result waits in the results stream for the collector
    failed_foreign   failed by a worker that is not batchfleet's (a stock `rq worker` without
                 RQ_WORKER_CLASS fails every job with a pickle DeserializationError): no result comes
    lost         nowhere: Redis lost it (restart without persistence, failover to a replica that
                 missed writes) or someone deleted the job

`recover` requeues exactly the lost and failed_foreign prompts: it takes the foreign-failed jobs back
out of RQ's failed registry (atomically, only if still failed and not done), then marks both kinds
WAITING again in the store, only where they are still FED — a result collected in the meantime made
the prompt DONE, and it stays so. The next feed pass puts them into Redis through the window. The
order of the reads makes this safe against a concurrent collector: it stores a result before it
removes the job id from `done`, and the store is read after Redis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import redis

from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys, valid_queue_name

from .scripts import CHECK, TAKE_FAILED
from .store import State, Store

__all__ = ["CODES", "Audit", "RecoverSummary", "audit", "recover"]

PAGE = 5000
CODES = {"q": "queued", "s": "in_flight", "d": "done", "f": "failed_foreign", "m": "lost"}


@dataclass
class Audit:
    counts: Counter[str] = field(default_factory=Counter)  # CODES value -> prompts
    lost: list[int] = field(default_factory=list)  # seqs
    foreign: list[tuple[int, str]] = field(default_factory=list)  # (seq, job id)

    def foreign_by_worker(self, r: redis.Redis) -> list[dict[str, object]]:
        """[{queue, worker, count}] of the foreign-failed jobs, from their RQ job hashes."""
        pipe = r.pipeline(transaction=False)
        for _, jid in self.foreign:
            pipe.hmget(Keys.job(jid), "origin", "worker_name")
        groups: Counter[tuple[str, str]] = Counter()
        for origin, worker in pipe.execute() if self.foreign else []:
            groups[((origin or b"?").decode(errors="replace")[:200],
                    (worker or b"?").decode(errors="replace")[:200])] += 1
        return [{"queue": q, "worker": w, "count": n} for (q, w), n in sorted(groups.items())]


def audit(r: redis.Redis, store: Store, keys: Keys) -> Audit:
    """Where every FED prompt is in Redis now."""
    out = Audit()
    after = 0
    while True:
        with store.read():
            page = store.fed(after=after, limit=PAGE)
        if not page:
            return out
        jids = [job_id_for(keys.run, cid) for _, cid in page]
        codes = CHECK.call(r, keys={"done": keys.done, "jobs": [Keys.job(j) for j in jids]})
        for (seq, _), jid, code in zip(page, jids, codes.decode(), strict=True):
            out.counts[CODES[code]] += 1
            if code == "m":
                out.lost.append(seq)
            elif code == "f":
                out.foreign.append((seq, jid))
        after = page[-1][0]


@dataclass
class RecoverSummary:
    lost: int = 0  # requeued: nowhere in Redis
    foreign: int = 0  # requeued: failed by a worker that is not batchfleet's
    in_redis: int = 0  # fed prompts that are fine where they are (queued, in flight, done)

    @property
    def requeued(self) -> int:
        return self.lost + self.foreign


def recover(r: redis.Redis, store: Store, keys: Keys, *, foreign: bool = True,
            found: Audit | None = None) -> RecoverSummary:
    """Mark lost (and, with `foreign`, foreign-failed) prompts WAITING again: the next feed pass requeues
    them. `found`: an audit just made, to save making another."""
    a = found or audit(r, store, keys)
    taken = _take_failed(r, keys, a.foreign) if foreign else set()
    out = RecoverSummary(in_redis=a.counts["queued"] + a.counts["in_flight"] + a.counts["done"])
    seqs = {seq for seq, jid in a.foreign if jid in taken}
    with store.write():
        out.foreign = store.set_state(sorted(seqs), State.FED, State.WAITING)
        out.lost = store.set_state(a.lost, State.FED, State.WAITING)
    return out


def _take_failed(r: redis.Redis, keys: Keys, jobs: list[tuple[int, str]]) -> set[str]:
    if not jobs:
        return set()
    pipe = r.pipeline(transaction=False)
    for _, jid in jobs:
        pipe.hget(Keys.job(jid), "origin")
    origins = pipe.execute()
    taken: set[str] = set()
    for i in range(0, len(jobs), 1000):
        ks: list[str] = []
        for (_, jid), origin in zip(jobs[i : i + 1000], origins[i : i + 1000], strict=True):
            queue = (origin or b"").decode(errors="replace")
            queue = queue if valid_queue_name(queue) else ""  # data from Redis: never a key of our choosing
            ks += [Keys.job(jid), Keys.failed(queue), Keys.rq_results(jid)]
        taken.update(j.decode() for j in TAKE_FAILED.call(r, keys={"done": keys.done, "jobs": ks}))
    return taken
