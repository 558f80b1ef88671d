"""A failed prompt's job once its result is collected: trimmed to a stub (custom_id, seq, run).

The store holds the prompt, so the failed job in RQ's registry needs only what feeds it again when
`rq requeue` brings it back (a worker that claims a trimmed job hands its custom_id to the head through
`Keys.refeed`; see `producer.ends`). Used by the collector; its own module so that `collect` and
`ends` do not import each other.
"""

from __future__ import annotations

import redis

from batchfleet.jobs import job_id_for, trimmed_data
from batchfleet.keys import Keys

from .scripts import TRIM

__all__ = ["trim_failed"]

PAGE = 1000  # jobs per Lua call


def trim_failed(r: redis.Redis, keys: Keys, failed: list[tuple[str, int]]) -> int:
    """Trim the jobs of these collected failures, (cid, seq) each. Returns the bytes freed."""
    if not failed:
        return 0
    freed = 0
    for i in range(0, len(failed), PAGE):
        part = failed[i : i + PAGE]
        jobs = [Keys.job(job_id_for(keys.run, cid)) for cid, _ in part]
        stubs = [trimmed_data(keys.run, cid, seq) for cid, seq in part]
        freed += int(TRIM.call(r, keys={"done": keys.done, "jobs": jobs}, args={"stubs": stubs}))
    return freed
