"""Where two hosts' clocks would meet, Redis's clock decides: status freshness (its key's TTL, see
test_producer_collect.test_status_json), the order of two results for one prompt, event times,
the supervisor's snapshot times. Each test writes records stamped by a host whose clock is a day off."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import Keys
from batchfleet.records import Event, Result
from supervisor.fleet import read_fleet
from supervisor.prom import FleetMetrics

from .test_producer_helpers import RUN, Cli, job_prompt, make_cli, queued_ids, simple, write_jsonl

DAY = 86_400.0


def redis_now(r: redis.Redis) -> float:
    s, us = r.time()
    return s + us / 1e6


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def test_the_later_result_wins_whatever_its_hosts_clock(cli: Cli, r: redis.Redis, tmp_path: Path):
    # A prompt fails on host A (clock a day ahead); `rq requeue`; it fails again on host B with
    # another reason. The export must say B's reason: B's result reached Redis last.
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(1))), "--no-progress")[0] == 0
    (jid,) = queued_ids(r, "gpu0")
    p = job_prompt(r, jid)
    keys = Keys(RUN)
    for message, clock in (("on host A", time.time() + DAY), ("on host B", time.time())):
        res = Result(cid=p.cid, jid=jid, seq=p.seq, status_code=500, error={"code": "x", "message": message},
                     finished_at=clock)
        r.xadd(keys.results, {"r": res.to_json()})
        r.sadd(keys.done, jid)
        assert cli("collect")[0] == 0  # each in its own pass, as a collector running all along would
    out = tmp_path / "out.jsonl"
    cli("export", str(out))
    (line,) = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert line["response"]["body"] == {"error": {"message": "on host B"}}


def test_events_and_snapshots_are_timed_by_redis(r: redis.Redis):
    k = Keys(RUN)
    metrics = FleetMetrics()
    # A worker whose clock is a day ahead restarts its server; the supervisor logs a decision.
    log = lambda e: r.xadd(k.events, {"e": e.to_json()})  # noqa: E731
    log(Event(kind="restarted", message="gpu0", source="hosta.gpu0.1", ts=time.time() + DAY))
    snap = read_fleet(r, k)
    metrics.update(snap, None, _state())
    log(Event(kind="decision", message="canary", source="supervisor"))
    log(Event(kind="restarted", message="gpu1", source="hostb.gpu1.2", ts=time.time() - DAY))
    snap = read_fleet(r, k)
    metrics.update(snap, None, _state())

    now = redis_now(r)
    assert abs(snap.ts - now) < 5
    assert [e.message for e in snap.events] == ["gpu0", "canary", "gpu1"]  # the order Redis saw them in
    assert all(abs(e.ts - now) < 5 for e in snap.events)
    assert [e.ts for e in snap.events] == sorted(e.ts for e in snap.events)
    # Every event counted once, although one host's clock was ahead of everybody's.
    counts = {s.labels["kind"]: s.value for m in metrics.registry.collect() for s in m.samples
              if s.name == "batchfleet_events_total"}
    assert counts == {"restarted": 2.0, "decision": 1.0}


def _state():
    from supervisor.autopilot import PilotState

    return PilotState()
