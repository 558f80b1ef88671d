"""The producer's Redis scripts (`producer/lua/*.lua`, run through `batchfleet.scripts`), declared here
with their KEYS and ARGV. Each file says what it does and returns.

Every key arrives in KEYS, built by `batchfleet.keys`, but two kinds: `cancel` and `expire_failed`
read a job's origin from its hash and derive that queue's keys (`derives`).

| script | used by | what |
| --- | --- | --- |
| feed | feed.Feeder | a batch of prompts from the store -> RQ jobs, grouped by queue |
| check | recover.audit | where each fed job is now: one letter per job |
| take_failed | recover.recover | take back jobs failed by a foreign worker |
| trim | trim.trim_failed | a collected failure's job keeps a stub of its data |
| cancel | ends.cancel_prompts | remove cancelled prompts' jobs (a run's or a serve batch's), in any state |
| run_jobs | ends.purge | which of a SCAN batch of job keys belong to a run |
| expire | ends.expire_finished | a finished run's keys expire (never later than they would) |
| expire_failed | ends.expire_finished | a finished run's failed jobs expire, with their failed-registry score |
"""

from __future__ import annotations

from batchfleet.scripts import Each, Script

__all__ = ["CANCEL", "CHECK", "EXPIRE", "EXPIRE_FAILED", "FEED", "RUN_JOBS", "TAKE_FAILED", "TRIM"]

FEED = Script("producer", "feed", keys=("done", "stats", "queue_index", Each("queues"), Each("jobs")),
              argv=("front", Each("names"), Each("counts"), Each("shared"), Each("sizes"),  # one of each per queue
                    Each("jobs_argv", "data", "grp")))
CHECK = Script("producer", "check", keys=("done", Each("jobs")))
TAKE_FAILED = Script("producer", "take_failed", keys=("done", Each("jobs", "job", "failed", "results")))
TRIM = Script("producer", "trim", keys=("done", Each("jobs")), argv=(Each("stubs"),))  # a stub per job
CANCEL = Script("producer", "cancel",
                keys=("done", "strikes", "suspects", "isolate", "leases", Each("jobs", "job", "results")),
                derives=("queue_key", "started_key", "failed_key"))
RUN_JOBS = Script("producer", "run_jobs", keys=(Each("jobs"),), argv=("suffix",))
EXPIRE = Script("producer", "expire", keys=(Each("targets"),), argv=("ttl",))
EXPIRE_FAILED = Script("producer", "expire_failed", keys=(Each("jobs"),), argv=("ttl",), derives=("failed_key",))
