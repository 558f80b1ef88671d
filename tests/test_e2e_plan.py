"""The prefix plan with real parts: `producer enqueue` (the plan), `producer head` feeding, real `rq worker`s
each with a simulated SGLang server over HTTP (its radix cache is 0.5.23's), a real redis-server. What
each server ran is read from its simulator's own record of requests (`SGLANG_SIM_RECORD_REQUESTS`)."""

from __future__ import annotations

import os
import random
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchfleet.jobs import job_id_for

from .fleet import Fleet, text_of

pytestmark = pytest.mark.slow

VOCAB = [f"w{i}" for i in range(300)]


def docqa(path: Path, docs: int, questions: int, *, words: int = 400, seed: int = 1, max_tokens: int = 16,
          changed: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """`docs` documents of `words` words, `questions` questions each, shuffled; line `d{d}q{q}`."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(VOCAB) for _ in range(words)) for _ in range(docs)]
    rows = []
    for d in range(docs):
        for q in range(questions):
            cid = f"d{d}q{q}"
            question = (changed or {}).get(cid, f"what is said of item {q}?")
            rows.append({"id": cid, "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "user", "content": f"{texts[d]}\n\nQuestion: {question}"}]})
    random.Random(seed + 1).shuffle(rows)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return rows


def served(fleet: Fleet, rows: list[dict[str, Any]], gpus: range) -> dict[str, list[int]]:
    """custom_id -> the GPUs whose server got a request of it (each attempt), from the simulators' records."""
    by_jid = {job_id_for(fleet.run, r["id"]): r["id"] for r in rows}
    out: dict[str, list[int]] = defaultdict(list)
    for g in gpus:
        for rid, *_ in fleet.sim_record(g).get("requests", []):
            jid = rid.rsplit("-", 2)[0]
            if jid in by_jid:
                out[by_jid[jid]].append(g)
    return out


def export(fleet: Fleet, name: str = "results.jsonl") -> list[dict[str, Any]]:
    out = fleet.tmp / name
    fleet.producer("export", str(out))
    return [orjson.loads(x) for x in out.read_bytes().splitlines()]


def expected(row: dict[str, Any]) -> str:
    from sglang_sim.textgen import expected_completion, render_chat

    return expected_completion(render_chat(row["messages"]), {"max_new_tokens": row["max_tokens"],
                                                              "ignore_eos": True})[0]


def check_export(fleet: Fleet, rows: list[dict[str, Any]], name: str = "results.jsonl") -> None:
    lines = export(fleet, name)
    assert sorted(x["custom_id"] for x in lines) == sorted(r["id"] for r in rows)  # each exactly once
    by_id = {x["custom_id"]: x for x in lines}
    for r in rows:
        line = by_id[r["id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert text_of(line["response"]["body"]) == expected(r)


ENV = {"SGLANG_SIM_PROFILE": "tiny-plain", "SGLANG_SIM_RECORD_REQUESTS": "1", "SGLANG_SIM_TIME_SCALE": "10"}


def test_each_documents_questions_run_on_one_server_and_reuse_its_prefill(fleets) -> None:
    # No stealing here (a queue pattern no other queue matches): where a unit is fed is where it runs.
    fleet = fleets(run="plan1", prefix="plan1.", gpus=2, env={**ENV, "BATCHFLEET_QUEUE_PATTERN": "none"})
    rows = docqa(fleet.tmp / "in.jsonl", docs=10, questions=6)
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress")
    for g in range(2):
        fleet.start_worker(g)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 180, "every prompt")
    # the workers add what their servers counted at their next status beat
    fleet.wait_for(lambda: fleet.stats().get("cached_tokens", 0) >= 10 * 5 * 380, 30, "the servers' cache counts")
    assert fleet.stop_all() == {0: 0, 1: 0}
    where = served(fleet, rows, range(2))
    assert sorted(where) == sorted(r["id"] for r in rows) and all(len(v) == 1 for v in where.values())
    servers_of_doc = defaultdict(set)
    for cid, gpus in where.items():
        servers_of_doc[cid.split("q")[0]].update(gpus)
    assert all(len(s) == 1 for s in servers_of_doc.values()), dict(servers_of_doc)  # a document, one server
    assert {g for s in servers_of_doc.values() for g in s} == {0, 1}  # and both servers worked
    # what the servers counted: at least all but the first question of each document came from the cache
    stats = fleet.stats()
    assert stats["plan_shared:" + fleet.queue(0)] > 0 and stats["plan_bytes:" + fleet.queue(1)] > 0
    check_export(fleet, rows)
    status = orjson.loads(fleet.producer("status", "--json").stdout)
    assert status["cache_hit_rate"] > 0.6 and status["predicted_hit_rate"] > 0.6
    assert status["prefill_tokens_saved"] == stats["cached_tokens"]


def test_a_killed_workers_documents_move_whole_and_every_prompt_runs_exactly_once(fleets) -> None:
    # Three servers, four prompts in flight each (a document's four questions are one unit); gpu2's worker
    # is killed while it serves. Its queue's units, and what it had in flight (recovered when its leases
    # lapse), are taken by the two others from the queue's tail, whole: no document is split between them.
    fleet = fleets(run="plan2", prefix="plan2.", gpus=3,
                   env={**ENV, "SGLANG_SIM_TIME_SCALE": "1", "BATCHFLEET_LEASE_TTL_S": "3",
                        "BATCHFLEET_MAX_IN_FLIGHT": "4", "BATCHFLEET_WINDOW_DEFAULT": "200"})
    rows = docqa(fleet.tmp / "in.jsonl", docs=12, questions=4, max_tokens=64)
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress")
    victim = None
    for g in range(3):
        w = fleet.start_worker(g)
        victim = w if g == 2 else victim
    fleet.start_head()
    assert victim is not None
    def requests_of(g: int) -> int:
        path = fleet.record_path(g)
        return len(orjson.loads(path.read_bytes()).get("requests", [])) if path.exists() else 0

    fleet.wait_for(lambda: requests_of(2) >= 4, 120, "gpu2 serving its first unit")
    os.kill(victim.pid, signal.SIGKILL)  # its server dies with it; its leases lapse on Redis's clock
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 180, "every prompt after the kill")
    fleet.stop_all()
    where = served(fleet, rows, range(3))
    assert sorted(where) == sorted(r["id"] for r in rows)
    survivors_of_doc: dict[str, set[int]] = defaultdict(set)
    on_gpu2 = set()
    for cid, gpus in where.items():
        doc = cid.split("q")[0]
        survivors_of_doc[doc].update(g for g in gpus if g != 2)
        if 2 in gpus:
            on_gpu2.add(doc)
    moved = {doc: s for doc, s in survivors_of_doc.items() if doc in on_gpu2 and s}
    assert moved, "no document of the killed worker moved"
    assert all(len(s) == 1 for s in survivors_of_doc.values()), dict(survivors_of_doc)  # none split
    assert fleet.stats().get("recovered", 0) >= 1
    check_export(fleet, rows)


def test_the_export_is_exact_after_the_head_is_killed_and_a_rerun_of_changed_prompts(fleets) -> None:
    fleet = fleets(run="plan3", prefix="plan3.", gpus=2, env=ENV)
    rows = docqa(fleet.tmp / "in.jsonl", docs=8, questions=4)
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues, "--no-progress")
    for g in range(2):
        fleet.start_worker(g)
    head = fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 8, 120, "some results")
    os.kill(head.pid, signal.SIGKILL)  # resume: a new head carries on from the store's plan
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 180, "every prompt")
    check_export(fleet, rows)
    # Change four questions: only those run again, with their new request, through a plan built anew
    changed = {f"d{d}q0": "what is said of the end?" for d in range(4)}
    new_rows = docqa(fleet.tmp / "in.jsonl", docs=8, questions=4, changed=changed)
    fleet.producer("enqueue", "in.jsonl", "--rerun-changed", "--no-progress")
    fleet.wait_for(lambda: fleet.finished() >= len(rows) + 4, 180, "the changed prompts")
    fleet.stop_all()
    check_export(fleet, new_rows, "again.jsonl")
