"""The worker keeps no more prompts in its server than its KV pool holds (worker/slots.py `KvBound`): a
dense server's slots (its --max-running-requests, a token estimate) are many more than long prompts
can run at once, and a worker that filled them all would take the other servers' work."""

from __future__ import annotations

from pathlib import Path

import orjson

from worker.slots import InFlightLimit, KvBound


def test_the_bound_is_twice_the_kv_pool_over_the_mean_prompt_and_a_probe_before_any() -> None:
    limit = InFlightLimit(None)
    limit.set_capacity(2048, kv_tokens=413_712)
    assert limit.slots.capacity == KvBound.PROBE  # nothing claimed yet: the size of a prompt is unknown
    limit.claimed([14_400] * 10)  # ~3,600 tokens a prompt
    assert limit.slots.capacity == int(2 * 413_712 / 3_600)
    limit.set_capacity(2048, kv_tokens=None)  # a server that did not say: its slots
    assert limit.slots.capacity == 2048 + 2048  # capacity + the initial surplus


def test_short_prompts_are_bound_by_the_slots_alone() -> None:
    limit = InFlightLimit(0)
    limit.set_capacity(37, kv_tokens=1_000_000)
    limit.claimed([400] * 37)
    assert limit.slots.capacity == 37


def test_a_worker_that_starts_first_leaves_the_others_their_long_prompts(fleets, tmp_path: Path) -> None:
    """Real parts: 2 `rq worker`s on a dense 8B profile (2048 slots, 413,712 KV tokens), 320 prompts of
    ~6,000 tokens. The first worker is up alone for a while (the head dealt 160 to each queue); the second then finds
    its queue's work: before, the first took all 320 (its slots hold 4096) and the second's server ran none."""
    fleet = fleets(gpus=2, env={"SGLANG_SIM_PROFILE": "llama-8b-a100", "SGLANG_SIM_TIME_SCALE": "4",
                                "BATCHFLEET_MODEL_PATH": "meta-llama/Llama-3.1-8B-Instruct"})
    words = " ".join(f"w{i % 97}" for i in range(6000))
    rows = [{"id": f"d{i}", "prompt": f"{i} {words}", "max_tokens": 16} for i in range(320)]
    (tmp_path / "p.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    fleet.producer("enqueue", "p.jsonl", "--queues", fleet.queues, "--no-plan")
    fleet.start_worker(0)
    fleet.start_head()
    fleet.wait_for(lambda: any(s.in_flight for s in fleet.statuses()), 60, "the first worker's claim")
    (first,) = fleet.statuses()
    assert first.in_flight <= first.slots < 160  # ~2 x 413,712 / ~6,000 tokens, not 2048 + 2048
    fleet.start_worker(1)
    fleet.wait_for(lambda: fleet.finished() >= 320, 240, "all 320 prompts")
    fleet.stop_all()
    ran = [fleet.sim_record(g)["requests_total"] for g in (0, 1)]
    # the second ran its share: not all 320 (before), nor a handful (a loaded machine may start it late)
    assert sum(ran) == 320 and min(ran) >= 60, ran
