"""Records read from Redis are data: unknown fields are ignored (one warning), bad values refused."""

from __future__ import annotations

import logging

import orjson
import pytest

from batchfleet.records import (
    Event,
    Prompt,
    RecordError,
    Result,
    ServerMetrics,
    ServerSpec,
    WorkerState,
    WorkerStatus,
)


def test_a_newer_versions_fields_are_ignored_with_one_warning(caplog):
    ws = WorkerStatus(worker="w", host="h", queue="gpu0", gpu=0, state=WorkerState.SERVING,
                      metrics=ServerMetrics(running=3.0))
    d = orjson.loads(ws.to_json())
    d["from_the_future"] = {"x": 1}
    d["metrics"]["new_gauge"] = 0.5
    caplog.set_level(logging.WARNING, logger="batchfleet.records")
    for _ in range(3):
        back = WorkerStatus.from_json(orjson.dumps(d))
    assert back == ws and back.state is WorkerState.SERVING and back.metrics.running == 3.0
    said = [r.getMessage() for r in caplog.records]
    assert sum("from_the_future" in m for m in said) == 1
    assert sum("new_gauge" in m for m in said) == 1


@pytest.mark.parametrize("cls, raw, message", [
    (ServerSpec, b'{"generation": 2, "strategy": "bogus"}', "strategy 'bogus' is not one of"),
    (ServerSpec, b'{"strategy": "no_buffer", "mem_fraction_static": 1.5}', "outside [0.3, 0.98]"),
    (ServerSpec, b'{"strategy": "no_buffer", "max_running_requests": 100000}', "outside [1, 4096]"),
    (ServerSpec, b'{"generation": "2"}', "ServerSpec.generation"),
    (ServerSpec, b'{"generation": true}', "ServerSpec.generation"),
    (ServerSpec, b'{"generation": -1}', "negative"),
    (ServerSpec, b'[1, 2]', "not a JSON object"),
    (ServerSpec, b'{"strat', "not JSON"),
    (WorkerStatus, b'{"worker": "w", "host": "h", "queue": "q", "gpu": 0, "state": "dancing"}', "WorkerStatus.state"),
    (WorkerStatus, b'{"worker": "w", "host": "h", "queue": "q", "gpu": 0}', "state"),
    (WorkerStatus, b'{"worker": "w", "host": "h", "queue": "q", "gpu": 0, "state": "down", "metrics": 3}',
     "WorkerStatus.metrics"),
    (Result, b'{"cid": "c", "jid": "j", "seq": 1, "status_code": "200"}', "Result.status_code"),
    (Event, b'{"kind": "x"}', "message"),
])
def test_malformed_records_are_refused_with_a_reason(cls, raw, message):
    with pytest.raises(RecordError) as err:
        cls.from_json(raw)
    assert message in str(err.value)


def test_prompt_from_dict_checks_types():
    p = Prompt(cid="a", seq=3, url="/v1/completions", body={"prompt": "x"}, src="f:1", run="r")
    assert Prompt.from_dict(p.to_dict()) == p
    with pytest.raises(RecordError):
        Prompt.from_dict({**p.to_dict(), "body": "not an object"})
    with pytest.raises(RecordError):
        Prompt.from_dict({**p.to_dict(), "seq": 1.5})


def test_a_valid_spec_round_trips():
    spec = ServerSpec(generation=4, strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128)
    assert ServerSpec.from_json(spec.to_json()) == spec
