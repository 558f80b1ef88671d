"""Records read from Redis are data: unknown fields are ignored (one warning), an enum value this
version does not know reads as UNKNOWN (one warning), bad values refused."""

from __future__ import annotations

import logging
from dataclasses import replace

import orjson
import pytest

from batchfleet.jobs import prompt_wire
from batchfleet.records import (
    CapCause,
    Event,
    EventKind,
    Prompt,
    RecordError,
    Result,
    ServerFacts,
    ServerMetrics,
    ServerSpec,
    Strategy,
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
    (WorkerStatus, b'{"worker": "w", "host": "h", "queue": "q", "gpu": 0, "state": 3}', "WorkerStatus.state"),
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
    wire = prompt_wire(p.cid, p.seq, p.url, p.body, src=p.src, run=p.run)  # as a job carries it
    assert Prompt.from_dict(wire) == p
    with pytest.raises(RecordError):
        Prompt.from_dict({**wire, "body": "not an object"})
    with pytest.raises(RecordError):
        Prompt.from_dict({**wire, "seq": 1.5})


def test_a_valid_spec_round_trips():
    spec = ServerSpec(generation=4, strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128)
    assert ServerSpec.from_json(spec.to_json()) == spec


def openai_shaped(line: dict) -> None:
    """OpenAI's BatchRequestOutput, field by field: id, custom_id (strings); response null or
    {status_code: int, request_id: str, body: object}; error null or {code: str, message: str}; exactly
    one of response and error set."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert isinstance(line["id"], str) and line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    assert (line["response"] is None) != (line["error"] is None)
    if line["response"] is not None:
        assert set(line["response"]) == {"status_code", "request_id", "body"}
        assert isinstance(line["response"]["status_code"], int) and isinstance(line["response"]["request_id"], str)
        assert isinstance(line["response"]["body"], dict)
    else:
        assert set(line["error"]) == {"code", "message"} and all(isinstance(v, str) for v in line["error"].values())


SERVER_400 = {"object": "error", "message": "The input (9000 tokens) is longer than the model's context length "
              "(4096 tokens).", "type": "BadRequestError", "param": None, "code": 400}


@pytest.mark.parametrize("result, response, error", [
    # an HTTP error answer: its status and the server's own body, no error object
    (Result(cid="c", jid="j", seq=1, status_code=400, body=SERVER_400,
            error={"code": "invalid_prompt", "message": "HTTP 400: too long"}),
     {"status_code": 400, "request_id": "j", "body": SERVER_400}, None),
    (Result(cid="c", jid="j", seq=1, status_code=503, body={"error": {"message": "The request queue is full."}},
            error={"code": "retries_exhausted", "message": "HTTP 503: full (after 3 attempts)"}),
     {"status_code": 503, "request_id": "j", "body": {"error": {"message": "The request queue is full."}}}, None),
    # an answer whose body was not JSON: its status, the text in an error body
    (Result(cid="c", jid="j", seq=1, status_code=413, error={"code": "invalid_prompt", "message": "HTTP 413: big"}),
     {"status_code": 413, "request_id": "j", "body": {"error": {"message": "HTTP 413: big"}}}, None),
    # no HTTP answer (or none usable): the error object, no response
    (Result(cid="c", jid="j", seq=1, status_code=0, error={"code": "retries_exhausted", "message": "refused"}),
     None, {"code": "retries_exhausted", "message": "refused"}),
    (Result(cid="c", jid="j", seq=1, status_code=200, error={"code": "retries_exhausted", "message": "not JSON"}),
     None, {"code": "retries_exhausted", "message": "not JSON"}),
    (Result(cid="c", jid="j", seq=1, status_code=0, error={"code": "server_crash", "message": "died"}),
     None, {"code": "server_crash", "message": "died"}),
    (Result(cid="c", jid="j", seq=1, status_code=200, body={"choices": []}),
     {"status_code": 200, "request_id": "j", "body": {"choices": []}}, None),
])
def test_an_http_error_is_exported_as_its_answer_and_only_no_answer_as_an_error(result, response, error):
    line = result.batch_output_line()
    assert line == {"id": "batch_req_j", "custom_id": "c", "response": response, "error": error}
    openai_shaped(orjson.loads(orjson.dumps(line)))


def test_a_worker_hibernating_in_a_newer_version_decodes_with_its_capacity_kept():
    """A rolling upgrade: a newer worker publishes a state this version does not know. Its record is
    kept (its queue, its capacity), and the state reads as UNKNOWN (the warning: the next test)."""
    ws = WorkerStatus(worker="w", host="h", queue="gpu3", gpu=3, state=WorkerState.SERVING, effective_max=12,
                      slots=14, surplus=2, in_flight=9, tokens_per_s=250.0, strategy=Strategy.NO_BUFFER,
                      facts=ServerFacts(effective_max_running=12, cap_cause=CapCause.MAMBA))
    d = orjson.loads(ws.to_json())
    d["state"] = "hibernating"
    back = WorkerStatus.from_json(orjson.dumps(d))
    assert back.state is WorkerState.UNKNOWN
    assert replace(back, state=WorkerState.SERVING) == ws  # everything else as written
    assert (back.queue, back.effective_max, back.slots) == ("gpu3", 12, 14)


def test_unknown_enum_values_read_as_unknown_with_one_warning_per_type_and_value(caplog):
    status = {"worker": "w", "host": "h", "queue": "q", "gpu": 0, "state": "serving", "effective_max": 7}
    caplog.set_level(logging.WARNING, logger="batchfleet.records")
    for _ in range(2):
        a = WorkerStatus.from_json(orjson.dumps({**status, "strategy": "quantum_buffer",
                                                 "facts": {"effective_max_running": 7, "cap_cause": "pipeline"}}))
        b = WorkerStatus.from_json(orjson.dumps({**status, "strategy": "quantum_buffer_lazy"}))
        e = Event.from_json(orjson.dumps({"kind": "hibernated", "message": "gpu0 sleeps", "data": {"n": 1}}))
    assert a.strategy is Strategy.UNKNOWN and b.strategy is Strategy.UNKNOWN and a.effective_max == 7
    assert a.facts is not None and a.facts.cap_cause is CapCause.UNKNOWN and a.facts.effective_max_running == 7
    assert e.kind is EventKind.UNKNOWN and e.message == "gpu0 sleeps" and e.data == {"n": 1}
    said = [r.getMessage() for r in caplog.records]
    assert [sum(f"{v!r}" in m for m in said) for v in ("quantum_buffer", "quantum_buffer_lazy", "pipeline",
                                                       "hibernated")] == [1, 1, 1, 1], said
    # What travels stays the same string.
    assert orjson.loads(a.to_json())["state"] == "serving" and orjson.loads(e.to_json())["kind"] == "unknown"


def test_a_spec_naming_a_strategy_this_version_does_not_know_is_refused_not_run_as_unknown():
    for value in ("quantum_buffer", "unknown"):
        with pytest.raises(RecordError, match="strategy"):
            ServerSpec.from_json(orjson.dumps({"generation": 3, "strategy": value}))


def test_records_built_here_hold_enum_members_not_strings():
    ws = WorkerStatus(worker="w", host="h", queue="q", gpu=0, state="serving", strategy="no_radix",  # type: ignore[arg-type]
                      facts=ServerFacts(cap_cause="kv"))  # type: ignore[arg-type]
    assert ws.state is WorkerState.SERVING and ws.strategy is Strategy.NO_RADIX
    assert ws.facts is not None and ws.facts.cap_cause is CapCause.KV
    assert ServerSpec(strategy="no_buffer").strategy is Strategy.NO_BUFFER  # type: ignore[arg-type]
    assert Event(kind="manual", message="m").kind is EventKind.MANUAL  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WorkerStatus(worker="w", host="h", queue="q", gpu=0, state="dancing")  # type: ignore[arg-type]


EMBEDDING_ANSWER = orjson.dumps({"data": [{"embedding": [0.0625, -0.125, 1e-05, 0.3333333432674408], "index": 0,
                                           "object": "embedding"}], "model": "m", "object": "list",
                                 "usage": {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0}})


def test_an_answer_carried_raw_exports_byte_for_byte_as_the_parsed_one_and_is_never_parsed_again():
    """An embedding's vectors travel from the worker to the export as the server's JSON text: the line is the
    same bytes as with the parsed body, and the record holds a string (the collector parses no float)."""
    parsed = Result(cid="c", jid="j", seq=1, status_code=200, body=orjson.loads(EMBEDDING_ANSWER))
    raw = Result(cid="c", jid="j", seq=1, status_code=200, raw_body=EMBEDDING_ANSWER.decode())
    assert orjson.dumps(raw.batch_output_line()) == orjson.dumps(parsed.batch_output_line())
    wire = orjson.loads(raw.to_json())
    assert wire["body"] is None and wire["raw_body"] == EMBEDDING_ANSWER.decode()
    back = Result.from_json(raw.to_json())
    assert back == raw and back.ok and back.completion_tokens == 0
    old = orjson.loads(parsed.to_json())
    del old["raw_body"]  # a worker older than raw_body: its body is exported as before
    assert orjson.dumps(Result.from_json(orjson.dumps(old)).batch_output_line()) == \
        orjson.dumps(parsed.batch_output_line())


@pytest.mark.parametrize("fields", [
    {"raw_body": '{"a": 1}', "body": {"a": 1}},  # both: which is the answer?
    {"raw_body": '{"a":\n1}'},  # would break the export's one line per prompt
    {"raw_body": '{"a": 1}\r'},
    {"raw_body": '[1, 2]'},  # not an object
])
def test_a_raw_body_that_is_not_one_object_on_one_line_is_refused(fields):
    with pytest.raises(RecordError, match="raw_body"):
        Result.from_json(orjson.dumps({"cid": "c", "jid": "j", "seq": 1, "status_code": 200, **fields}))


def _job(record: dict) -> bytes:
    from batchfleet.jobs import GENERATE
    return orjson.dumps([GENERATE, None, [record], {}])


@pytest.mark.parametrize(("jid_of", "record", "message"), [
    (("r", "c"), {"cid": "c", "seq": 1, "url": "/v1/chat/completions", "body": {}}, "names no run"),
    (("r", "c"), {"cid": "c", "seq": 1, "url": "/v1/chat/completions", "body": {}, "run": 7}, "names no run"),
    (("o", "c"), {"cid": "c", "seq": 1, "url": "/v1/chat/completions", "body": {}, "run": "o"}, "job of run 'o'"),
    (("r", "d"), {"cid": "c", "seq": 1, "url": "/v1/chat/completions", "body": {}, "run": "r"}, "job id is not"),
    (("r", "c"), {"cid": ["c"], "seq": 1, "run": "r"}, "job id is not"),
    (("o", "c"), {"cid": "c", "seq": 1, "trimmed": True, "run": "o"}, "job of run 'o'"),
    (("r", "d"), {"cid": "c", "seq": 1, "trimmed": True, "run": "r"}, "job id is not"),
    (("r", "c"), {"cid": "c", "seq": "1", "url": "/v1/chat/completions", "body": {}, "run": "r"}, "malformed prompt"),
    (("r", "c"), {"cid": "c", "seq": 1, "url": "/v1/x", "body": {}, "run": "r"}, "request refused"),
])
def test_a_job_is_refused_for_whose_it_is_before_its_prompt_is_read(jid_of, record, message):
    """A worker of run `r` refuses a job of another run, or whose id is not its custom_id's, from its
    raw fields: a trimmed job the same way; only this run's own jobs are decoded and checked further."""
    from batchfleet.errors import JobRefused
    from batchfleet.jobs import job_id_for, read_job
    with pytest.raises(JobRefused, match=message):
        read_job(job_id_for(*jid_of), _job(record), "r")


def test_a_trimmed_job_of_this_run_is_recognised_and_a_whole_one_is_read():
    from batchfleet.jobs import Trimmed, job_id_for, read_job, trimmed_data
    with pytest.raises(Trimmed) as got:
        read_job(job_id_for("r", "c"), trimmed_data("r", "c", 3), "r")
    assert got.value.cid == "c"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    prompt = read_job(job_id_for("r", "c"), _job(prompt_wire("c", 3, "/v1/chat/completions", chat, run="r")), "r")
    assert (prompt.cid, prompt.seq, prompt.run, prompt.body) == ("c", 3, "r", chat)
