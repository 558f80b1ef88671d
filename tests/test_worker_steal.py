"""How much a worker takes from other GPUs' queues (worker/steal.py, worker/lua/claim.lua), against a real
Redis: nothing from a queue whose worker is starting, at most half a claim from one whose worker serves
(or has not said anything yet), all it needs from one whose worker is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.fleetview import SILENT_AFTER_S
from batchfleet.keys import RQ_QUEUES, STATUS_TTL_S, Keys
from batchfleet.records import WorkerStatus
from worker.ledger import Ledger
from worker.steal import ClaimOrder, StealOrder

from .fleet import write_prompts

K = Keys("st")


def queue_jobs(r: redis.Redis, queue: str, n: int) -> None:
    jids = [f"{queue}-{i}" for i in range(n)]
    for jid in jids:
        r.hset(Keys.job(jid), mapping={"data": "x", "origin": queue, "status": "queued"})
    r.rpush(Keys.queue(queue), *jids)
    r.sadd(RQ_QUEUES, Keys.queue(queue))


def publish(r: redis.Redis, queue: str, state: str, *, age_s: float = 0.0, slots: int = 3) -> None:
    """The status record of `queue`'s worker, as a worker writes it, `age_s` seconds ago."""
    ws = WorkerStatus(worker=f"w-{queue}", host="h", queue=queue, gpu=0, state=state,  # type: ignore[arg-type]
                      slots=slots)
    r.set(K.status(ws.worker), ws.to_json(), px=int((STATUS_TTL_S - age_s) * 1000))
    r.sadd(K.workers, ws.worker)


def order_of(redis_url: str) -> ClaimOrder:
    async def read() -> ClaimOrder:
        client = aioredis.from_url(redis_url)
        try:
            return await StealOrder(client, K, queue="g0", pattern=r"g\d", period_s=1).refresh()
        finally:
            await client.aclose()

    return asyncio.run(read())


def claim(redis_url: str, n: int, order: ClaimOrder) -> list[str]:
    async def take() -> list[str]:
        client = aioredis.from_url(redis_url)
        try:
            ledger = Ledger(client, K, worker="thief", lease_ttl_s=15)
            return [c.jid for c in await ledger.claim(n, order.queues, keep=order.keep)]
        finally:
            await client.aclose()

    return asyncio.run(take())


def test_a_thief_leaves_a_starting_server_its_queue_halves_a_serving_ones_and_takes_a_gone_ones(
        r: redis.Redis, redis_url: str) -> None:
    for q, n in (("g1", 10), ("g2", 11), ("g3", 12), ("g4", 13), ("g5", 14), ("g6", 15)):
        queue_jobs(r, q, n)
    publish(r, "g1", "starting")  # up in a moment: its queue is its own
    publish(r, "g2", "serving")
    publish(r, "g3", "failed")  # takes no work
    publish(r, "g4", "serving", age_s=SILENT_AFTER_S + 5)  # silent: gone
    # g5: no record yet (a worker not yet started, or none): as one that serves
    publish(r, "g6", "draining")  # hands back and stops
    order = order_of(redis_url)
    assert order.queues[0] == "g0" and set(order.queues[1:]) == {"g2", "g3", "g4", "g5", "g6"}
    assert order.keep == {"g2": 3, "g5": 0}  # g2's worker runs 3 at once (its record's slots)
    taken = claim(redis_url, 1000, order)
    by_queue = {q: sum(1 for j in taken if j.startswith(f"{q}-")) for q in ("g1", "g2", "g3", "g4", "g5", "g6")}
    # g2: half of what its worker will not start at once (11 - 3 = 8); g5: half of all
    assert by_queue == {"g1": 0, "g2": 4, "g3": 12, "g4": 13, "g5": 7, "g6": 15}
    assert r.llen(Keys.queue("g1")) == 10 and r.llen(Keys.queue("g2")) == 7 and r.llen(Keys.queue("g5")) == 7


def test_a_thief_leaves_a_serving_worker_one_load_and_takes_half_of_the_rest_a_claim(
        r: redis.Redis, redis_url: str) -> None:
    queue_jobs(r, "g1", 9)
    publish(r, "g1", "serving", slots=4)
    order = order_of(redis_url)
    assert order.keep == {"g1": 4}
    assert [len(claim(redis_url, 10, order)) for _ in range(4)] == [3, 1, 1, 0]  # half the rest, rounded up
    assert r.llen(Keys.queue("g1")) == 4  # what its worker starts at once


@pytest.mark.slow
def test_a_short_job_on_many_slot_servers_is_served_by_every_server_not_the_first_one_up(fleets,
                                                                                      tmp_path: Path) -> None:
    """Real parts: 4 `rq worker`s started together, each owning a dense 8B server of 2,048 slots, and a
    job of 800 short prompts (200 in each queue) that one such server could hold whole. Before, the
    first worker whose server was up took every queue (its slots held them all) and the three others
    ran nothing; now a starting worker's queue is left to it, and each server runs its share."""
    fleet = fleets(gpus=4, env={"SGLANG_SIM_PROFILE": "llama-8b-a100", "SGLANG_SIM_TIME_SCALE": "4",
                                "BATCHFLEET_MODEL_PATH": "meta-llama/Llama-3.1-8B-Instruct"})
    write_prompts(tmp_path / "p.jsonl", 800, max_tokens=64)
    fleet.producer("enqueue", "p.jsonl", "--queues", fleet.queues, "--no-plan")
    for g in range(4):
        fleet.start_worker(g)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= 800, 240, "all 800 prompts")
    assert fleet.stop_all()[1] == 0
    ran = [fleet.sim_record(g)["requests_total"] for g in range(4)]
    # 200 each when all start at once; a loaded machine may start one late, and the others take half its
    # queue while it has said nothing yet: never all of it
    assert sum(ran) == 800 and min(ran) >= 50, ran
    assert fleet.stats()["succeeded"] == 800
