"""batchfleet.rqlayout agrees with the RQ that is installed: its key prefixes, registries, execution
members and timestamp format are RQ's own (read from RQ's code, not copied into the test)."""

from __future__ import annotations

from datetime import UTC, datetime

import redis
from rq.command import PUBSUB_CHANNEL_TEMPLATE
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.suspension import WORKERS_SUSPENDED
from rq.utils import parse_composite_key, utcformat
from rq.worker import Worker
from rq.worker_registration import REDIS_WORKER_KEYS

from batchfleet import rqlayout
from batchfleet.scripts import lua_helpers


def test_every_prefix_is_the_one_rq_uses() -> None:
    conn = redis.Redis()  # never connected: RQ builds key names without a round trip
    q = Queue("gpu0", connection=conn)
    assert q.key == rqlayout.QUEUE_PREFIX + "gpu0" and Queue.redis_queues_keys == rqlayout.QUEUES
    assert q.registry_cleaning_key == rqlayout.CLEAN_LOCK_PREFIX + "gpu0"
    assert Job.key_for("j1") == rqlayout.JOB_PREFIX + "j1"
    assert StartedJobRegistry("gpu0", connection=conn).key == rqlayout.STARTED_PREFIX + "gpu0"
    assert FailedJobRegistry("gpu0", connection=conn).key == rqlayout.FAILED_PREFIX + "gpu0"
    others = (FinishedJobRegistry, ScheduledJobRegistry, CanceledJobRegistry, DeferredJobRegistry)
    assert sorted(cls("gpu0", connection=conn).key for cls in others) == sorted(
        p + "gpu0" for p in rqlayout.OTHER_REGISTRIES)
    assert Result.get_key("j1") == rqlayout.RESULTS_PREFIX + "j1"
    assert Worker.redis_worker_namespace_prefix == rqlayout.WORKER_PREFIX and REDIS_WORKER_KEYS == rqlayout.WORKERS
    assert PUBSUB_CHANNEL_TEMPLATE % "w" == rqlayout.PUBSUB_PREFIX + "w" and WORKERS_SUSPENDED == rqlayout.SUSPENDED
    assert all(p.startswith(rqlayout.NAMESPACE) for p in (rqlayout.QUEUE_PREFIX, rqlayout.JOB_PREFIX,
                                                          rqlayout.STARTED_PREFIX, rqlayout.FAILED_PREFIX))


def test_an_execution_member_is_rqs_composite_key_and_parses_back() -> None:
    member = rqlayout.execution_member("bf-1:2", "a1b2c3")  # the execution id holds no colon; parsed from the right
    assert rqlayout.execution_job(member) == "bf-1:2" and rqlayout.execution_job(member.encode()) == "bf-1:2"
    assert parse_composite_key(rqlayout.execution_member("j1", "e1")) == ("j1", "e1")


def test_timestamps_are_rqs_format_in_python_and_in_lua(r: redis.Redis) -> None:
    t = 1_800_000_000.123456
    assert rqlayout.timestamp(t) == utcformat(datetime.fromtimestamp(t, UTC))
    lua = lua_helpers("iso", "execution_member", "execution_job") + (
        "return {iso(tonumber(ARGV[1]), tonumber(ARGV[2])), execution_member(ARGV[3], ARGV[4]),"
        " execution_job(ARGV[5])}")
    got = r.eval(lua, 0, 1_800_000_000, 123456, "j1", "e1", "bf-1:2:a1b2c3")
    assert [x.decode() for x in got] == [rqlayout.timestamp(t), rqlayout.execution_member("j1", "e1"), "bf-1:2"]
