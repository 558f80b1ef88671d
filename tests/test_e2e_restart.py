"""The worker's side of the restart protocol, and work stealing, with real processes."""

from __future__ import annotations

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.records import Event, ServerSpec, WorkerState

from .fleet import Fleet, expected_text, text_of, write_prompts

pytestmark = pytest.mark.slow


def test_worker_follows_a_new_server_spec_without_losing_prompts(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={"SGLANG_SIM_TIME_SCALE": "10",
                                                    "BATCHFLEET_SHUTDOWN_GRACE_S": "1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 200, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: any(s.state is WorkerState.SERVING and s.in_flight > 0 for s in fleet.statuses()), 60,
                   "serving")
    (before,) = fleet.statuses()
    assert before.effective_max == 12 and before.strategy == "default"

    spec = ServerSpec(generation=1, strategy="no_buffer", max_running_requests=64)
    fleet.r.hset(fleet.k.control, Keys.CONTROL_FLEET, spec.to_json())
    fleet.wait_for(lambda: any(s.generation == 1 and s.state is WorkerState.SERVING for s in fleet.statuses()), 60,
                   "the new generation to serve")
    (after,) = fleet.statuses()
    assert after.effective_max == 20 and after.strategy == "no_buffer"
    rec = fleet.sim_record(0)  # the new server process
    assert rec["argv"][rec["argv"].index("--mamba-radix-cache-strategy") + 1] == "no_buffer"
    assert "--disable-overlap-schedule" in rec["argv"]
    events = [Event.from_json(f[b"e"]) for _, f in fleet.r.xrange(fleet.k.events)]
    restarted = [e for e in events if e.kind == "restarted"]
    assert len(restarted) == 1
    assert restarted[0].data["capacity"] == 20 and restarted[0].data["previous_generation"] == 0
    assert "memory free again" in restarted[0].data["gpu"]

    fleet.wait_for(lambda: fleet.finished() >= 200, 120, "all prompts")
    fleet.stop_all()
    assert fleet.sim_record(0)["peak_running"] == 20  # the resized semaphore filled the new capacity
    out = tmp_path / "out.jsonl"
    fleet.producer("export", str(out))
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [x["custom_id"] for x in lines] == [r["id"] for r in rows]
    assert all(text_of(x["response"]["body"]) == expected_text(r) for x, r in zip(lines, rows, strict=True))
    assert fleet.stats()["succeeded"] == 200


def test_a_worker_with_an_empty_queue_takes_from_the_others(tmp_path, redis_url):
    fleet = Fleet(tmp_path, redis_url, gpus=2)
    write_prompts(tmp_path / "prompts.jsonl", 300, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queue(0))  # everything on GPU 0's queue
    fleet.start_worker(0)
    fleet.start_worker(1)
    fleet.wait_for(lambda: fleet.finished() >= 300, 120, "all prompts")
    fleet.stop_all()
    recs = [fleet.sim_record(g) for g in (0, 1)]
    served = [sum(rec["requests_by_endpoint"].values()) for rec in recs]
    assert sum(served) == 300 and served[1] > 0
    # GPU 1 kept taking while it was up: its requests per second from its first admission to its last finish
    # are at least half GPU 0's (its server may start seconds later on a loaded machine: a count would say
    # how late, not whether it idled; one that stops taking, or takes once and waits, falls far below)
    rate = [n / (rec["last_finish_wall"] - rec["first_admit_wall"]) for n, rec in zip(served, recs, strict=True)]
    assert rate[1] >= 0.5 * rate[0], f"GPU 1 idled while GPU 0 had a backlog: {served} requests, {rate} per second"
    assert fleet.stats().get(f"succeeded:{fleet.queue(0)}") == 300  # accounted to the queue they came from
