"""Configuration: one typed object from the environment; mistakes are errors, not silence."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchfleet.config import Config, gpu_index_for_queue
from batchfleet.errors import ConfigError


def test_values_are_typed_and_redis_url_falls_back_to_rqs_variable():
    c = Config.from_env({"REDIS_URL": "rediss://:pw@h:6380/1", "BATCHFLEET_QUEUES": "gpu0, gpu1",
                         "BATCHFLEET_MEM_FRACTION_STATIC": "0.9", "BATCHFLEET_MAX_RUNNING_REQUESTS": "128",
                         "BATCHFLEET_STATE_DIR": "/tmp/x", "BATCHFLEET_GPU": ""})
    assert c.redis_url == "rediss://:pw@h:6380/1" and c.queues == ("gpu0", "gpu1")
    assert c.mem_fraction_static == 0.9 and c.max_running_requests == 128 and c.gpu is None
    assert c.results_db == Path("/tmp/x/default.sqlite")
    assert Config.from_env({"REDIS_URL": "redis://a", "BATCHFLEET_REDIS_URL": "redis://b"}).redis_url == "redis://b"


@pytest.mark.parametrize("env, message", [
    ({"BATCHFLEET_QUEUS": "gpu0"}, "did you mean BATCHFLEET_QUEUES"),
    ({"BATCHFLEET_STRATEGY": "fast"}, "strategy 'fast' is not one of"),
    ({"BATCHFLEET_MEM_FRACTION_STATIC": "1.5"}, "mem_fraction_static must be in"),
    ({"BATCHFLEET_LEASE_TTL_S": "soon"}, "BATCHFLEET_LEASE_TTL_S='soon'"),
    ({"BATCHFLEET_RUN": "a b"}, "run name"),
    ({"BATCHFLEET_SERVER_ARGS": "--x 'unclosed"}, "do not parse"),
    ({"BATCHFLEET_EVENT_LOOP": "trio"}, "event_loop 'trio' is not one of auto, uvloop, asyncio"),
    ({"BATCHFLEET_SERVER_API_KEY": "k\r\nX-Evil: 1"}, "line break or NUL"),
])
def test_mistakes_are_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(env)


def test_the_queue_names_the_gpu():
    assert gpu_index_for_queue("gpu3") == 3
    assert gpu_index_for_queue("gpu12") == 12
    assert gpu_index_for_queue("jobA.gpu7") == 7
    assert gpu_index_for_queue("cpu") is None


def test_surplus_is_unset_zero_or_a_positive_number():
    assert Config.from_env({}).surplus is None  # sized from turnover
    assert Config.from_env({"BATCHFLEET_SURPLUS": "0"}).surplus == 0
    assert Config.from_env({"BATCHFLEET_SURPLUS": "4"}).surplus == 4
    with pytest.raises(ConfigError, match="surplus"):
        Config.from_env({"BATCHFLEET_SURPLUS": "-1"})


def test_the_worker_runs_on_uvloop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch):
    import asyncio
    import sys

    import uvloop

    from worker.eventloop import loop_factory

    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    assert loop_factory("auto") is None
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")
