"""The surplus a worker keeps waiting inside its server (issue 11 §4): sized from turnover, on top of
the capacity, never when the configuration caps below the server, and handed back untouched on a
drain. Real Redis; the server is an in-process one with a capacity and a FIFO queue."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import orjson
import redis.asyncio as aioredis
from rq import Queue

from batchfleet.config import Config
from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys
from worker.dispatcher import Dispatcher
from worker.ledger import Ledger
from worker.slots import Slots, Turnover, surplus_cap

from .fakeserver import FakeServer, dispatcher
from .test_worker_dispatch import enqueue, results


def test_turnover_sizes_the_surplus_from_bursts_of_finishes_within_a_round_trip() -> None:
    t = Turnover()
    assert t.surplus(0.0, 8) == 8  # nothing measured yet: the initial surplus is the bound (issue 22 §3)
    t.refilled(0.005)  # round trip = 2 x 5 ms
    for step in range(400):  # a decode step every 30 ms ends 5 requests at once, from t=1 to t=13
        for _ in range(5):
            t.finished(1.0 + step * 0.03)
        if step == 20:
            assert t.surplus(1.6, 8) == 8  # less than a horizon measured: still the initial surplus
    assert t.surplus(13.0, 8) == 6
    assert t.surplus(13.0, 4) == 4  # never past the cap
    assert t.surplus(40.0, 8) == 1  # forgotten after the horizon


def test_the_claim_loop_gathers_until_half_the_surplus_is_used_or_the_time_is_up() -> None:
    """`Slots.wait_free`: wakes on the release that frees the n-th slot (not on each release before),
    or when the time is up; a waiter for one slot is still woken by the first release."""

    async def go() -> None:
        loop = asyncio.get_running_loop()
        slots = Slots(10)
        await slots.acquire_up_to(10)
        gatherer = asyncio.create_task(slots.wait_free(3, 5.0))
        one = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        slots.release()
        await asyncio.sleep(0)
        assert one.done() and not gatherer.done()  # 1 free: the single waiter took it; 0 left
        slots.release()
        slots.release()
        await asyncio.sleep(0)
        assert not gatherer.done()  # 2 free
        slots.release()
        await asyncio.wait_for(gatherer, 1)  # 3 free: at once, not after 5 s
        t0 = loop.time()
        await slots.wait_free(5, 0.05)  # 3 free, 5 asked: the time runs out
        assert 0.04 <= loop.time() - t0 < 1.0 and slots.free == 3 and slots.waiting == 0

    asyncio.run(go())


def test_surplus_cap() -> None:
    assert surplus_cap(12, None) == 12 and surplus_cap(1, None) == 1 and surplus_cap(0, None) == 0
    assert surplus_cap(12, 5) == 5 and surplus_cap(4, 9) == 4 and surplus_cap(12, 0) == 0


class QueueingServer(FakeServer):
    """Runs at most `cap` prompts at once; the rest wait in its FIFO queue. A running prompt finishes
    when `finish` is set; a waiting one that is cancelled (its client left) never runs. It names each
    prompt by its custom_id (`enqueue` gives c<i> the prompt p<i>)."""

    def __init__(self, cap: int) -> None:
        super().__init__(self._answer)
        self.cap = cap
        self.sem = asyncio.Semaphore(cap)
        self.finish = asyncio.Event()
        self.waiting: list[str] = []
        self.ran: list[str] = []
        self.peak_in = 0
        self.inside = 0

    async def _answer(self, body: dict) -> dict:
        cid = "c" + body["prompt"][1:]
        self.inside += 1
        self.peak_in = max(self.peak_in, self.inside)
        self.waiting.append(cid)
        try:
            async with self.sem:
                self.waiting.remove(cid)
                self.ran.append(cid)
                await self.finish.wait()
                return {"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}
        finally:
            self.inside -= 1
            if cid in self.waiting:
                self.waiting.remove(cid)


def test_a_drain_hands_the_surplus_back_untouched_and_lets_the_running_finish(r, redis_url) -> None:
    enqueue(r, 10)
    k = Keys("t")

    async def go() -> tuple[Dispatcher, QueueingServer, int]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        server = QueueingServer(cap=4)
        d = dispatcher(ledger, server, Config(run="t", surplus=2))
        d.limit.set_capacity(4)
        assert (d.limit.capacity, d.limit.surplus, d.limit.slots.capacity) == (4, 2, 6)
        # The claim loop asks for a slot when none is free: it has taken all the slots it may (4 more
        # prompts wait in the queue), and once every prompt it took is inside the server, the server
        # holds all the loop will send it.
        parked = asyncio.Event()
        slots = d.limit.slots
        real_wait = slots.wait_one_free

        async def wait_one_free() -> None:
            if slots.free == 0:
                parked.set()
            await real_wait()

        slots.wait_one_free = wait_one_free  # type: ignore[method-assign]
        d.gate.resume()
        flusher = asyncio.create_task(ledger.run_flusher())
        claiming = asyncio.create_task(d.run())
        await parked.wait()
        while server.inside < slots.in_use:
            await asyncio.sleep(0.01)
        assert server.inside == 6 and len(server.waiting) == 2  # never more than capacity + surplus
        queued_in_server = list(server.waiting)
        draining = asyncio.create_task(d.takeback.drain(30))
        while d.tally.handed_back < 2:
            await asyncio.sleep(0.01)
        server.finish.set()  # the four running ones finish within the grace
        handed = await draining
        claiming.cancel()
        await asyncio.gather(claiming, return_exceptions=True)
        ledger.close()
        await flusher
        await client.aclose()
        assert sorted(queued_in_server) == sorted(c for c in (f"c{i}" for i in range(6)) if c not in server.ran)
        return d, server, handed

    d, server, handed = asyncio.run(asyncio.wait_for(go(), 60))
    assert handed == 2 and d.tally.done == 4 and server.peak_in == 6
    assert sorted(results(r)) == sorted(server.ran) and len(server.ran) == 4
    # The surplus is back at the front of its queue, untouched: queued, no strike, no result.
    back = [c for c in (f"c{i}" for i in range(6)) if c not in server.ran]
    queue = Queue("gpu0", connection=r).get_job_ids()
    assert sorted(queue[:2]) == sorted(job_id_for("t", c) for c in back) and len(queue) == 6
    for c in back:
        jid = job_id_for("t", c)
        assert r.hget(Keys.job(jid), "status") == b"queued"
        assert not r.hexists(k.strikes, jid)
    assert int(r.hget(k.stats, "handed_back")) == 2


def test_no_surplus_under_a_configured_cap_or_when_switched_off(r, redis_url) -> None:
    async def go() -> list[tuple[int, int, int]]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys("t"), worker="w", lease_ttl_s=15)
        out = []
        for config, cap in ((Config(run="t"), None), (Config(run="t", surplus=0), None), (Config(run="t"), 5)):
            d = dispatcher(ledger, QueueingServer(12), config)
            d.limit.set_capacity(12, max_in_flight=cap)
            out.append((d.limit.capacity, d.limit.surplus, d.limit.slots.capacity))
        await client.aclose()
        return out

    assert asyncio.run(go()) == [(12, 12, 24), (12, 0, 12), (5, 0, 5)]  # the initial surplus: the bound


def test_the_first_claim_fills_the_capacity_plus_the_initial_surplus(fleets, tmp_path) -> None:
    """Issue 22 §3, on real parts (an `rq worker`, a simulated server of 12 slots, Redis): the worker's
    first claim takes capacity + surplus at once, so the server runs its 12 from its first step with 12
    more waiting in its queue, before anything finished (256-token generations at time scale 1: ~5 s
    each). Before, the first claim took capacity + 1 and the surplus grew one or two at a time."""
    from .fleet import write_prompts

    fleet = fleets(gpus=1, env={"SGLANG_SIM_TIME_SCALE": "1"})
    # every generation runs its 256 tokens (no early end of sequence: some would end after 17), so none
    # finishes, and none is claimed in its place, while the checks below read the first claim
    write_prompts(tmp_path / "p.jsonl", 60, max_tokens=256, ignore_eos=True)
    fleet.producer("enqueue", "p.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.wait_for(lambda: any(s.in_flight for s in fleet.statuses()), 60, "the worker's first claim")
    (status,) = fleet.statuses()
    assert (status.effective_max, status.surplus, status.slots) == (12, 12, 24)
    assert status.in_flight == 24 and fleet.r.zcard(fleet.k.leases) == 24  # what the first claim took
    fleet.wait_for(lambda: fleet.record_path(0).exists() and fleet.sim_record(0)["requests_total"] >= 24, 30,
                   "the simulator's record of 24 requests")
    rec = fleet.sim_record(0)
    assert fleet.finished() == 0 and rec["requests_total"] == 24  # nothing finished yet, nothing claimed since
    assert rec["peak_running"] == 12 and rec["peak_queued"] == 12
    fleet.stop_all()


def test_a_worker_starts_on_the_fleets_memory_for_the_kind_its_last_server_was(r, redis_url, tmp_path) -> None:
    """Issue 22 §4, worker side (real Redis): a worker whose state dir says what kind of server its last
    start ran (model, GPU, SGLang version, shape, with the same configuration) starts on the spec the
    fleet's memory holds for that kind: no restart. Not with --fresh-start (the control hash's `fresh`),
    not with another configuration, and a spec in the control hash always wins."""
    from batchfleet.records import ServerFacts, ServerSpec, WorkerStatus
    from worker.events import EventLog
    from worker.spec import SpecFollower

    field = Keys.memory_field("m/27b", "NVIDIA RTX PRO 6000", 97887, "0.5.23", "tp1")
    nb = ServerSpec(strategy="no_buffer", mem_fraction_static=0.9, max_running_requests=128)
    r.hset(Keys.MEMORY, field, orjson.dumps({"spec": orjson.loads(nb.to_json()), "run": "yesterday"}))
    k = Keys("today")

    async def desired(config: Config, *, note: bool = False) -> ServerSpec:
        client = aioredis.from_url(redis_url)
        follower = SpecFollower(config, client, k, worker="w", queue="today.gpu0", gpu=0,
                                events=EventLog(client, k, source="w", clock=time.time), current=lambda: None)
        spec = await follower.desired()
        if note:  # what the worker publishes once its server serves
            follower.note_kind(WorkerStatus(worker="w", host="h", queue="yesterday.gpu0", gpu=0, state="serving",
                                            server_flags=["--model-path", "m/27b", "--port", "1"], shape="tp1",
                                            gpu_name="NVIDIA RTX PRO 6000", gpu_memory_mib=97887,
                                            facts=ServerFacts(version="0.5.23")))
        await client.aclose()
        return spec

    config = Config(run="today", model_path="m/27b", state_dir=tmp_path / "state")
    (tmp_path / "state").mkdir()
    assert asyncio.run(desired(config)) == ServerSpec()  # this host never ran one: its configuration
    assert asyncio.run(desired(config, note=True)) == ServerSpec()  # then its server says what it is
    assert json.loads((tmp_path / "state" / "kind-gpu0.json").read_text())["field"] == field
    assert asyncio.run(desired(config)) == nb  # the next worker of this host: the memory, generation 0
    assert asyncio.run(desired(replace(config, server_args="--tp-size 2"))) == ServerSpec()  # another config
    r.hset(k.control, Keys.CONTROL_FRESH, b"1")
    assert asyncio.run(desired(config)) == ServerSpec()  # --fresh-start
    r.hdel(k.control, Keys.CONTROL_FRESH)
    r.hset(k.control, Keys.CONTROL_FLEET, ServerSpec(generation=3, strategy="no_radix").to_json())
    assert asyncio.run(desired(config)).generation == 3  # the supervisor's word wins
