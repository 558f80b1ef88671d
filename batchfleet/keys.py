"""Every Redis key batchfleet reads or writes, and every TTL. Nothing else builds key strings in
Python; a Redis script gets every key in KEYS from here, but those of jobs it learns of inside, which
one Lua helper per kind derives (`batchfleet.scripts`, `derives`).

RQ's own keys (queues, job hashes, registries) are used as RQ lays them out (`batchfleet.rqlayout`)
so that `rq info`, `rq requeue` and RQ's failed-job registry keep working; batchfleet's keys live
under `bf:<run>:`.

| key | type | written by | what |
| --- | --- | --- | --- |
| rq:queue:<q> | list | producer | job ids waiting on queue <q> (one per GPU) |
| rq:queues | set | producer | RQ's index of queues |
| rq:job:<id> | hash | producer/worker | the RQ job; deleted when it succeeds (result_ttl=0) |
| rq:wip:<q> | zset | worker | RQ's started registry (`rq info` "executing") |
| rq:failed:<q> | zset | worker | RQ's failed registry (`rq requeue` works on it) |
| rq:results:<id> | stream | RQ | a stock RQ worker's record of a job it ran (deleted by `producer recover`) |
| rq:worker:<name> | hash | RQ (worker) | RQ's worker registration (`rq info`); also sets rq:workers, rq:workers:<q> |
| rq:pubsub:<name> | channel | RQ | RQ's commands to one worker (`shutdown`: drain, exit 75) |
| bf:<run>:leases | zset | worker | `rqlayout.execution_member` -> expiry, Redis's clock (TIME); lapses if not renewed |
| bf:<run>:strikes | hash | worker | job id -> server deaths it was in (STRIKES_TTL_S; field gone when it finishes) |
| bf:<run>:suspects | list | worker | queued job ids with 1 strike: run in groups, one per worker at a time |
| bf:<run>:isolate | list | worker | queued job ids with 2 strikes: a worker reserves one, drains, and runs it alone |
| bf:<run>:done | set | worker/collector | job ids whose result is in the stream but not yet collected |
| bf:<run>:results | stream | worker | result records on their way to the collector (bounded by it) |
| bf:<run>:meta | hash | producer | the run marker: the run's store (host, path, id), created, queues (*) |
| bf:<run>:stats | hash | all | counters (below); `store_waiting`, `store_pending` (**) |
| bf:<run>:workers | set | worker | names of workers that published a status record |
| bf:<run>:status:<worker> | string | worker | the worker's latest status record (expires) |
| bf:<run>:events | stream | supervisor/worker | `Event`s (field `e`): decisions and restarts (capped) |
| bf:<run>:control | hash | supervisor | desired `ServerSpec`: field `fleet`, `queue:<queue>` overrides (one GPU) |
| bf:<run>:retry | hash | supervisor | queue -> token: a `failed` GPU's worker tries again when it changes |
| bf:<run>:history | stream | supervisor | fleet samples (field `s`) for `supervisor report` (capped) |
| bf:<run>:autopilot | string | supervisor | the autopilot's state (phase, changes tried and failed) |
| bf:<run>:cancel | hash | producer/worker | `producer cancel` was run: `at`; `ack:<worker>` = prompts dropped |
| bf:<run>:refeed | list | worker | custom_ids of trimmed failed jobs `rq requeue` brought back: the head feeds them |
| bf:<run>:launcher | string | batchfleet run/serve | lease of the live launcher (command, host, pid; LAUNCHER_TTL_S) |
| bf:<run>:drop | set | producer | job ids of prompts cancelled while fed (DROP_TTL_S, renewed on each add) (***) |
| bf:<run>:signals | channel | producer | PUBLISH `{"drop": n}` after adding n job ids to `drop` (***) |
| bf:memory | hash | supervisor | across runs: model, GPU, version, shape -> the best spec verified (****) |

Counters in `bf:<run>:stats` (`<name>:<queue>` counts per origin queue where noted):
`enqueued`(:q), `succeeded`(:q), `failed`(:q; includes quarantined prompts), `completion_tokens`,
`handed_back` (given back untouched: shutdown, restart, a server death it was not inside),
`recovered` (a lapsed lease's job requeued), `refused`(:q; a job no worker may run: RQ's failed
registry, no result), `server_deaths`, `struck` (strikes given), `quarantined`; `prompt_tokens`(:q) and
`cached_tokens`(:q), what the servers prefilled and took from their radix caches (their own counters, as
each worker scrapes them); `plan_shared:q`, `plan_bytes:q`, the prefix plan's prediction: bytes of the
prompts fed to q shared with the prompt fed there before each, of all their bytes (producer/plan.py).

A job waiting to run is in one of three lists: its queue `rq:queue:<q>`, or `bf:<run>:suspects` /
`bf:<run>:isolate` once a server died with it inside (status `queued` in each case).

Runs end (see `producer.ends`): `producer cancel` empties the run's part of Redis but its results;
`producer purge` deletes every key of the run; once every prompt of the run has its result in the
store, the head sets FINISHED_TTL_S (config `finished_ttl_s`) on every key of `Keys.run_keys` and on
the run's failed jobs. A failed job whose result is collected keeps a trimmed `data` (its prompt is in
the store; `rq requeue` still works: the worker hands it to the head through `refeed`).

(*) No TTL while the run has prompts to finish (an ended run's keys expire). Its absence while the
store has prompts in Redis (FED) means Redis lost the run's data (see `batchfleet.marker`).
(**) Gauges, not counters, set by the head on each pass: prompts in the store it has not fed to Redis
yet (`store_waiting`), and prompts in the store without a result (`store_pending`).
(***) How a cancel reaches the workers at once (`producer.ends.announce_drop`: `producer cancel` of a
run, the cancel or expiry of a `batchfleet serve` batch, which is a subset of its run's prompts). The
producer SADDs the job ids of the cancelled prompts that were fed, then PUBLISHes `{"drop": n}` on
`signals`. A worker drops every in-flight prompt whose job id is in `drop` (SMISMEMBER of what it
holds, on each message and at its lease beat in case it missed one): it cancels the request (the
server aborts it), releases the lease and publishes nothing. The producer has already removed those
jobs and their leases, so a result that would still come is refused as stale. Job ids are never
reused for another request of a cancelled prompt, so the set only grows until its TTL.
(****) Not a run's key: it outlives runs (no TTL, not in `run_keys`, never purged with a run), so the
next run of the same model on the same kind of GPU, SGLang version and server shape starts where the
last one ended (`supervisor/memory.py`). Redis is where every host's supervisor meets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# RQ's prefixes, as `batchfleet.rqlayout` defines them (re-exported under these names)
from .rqlayout import CLEAN_LOCK_PREFIX as RQ_CLEAN_LOCK_PREFIX
from .rqlayout import FAILED_PREFIX as RQ_FAILED_PREFIX
from .rqlayout import JOB_PREFIX as RQ_JOB_PREFIX
from .rqlayout import OTHER_REGISTRIES as RQ_OTHER_REGISTRIES
from .rqlayout import PUBSUB_PREFIX as RQ_PUBSUB_PREFIX
from .rqlayout import QUEUE_PREFIX as RQ_QUEUE_PREFIX
from .rqlayout import QUEUES as RQ_QUEUES
from .rqlayout import RESULTS_PREFIX as RQ_RESULTS_PREFIX
from .rqlayout import STARTED_PREFIX as RQ_STARTED_PREFIX
from .rqlayout import SUSPENDED as RQ_SUSPENDED
from .rqlayout import WORKER_PREFIX as RQ_WORKER_PREFIX
from .rqlayout import WORKERS as RQ_WORKERS

__all__ = ["QUEUE_NAME_RE", "RQ_CLEAN_LOCK_PREFIX", "RQ_FAILED_PREFIX", "RQ_JOB_PREFIX", "RQ_OTHER_REGISTRIES",
           "RQ_PUBSUB_PREFIX", "RQ_QUEUES", "RQ_QUEUE_PREFIX", "RQ_RESULTS_PREFIX", "RQ_STARTED_PREFIX", "RQ_SUSPENDED",
           "RQ_WORKERS", "RQ_WORKER_PREFIX", "Keys", "valid_queue_name"]

# What a queue name may hold (it becomes part of RQ's key names and of log lines).
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def valid_queue_name(name: object) -> bool:
    return isinstance(name, str) and QUEUE_NAME_RE.fullmatch(name) is not None


# Fields of `stats` that are gauges, not counters (the head sets them): prompts in the store it has not
# fed yet, and prompts in the store without a result.
STORE_WAITING = "store_waiting"
STORE_PENDING = "store_pending"
# Counters of `stats` (the table above): the servers' prefill, and the plan's prediction of it.
PROMPT_TOKENS, CACHED_TOKENS = "prompt_tokens", "cached_tokens"
PLAN_SHARED, PLAN_BYTES = "plan_shared", "plan_bytes"

# TTLs and caps, in seconds or entries.
FAILURE_TTL_S = 7 * 24 * 3600  # failed jobs stay requeueable for a week (RQ's default is a year)
STATUS_TTL_S = 30  # a worker silent this long is treated as gone
STARTED_REGISTRY_TTL_S = 24 * 3600  # RQ's cleanup must never reap our jobs; leases do that job
STRIKES_TTL_S = 7 * 24 * 3600  # a prompt's server-death count outlives any worker, not the run's failed jobs
FINISHED_TTL_S = 7 * 24 * 3600  # default life of a finished run's keys (config `finished_ttl_s`)
TRIMMED = "trimmed"  # field of a failed job hash whose `data` was trimmed (its original size in bytes)
LAUNCHER_TTL_S = 15  # a launcher killed with -9 blocks the next one on another host at most this long
DROP_TTL_S = 24 * 3600  # the drop set lives a day past its last addition
EVENTS_MAXLEN = 10_000
HISTORY_MAXLEN = 100_000  # one fleet sample per second is a day of history


@dataclass(frozen=True, slots=True)
class Keys:
    """The key layout of one run."""

    run: str = "default"

    MEMORY = "bf:memory"  # across runs (see the table): not under the run's prefix

    # --- RQ's layout -------------------------------------------------------------------------
    @staticmethod
    def queue(name: str) -> str:
        return RQ_QUEUE_PREFIX + name

    @staticmethod
    def job(job_id: str) -> str:
        return RQ_JOB_PREFIX + job_id

    @staticmethod
    def started(queue: str) -> str:
        return RQ_STARTED_PREFIX + queue

    @staticmethod
    def failed(queue: str) -> str:
        return RQ_FAILED_PREFIX + queue

    @staticmethod
    def queue_name(queue_key: bytes | str) -> str:
        """`rq:queue:gpu0` (a member of `rq:queues`) -> `gpu0`."""
        key = queue_key.decode() if isinstance(queue_key, bytes) else queue_key
        return key[len(RQ_QUEUE_PREFIX):] if key.startswith(RQ_QUEUE_PREFIX) else key

    @staticmethod
    def rq_results(job_id: str) -> str:
        return RQ_RESULTS_PREFIX + job_id

    # --- batchfleet's own ----------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"bf:{self.run}:"

    @property
    def leases(self) -> str:
        return self.prefix + "leases"

    @property
    def done(self) -> str:
        return self.prefix + "done"

    @property
    def results(self) -> str:
        return self.prefix + "results"

    @property
    def meta(self) -> str:
        """The run marker (see `producer.marker`)."""
        return self.prefix + "meta"

    # Every run's marker, for listing the runs a Redis holds (SCAN MATCH; run names hold no glob
    # characters, see Config).
    META_PATTERN = "bf:*:meta"

    @staticmethod
    def run_of_meta(key: bytes | str) -> str | None:
        """`bf:<run>:meta` -> `<run>`; None for any other key."""
        text = key.decode(errors="replace") if isinstance(key, bytes) else key
        if text.startswith("bf:") and text.endswith(":meta") and len(text) > len("bf::meta"):
            return text[len("bf:"):-len(":meta")]
        return None

    @property
    def stats(self) -> str:
        return self.prefix + "stats"

    @property
    def strikes(self) -> str:
        return self.prefix + "strikes"

    @property
    def suspects(self) -> str:
        return self.prefix + "suspects"

    @property
    def isolate(self) -> str:
        return self.prefix + "isolate"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    def status(self, worker: str) -> str:
        return self.prefix + "status:" + worker

    @property
    def events(self) -> str:
        return self.prefix + "events"

    @property
    def control(self) -> str:
        return self.prefix + "control"

    @property
    def retry(self) -> str:
        """Queue -> token: a worker whose GPU is `failed` starts its server again when its token changes."""
        return self.prefix + "retry"

    @property
    def history(self) -> str:
        return self.prefix + "history"

    @property
    def autopilot(self) -> str:
        return self.prefix + "autopilot"

    @property
    def cancel(self) -> str:
        """The run's cancel flag (a hash: `at`, `ack:<worker>`); see `producer.ends`."""
        return self.prefix + "cancel"

    CANCEL_ACK_PREFIX = "ack:"

    @property
    def refeed(self) -> str:
        return self.prefix + "refeed"

    @property
    def launcher(self) -> str:
        """The lease of the live `batchfleet run` or `batchfleet serve` of the run (see fleetrun.lease); not
        in `run_keys`: it keeps its own TTL."""
        return self.prefix + "launcher"

    @property
    def drop(self) -> str:
        """Job ids whose prompts were cancelled while fed: workers drop them in flight (see the table)."""
        return self.prefix + "drop"

    @property
    def signals(self) -> str:
        """The run's pub/sub channel: `{"drop": n}` when job ids were added to `drop`."""
        return self.prefix + "signals"

    @property
    def tenants(self) -> str:
        """Tenant -> `TenantFigures`: what the head of a shared fleet (`batchfleet serve`) knows of each
        tenant's share; read by serve's /v1/fleet, screen and metrics."""
        return self.prefix + "tenants"

    @property
    def wake(self) -> str:
        """A list the head waits on between its passes: an element pushed (serve stored a batch) starts
        the next pass at once."""
        return self.prefix + "wake"

    @property
    def pattern(self) -> str:
        """SCAN MATCH pattern of every batchfleet key of the run (run names hold no glob characters)."""
        return self.prefix + "*"

    def run_keys(self) -> list[str]:
        """The run's fixed batchfleet keys (status:<worker> records expire by themselves; not `drop`: its own
        TTL, DROP_TTL_S, which enqueueing again must not lift)."""
        return [self.leases, self.done, self.results, self.meta, self.stats, self.strikes, self.suspects,
                self.isolate, self.workers, self.events, self.control, self.retry, self.history, self.autopilot,
                self.cancel, self.refeed, self.tenants, self.wake]

    CONTROL_FLEET = "fleet"
    # Not a spec: set ("1") by `supervisor watch --fresh-start` / `batchfleet run --fresh-start`: workers
    # do not start on the fleet's memory (`MEMORY`) in this run.
    CONTROL_FRESH = "fresh"

    @staticmethod
    def memory_field(model: str, gpu_name: str, gpu_memory_mib: int | None, version: str, shape: str) -> str | None:
        """The field of `MEMORY` for one kind of server; None when any part of it is unknown (such a
        server never uses the memory)."""
        if not (model and gpu_name and gpu_memory_mib and version and shape):
            return None
        return json.dumps([model, gpu_name, gpu_memory_mib, version, shape], separators=(",", ":"), ensure_ascii=False)

    CONTROL_QUEUE_PREFIX = "queue:"
    CONTROL_WORKER_PREFIX = "worker:"

    @staticmethod
    def control_queue(queue: str) -> str:
        """The field of `control` that overrides the fleet's spec for the GPU serving `queue`: a stable
        identity (queue names are unique in a run), so a worker restarted under a new name (its pid is
        in it) still finds what was asked of its GPU."""
        return Keys.CONTROL_QUEUE_PREFIX + queue

    @staticmethod
    def control_worker(worker: str) -> str:
        """Legacy per-worker-name override field (written by older supervisors); still honoured."""
        return Keys.CONTROL_WORKER_PREFIX + worker
