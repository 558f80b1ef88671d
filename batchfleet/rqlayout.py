"""RQ 2.12's layout in Redis, as batchfleet reads and writes it beside RQ: key prefixes, the job hash's
fields and statuses, the registries' members and scores, and the timestamp format.

batchfleet's scripts write RQ's structures directly (a stock worker spends ~16 round trips per job),
so that `rq info`, `rq requeue` and RQ's failed-job registry keep working. Everything they must agree
on with RQ is here; `batchfleet.keys` builds the key names from these prefixes, and the scripts' Lua
helpers (`rqlayout.lua`, loaded by `batchfleet.scripts`) are filled in from the same constants.

| structure | key | what batchfleet does with it |
| --- | --- | --- |
| queue (list) | `rq:queue:<q>` | the producer pushes job ids; workers pop them |
| queue index (set) | `rq:queues` | the producer adds each queue key it feeds |
| job (hash) | `rq:job:<id>` | fields below |
| started registry (zset) | `rq:wip:<q>` | member `<job id>:<execution id>`, score = expiry (Redis's clock) |
| failed registry (zset) | `rq:failed:<q>` | member `<job id>`, score = expiry (Redis's clock) |
| result (stream) | `rq:results:<id>` | a stock RQ worker's record of a job it ran (deleted, never written) |

Job hash fields batchfleet reads or writes: `data` (the payload), `origin` (its queue), `status`
(`queued`, `started`, `failed`: `rq.job.JobStatus` values), `started_at`, `last_heartbeat`, `ended_at`
(timestamps, below), `worker_name`, `exc_info` (why it failed).

A started-registry member is RQ's execution key, `<job id>:<execution id>`; batchfleet's execution id
is the worker process's session, and its lease (`Keys.leases`) has the same member. `execution_member`
and `execution_job` make and parse it, here and (same names) in the scripts' Lua helpers.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["CLEAN_LOCK_PREFIX", "FAILED_PREFIX", "JOB_PREFIX", "NAMESPACE", "OTHER_REGISTRIES", "PUBSUB_PREFIX",
           "QUEUES", "QUEUE_PREFIX", "RESULTS_PREFIX", "STARTED_PREFIX", "SUSPENDED", "TIMESTAMP_FORMAT", "WORKERS",
           "WORKER_PREFIX", "execution_job", "execution_member", "timestamp"]

NAMESPACE = "rq:"  # every key of RQ's starts with it
QUEUE_PREFIX = "rq:queue:"  # rq.Queue.redis_queue_namespace_prefix
QUEUES = "rq:queues"  # rq.Queue.redis_queues_keys
JOB_PREFIX = "rq:job:"  # rq.job.Job.redis_job_namespace_prefix
STARTED_PREFIX = "rq:wip:"  # rq.registry.StartedJobRegistry.key_template
FAILED_PREFIX = "rq:failed:"  # rq.registry.FailedJobRegistry.key_template
RESULTS_PREFIX = "rq:results:"  # rq.results.Result
# RQ's keys batchfleet never builds names of, but which a Redis ACL must name (batchfleet.acl): a
# worker's registration hash and indexes, its command channel, RQ's other registries and locks.
WORKER_PREFIX = "rq:worker:"  # rq:worker:<name> (hash)
WORKERS = "rq:workers"  # set of worker keys; rq:workers:<q> per queue
PUBSUB_PREFIX = "rq:pubsub:"  # channel rq:pubsub:<worker name>: `rq.command.send_command`
OTHER_REGISTRIES = ("rq:finished:", "rq:scheduled:", "rq:canceled:", "rq:deferred:")
SUSPENDED = "rq:suspended"  # `rq suspend`
CLEAN_LOCK_PREFIX = "rq:clean_registries:"

TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # rq.utils.utcformat: `started_at`, `ended_at`, `last_heartbeat`


def timestamp(seconds: float) -> str:
    """A time as RQ writes it in a job hash (UTC, microseconds). The scripts write it from Redis's clock
    (`iso` in the Lua helpers), never from a worker's."""
    return datetime.fromtimestamp(seconds, UTC).strftime(TIMESTAMP_FORMAT)


def execution_member(job_id: str, execution: str) -> str:
    """The member of RQ's started registry (and of batchfleet's leases) for one execution of a job."""
    return f"{job_id}:{execution}"


def execution_job(member: bytes | str) -> str:
    """The job id of a started-registry or lease member (`execution_member`'s inverse; '' if it has no
    execution part)."""
    text = member.decode(errors="replace") if isinstance(member, bytes) else member
    return text.rpartition(":")[0]
