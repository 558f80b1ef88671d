"""Collect: move finished prompts' results from Redis into the store.

Workers XADD one `Result` per finished prompt to `Keys.results` and SADD its job id to `Keys.done`.
The collector reads the stream in batches and keeps a result only when it answers a prompt of the
store: its custom_id was enqueued and its job id is `job_id_for(run, custom_id)`. Anything else (a
forged entry, another run's result, an unreadable record) is counted, said, and dropped: the export
holds only the run's own prompts. Each batch is stored in one write transaction (success wins over
failure; the prompt becomes DONE) and only after COMMIT are the entries and job ids removed from
Redis. A crash in between stores the same results again next time, which changes nothing. The job of
a collected failure is then trimmed to a stub (`trim.trim_failed`): the store holds its prompt.

A result also carries the fingerprint of the request that was sent (`Result.fp`, echoed from the
prompt's job). After `enqueue --rerun-changed` replaced a prompt's request, a result of the old request
(a job fed before, with the same job id) is refused: it is not the answer to what the store now holds.
That prompt is fed again with its new request (its failed job, if any, is taken out of RQ's registry
so the feed can write the new one). A result without a fingerprint (a worker older than fingerprints)
is taken unless the prompt's request was replaced.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

import orjson
import redis

from batchfleet.codec import loads
from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys
from batchfleet.records import RecordError, Result

from .recover import _take_failed
from .store import Store
from .trim import trim_failed

__all__ = ["CollectSummary", "collect_once", "redis_time_s"]

BATCH = 1000
# A page of the stream holds at most about this many bytes of results: an embedding's result carries its
# vectors (~20 KB of JSON a 1024-dimension input), so 1000 of them would be hundreds of MB in the head.
PAGE_BYTES = 16 * 1024 * 1024
FIRST_PAGE = 100
SHOW_REJECTED = 3  # rejected entries described one by one per pass; the rest only counted


@dataclass
class CollectSummary:
    succeeded: int = 0
    failed: int = 0
    rejected: int = 0  # entries that answer no prompt of this run (forged, foreign, unreadable)
    stale: int = 0  # results of a request `enqueue --rerun-changed` replaced: dropped, the prompt runs again
    by_input: dict[int, list[int]] = field(default_factory=dict)  # input -> [results, output tokens] stored

    @property
    def stored(self) -> int:
        return self.succeeded + self.failed

    def add(self, other: CollectSummary) -> None:
        self.succeeded += other.succeeded
        self.failed += other.failed
        self.rejected += other.rejected
        self.stale += other.stale
        for f, (n, tokens) in other.by_input.items():
            have = self.by_input.setdefault(f, [0, 0])
            have[0] += n
            have[1] += tokens

def redis_time_s(entry_id: bytes) -> float:
    """When Redis added a stream entry, in seconds: the milliseconds part of its id (`<ms>-<seq>`). Entries
    of one millisecond tie; the store's upsert lets the later-applied one win, and entries are applied in
    stream order."""
    return int(entry_id.partition(b"-")[0]) / 1000



def _stale(sent: str, stored: str, rerun: bool) -> bool:
    """Is a result of fingerprint `sent` not the answer to the request the store holds (`stored`)?"""
    if not sent:  # a worker older than fingerprints: only a replaced request makes it doubtful
        return rerun
    return bool(stored) and sent != stored


def collect_once(r: redis.Redis, store: Store, keys: Keys, *, batch: int = BATCH,
                 log: TextIO | None = None) -> CollectSummary:
    """Drain the results stream as it stands now."""
    log = log or sys.stderr
    out = CollectSummary()
    said = 0
    count = min(batch, FIRST_PAGE)  # then sized by what the entries weigh
    while True:
        entries = r.xrange(keys.results, min="-", max="+", count=count)
        if not entries:
            return out
        size = sum(len(f.get(b"r", b"")) for _, f in entries)
        full = len(entries) >= count  # more may wait
        count = max(1, min(batch, int(PAGE_BYTES * len(entries) / max(size, 1))))
        parsed: list[tuple[bytes, Result | None, str]] = []
        for eid, fields in entries:
            try:
                parsed.append((eid, loads(Result, fields[b"r"]), ""))
            except (KeyError, RecordError) as exc:
                parsed.append((eid, None, f"not a result record ({exc})"))
        ok_jids: list[str] = []
        failed: list[tuple[str, int]] = []  # (cid, seq) of failures stored: their jobs are trimmed
        rows: list[tuple[int, int, int, bytes, float]] = []
        rejected: list[str] = []
        stale: list[tuple[int, str, bool]] = []  # (seq, job id, ok) of results of a replaced request
        with store.write():
            known = store.lookup([res.cid for _, res, _ in parsed if res is not None])
            for eid, res, why in parsed:
                if res is not None:
                    hit = known.get(res.cid)
                    if hit is None:
                        why = f"custom_id {res.cid[:80]!r} was never enqueued in run {keys.run}"
                    elif res.jid != job_id_for(keys.run, res.cid):
                        why = f"job id {res.jid[:40]!r} is not the job of custom_id {res.cid[:80]!r}"
                    elif _stale(res.fp, hit[2], hit[3]):
                        stale.append((hit[0], res.jid, res.ok))
                        continue
                    else:
                        at = redis_time_s(eid)  # Redis's clock orders results, not the worker host's
                        rows.append((hit[0], hit[1], int(res.ok), orjson.dumps(res.batch_output_line()), at))
                        ok_jids.append(res.jid)
                        used = out.by_input.setdefault(hit[4], [0, 0])
                        used[0] += 1
                        used[1] += res.completion_tokens
                        if res.ok:
                            out.succeeded += 1
                        else:
                            out.failed += 1
                            failed.append((res.cid, hit[0]))
                        continue
                rejected.append(f"stream entry {eid.decode()}: {why}")
            store.store_results(rows)
            store.add_rejected(len(rejected))
            store.stale([seq for seq, _, _ in stale])
        out.rejected += len(rejected)
        out.stale += len(stale)
        for text in rejected[: max(0, SHOW_REJECTED - said)]:
            print(f"collect: dropped {text}", file=log, flush=True)
        said += len(rejected)
        pipe = r.pipeline(transaction=False)
        pipe.xdel(keys.results, *(eid for eid, _, _ in parsed))
        if ok_jids or stale:
            pipe.srem(keys.done, *ok_jids, *(jid for _, jid, _ in stale))
        pipe.execute()
        trim_failed(r, keys, failed)  # the store holds these prompts now: their failed jobs keep a stub
        _take_failed(r, keys, [(seq, jid) for seq, jid, ok in stale if not ok])  # the feed writes the new job
        if stale:
            print(f"collect: dropped {len(stale)} late result(s) of requests `enqueue --rerun-changed` replaced; "
                  "those prompts run again with their new request", file=log, flush=True)
        if said > SHOW_REJECTED and not full:
            print(f"collect: dropped {said} result(s) in all that answer no prompt of run {keys.run}",
                  file=log, flush=True)
        if not full:
            return out
