"""The dispatcher against a real Redis and an in-process server (`tests.fakeserver`): exact
concurrency, retries, permanent failures, refused jobs, server deaths, drains."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from rq import Queue
from rq.registry import FailedJobRegistry

from batchfleet.config import Config
from batchfleet.errors import PromptError, RetryableError
from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys
from batchfleet.records import Result
from batchfleet.serializer import OrjsonSerializer
from worker.dispatcher import Dispatcher
from worker.ledger import Ledger

from .fakeserver import FakeServer, dispatcher


def enqueue(r, n: int, func: str = "batchfleet.jobs.generate", queue: str = "gpu0", run: str = "t",
            start: int = 0) -> list[str]:
    """Jobs as RQ's own API writes them (zlib JSON), shaped as `producer enqueue` shapes them: the
    run, and the job id its run and custom_id give."""
    q = Queue(queue, connection=r, serializer=OrjsonSerializer)
    return [q.enqueue(func, {"cid": f"c{i}", "seq": i, "url": "/v1/completions", "body": {"prompt": f"p{i}"},
                             "run": run}, result_ttl=0, job_id=job_id_for(run, f"c{i}")).id
            for i in range(start, start + n)]


class Backend:
    """What the server answers, per prompt text (`p<i>` is the prompt of custom_id `c<i>`): counts
    concurrency, records when each request came, and fails some prompts on purpose."""

    def __init__(self, delay_s: float = 0.01, transient: dict[str, int] | None = None,
                 permanent: set[str] | None = None) -> None:
        self.delay_s = delay_s
        self.transient = dict(transient or {})
        self.permanent = permanent or set()
        self.running = 0
        self.peak = 0
        self.calls: list[str] = []
        self.times: dict[str, list[float]] = {}

    async def __call__(self, body: dict) -> dict:
        prompt = body["prompt"]
        self.calls.append(prompt)
        self.times.setdefault(prompt, []).append(time.monotonic())
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            if self.transient.get(prompt, 0) > 0:
                self.transient[prompt] -= 1
                raise RetryableError("HTTP 503: The request queue is full.", status_code=503)
            if prompt in self.permanent:
                raise PromptError("HTTP 400: The input (9000 tokens) is longer than the model's context length "
                                  "(4096 tokens).", status_code=400)
            return {"choices": [{"text": prompt.upper()}], "usage": {"completion_tokens": 3}}
        finally:
            self.running -= 1


def run_burst(redis_url: str, backend: Backend, capacity: int, **config) -> Dispatcher:
    async def go() -> Dispatcher:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys("t"), worker="w", lease_ttl_s=15)
        d = dispatcher(ledger, FakeServer(backend), Config(run="t", surplus=0, **config), capacity=capacity)
        flusher = asyncio.create_task(ledger.run_flusher())
        await d.run(burst=True)
        await d.takeback.drain(5)
        ledger.close()
        await flusher
        await client.aclose()
        return d

    return asyncio.run(go())


def results(r) -> dict[str, Result]:
    return {res.cid: res for res in (Result.from_json(f[b"r"]) for _, f in r.xrange(Keys("t").results))}


def test_exactly_capacity_in_flight(r, redis_url):
    enqueue(r, 200)
    backend = Backend(delay_s=0.02)
    d = run_burst(redis_url, backend, capacity=13)
    assert backend.peak == 13
    assert d.tally.done == 200
    got = results(r)
    assert len(got) == 200 and got["c5"].body["choices"][0]["text"] == "P5"
    assert Queue("gpu0", connection=r).count == 0


def test_transient_errors_retry_with_backoff_then_succeed_or_fail(r, redis_url):
    enqueue(r, 3)
    backend = Backend(transient={"p0": 2, "p1": 99})
    run_burst(redis_url, backend, capacity=2, max_attempts=4, backoff_base_s=0.2, backoff_max_s=0.4)
    got = results(r)
    assert got["c0"].ok and got["c0"].attempts == 3
    assert not got["c1"].ok and got["c1"].error["code"] == "retries_exhausted" and got["c1"].attempts == 4
    assert got["c2"].ok and got["c2"].attempts == 1
    assert backend.calls.count("p1") == 4
    # capped exponential backoff with jitter between attempts: 0.1-0.2, 0.2-0.4, then capped at 0.4 (the
    # server's own answer takes delay_s); the waits are seen from the server, as the gaps between requests
    gaps = [b - a - backend.delay_s for a, b in zip(backend.times["p1"], backend.times["p1"][1:], strict=False)]
    assert len(gaps) == 3 and gaps[0] >= 0.1 - 0.01 and gaps[1] >= 0.2 - 0.01 and gaps[2] >= 0.2 - 0.01


def test_permanent_error_fails_once_with_the_servers_reason(r, redis_url):
    ids = enqueue(r, 3)
    backend = Backend(permanent={"p1"})
    run_burst(redis_url, backend, capacity=3)
    got = results(r)
    assert backend.calls.count("p1") == 1
    assert got["c1"].error == {"code": "invalid_prompt", "message": "HTTP 400: The input (9000 tokens) is longer "
                               "than the model's context length (4096 tokens)."}
    assert got["c1"].status_code == 400
    assert FailedJobRegistry("gpu0", connection=r).get_job_ids() == [ids[1]]


def test_job_naming_another_function_is_refused_and_never_run(r, redis_url):
    (bad,) = enqueue(r, 1, func="platform.node", start=1)
    enqueue(r, 1)
    backend = Backend()
    run_burst(redis_url, backend, capacity=2)
    assert backend.calls == ["p0"]  # only the allowed job reached the server
    assert FailedJobRegistry("gpu0", connection=r).get_job_ids() == [bad]
    # Refused: RQ's failed registry says why; no result, so it never becomes an export line.
    exc_info = r.hget(Keys.job(bad), "exc_info").decode()
    assert exc_info.startswith("refused: ") and "platform.node" in exc_info
    assert list(results(r)) == ["c0"]
    assert int(r.hget(Keys("t").stats, "refused")) == 1


def test_a_job_of_another_run_is_refused_loudly_not_misfiled(r, redis_url):
    (other,) = enqueue(r, 1, run="someone-else")
    q = Queue("gpu0", connection=r, serializer=OrjsonSerializer)
    mine = q.enqueue("batchfleet.jobs.generate", {"cid": "y", "seq": 1, "url": "/v1/completions",
                                                  "body": {"prompt": "p"}, "run": "t"}, result_ttl=0,
                     job_id=job_id_for("t", "y"))
    backend = Backend()
    run_burst(redis_url, backend, capacity=2)
    assert backend.calls == ["p"]
    assert FailedJobRegistry("gpu0", connection=r).get_job_ids() == [other]
    assert not r.exists(f"rq:job:{mine.id}")
    assert "run 'someone-else'" in r.hget(Keys.job(other), "exc_info").decode()
    assert list(results(r)) == ["y"]


def test_a_server_death_strikes_only_the_prompts_inside_it(r, redis_url):
    """c0, c1: sent, no answer yet (inside the server when it dies); c2: answered 503, waiting to retry;
    c3: never reached it (connection refused). Only c0 and c1 get a strike."""
    from batchfleet.http1 import ConnectFailed

    enqueue(r, 4)
    k = Keys("t")

    class Dying:
        def __init__(self) -> None:
            self.started: set[str] = set()

        async def __call__(self, body: dict) -> dict:
            self.started.add(body["prompt"])
            if body["prompt"] == "p2":
                raise RetryableError("HTTP 503: The request queue is full.", status_code=503)
            if body["prompt"] == "p3":
                try:
                    raise ConnectFailed("cannot connect to 127.0.0.1:9: connection refused")
                except ConnectFailed as exc:
                    raise RetryableError(f"ConnectFailed: {exc}") from exc
            await asyncio.Event().wait()  # inside the server until it dies
            raise AssertionError("unreachable")

    async def go():
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        backend = Dying()
        # c2 waits to retry for as long as the test lasts
        d = dispatcher(ledger, FakeServer(backend), Config(run="t", surplus=0, backoff_base_s=3600, backoff_max_s=3600),
                       capacity=4)
        claiming = asyncio.create_task(d.run())
        while len(backend.started) < 4 or d.limit.slots.in_use > 2:  # c2 and c3 gave their slots back
            await asyncio.sleep(0.01)
        outcome = await d.takeback.server_lost(reason="gpu0: server exited with status 1", log_tail="CUDA error")
        claiming.cancel()
        await asyncio.gather(claiming, return_exceptions=True)
        await client.aclose()
        return d, outcome

    d, outcome = asyncio.run(go())
    ids = {f"c{i}": job_id_for("t", f"c{i}") for i in range(4)}
    assert (outcome.struck, outcome.handed_back, outcome.quarantined) == (2, 2, [])
    assert (d.tally.struck, d.tally.handed_back, d.in_flight) == (2, 2, 0)
    assert sorted(r.lrange(k.suspects, 0, -1)) == sorted([ids["c0"].encode(), ids["c1"].encode()])
    assert sorted(r.lrange("rq:queue:gpu0", 0, -1)) == sorted([ids["c2"].encode(), ids["c3"].encode()])
    assert {f.decode(): int(v) for f, v in r.hgetall(k.strikes).items()} == {ids["c0"]: 1, ids["c1"]: 1}
    assert r.zcard(k.leases) == 0 and r.xlen(k.results) == 0


def test_a_failure_message_quoting_a_secret_is_scrubbed_in_the_result_and_the_failed_registry(r, redis_url):
    enqueue(r, 2)

    class Leaky(Backend):
        async def __call__(self, body: dict) -> dict:
            if body["prompt"] == "p1":
                raise PromptError("HTTP 400: bad header Authorization: Bearer sk-leaky-key-123", status_code=400)
            return await super().__call__(body)

    run_burst(redis_url, Leaky(), capacity=2, server_api_key="sk-leaky-key-123")
    got = results(r)
    assert got["c1"].error["message"] == "HTTP 400: bad header Authorization: Bearer ***"
    assert b"sk-leaky-key-123" not in b"".join(v for k in r.keys("*") if r.type(k) == b"hash"
                                               for v in r.hvals(k))


def test_a_server_death_collects_a_prompt_whose_cancellation_was_swallowed(r, redis_url):
    """A backend that swallows the first cancellation (as asyncio.wait_for did on Python 3.11 when a
    reconnect was refused at that moment) then waits for the server to come back. The keeper cannot
    restart the server before `server_lost` returns: without a second cancel, both waited forever
    (a hung server was never restarted)."""
    enqueue(r, 2)
    k = Keys("t")

    class Stubborn:
        def __init__(self) -> None:
            self.started: set[str] = set()
            self.swallowed = 0

        async def __call__(self, body: dict) -> dict:
            self.started.add(body["prompt"])
            try:
                await asyncio.Event().wait()  # inside the server
            except asyncio.CancelledError:
                self.swallowed += 1  # turned into a connection error, as wait_for did
                raise RetryableError("ServerClosed: the connection closed") from None
            raise AssertionError("unreachable")

    async def go():
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        backend = Stubborn()
        server = FakeServer(backend)
        d = dispatcher(ledger, server, Config(run="t", surplus=0), capacity=2)
        claiming = asyncio.create_task(d.run())
        while len(backend.started) < 2:
            await asyncio.sleep(0.01)
        server.up = False  # hung: the keeper kills it, then collects
        outcome = await asyncio.wait_for(d.takeback.server_lost(reason="gpu0: hung; killed", log_tail=""), 20)
        claiming.cancel()
        await asyncio.gather(claiming, return_exceptions=True)
        await client.aclose()
        return d, outcome, backend

    d, outcome, backend = asyncio.run(go())
    assert backend.swallowed == 2
    assert d.in_flight == 0
    assert (outcome.struck, outcome.handed_back) == (2, 0)  # both were inside: a strike each
    assert r.llen(k.suspects) == 2 and r.zcard(k.leases) == 0


def test_a_drain_waits_for_a_slow_hand_back_and_counts_it(r, redis_url, caplog):
    """Redis answers slowly while a drain hands back the prompts still in flight (each hand back
    takes 2.5 s here). The collector must wait for those writes, not cancel them again after a
    second: that detached the shielded hand back, the drain returned before it was written, counted
    0 handed back and warned that each task "survived its cancellation"."""
    jids = enqueue(r, 3)
    k = Keys("t")

    class Forever:
        def __init__(self) -> None:
            self.started = 0

        async def __call__(self, body: dict) -> dict:
            self.started += 1
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    async def go():
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        real = ledger.hand_back

        async def slow_hand_back(claims):
            await asyncio.sleep(2.5)
            return await real(claims)

        ledger.hand_back = slow_hand_back  # type: ignore[method-assign]
        backend = Forever()
        d = dispatcher(ledger, FakeServer(backend), Config(run="t", surplus=0), capacity=3)
        claiming = asyncio.create_task(d.run())
        while backend.started < 3:
            await asyncio.sleep(0.01)
        handed = await asyncio.wait_for(d.takeback.drain(0.1), 30)
        queued_at_return = r.llen("rq:queue:gpu0")
        claiming.cancel()
        await asyncio.gather(claiming, return_exceptions=True)
        await client.aclose()
        return d, handed, queued_at_return

    with caplog.at_level("WARNING", logger="batchfleet.worker.dispatcher"):
        d, handed, queued_at_return = asyncio.run(go())
    assert handed == 3 and d.tally.handed_back == 3
    assert queued_at_return == 3  # every hand back was written before the drain returned
    assert sorted(x.decode() for x in r.lrange("rq:queue:gpu0", 0, -1)) == sorted(jids)
    assert r.zcard(k.leases) == 0
    assert not [rec for rec in caplog.records if "survived its cancellation" in rec.getMessage()]


class AnsweringBackend(Backend):
    """Fails c1 as a server does, with its JSON error body (400), and c2 with 503 until retries run out."""

    async def __call__(self, body: dict) -> dict:
        if body["prompt"] == "p1":
            raise PromptError("HTTP 400: too long", status_code=400, body={"object": "error", "message": "too long"})
        if body["prompt"] == "p2":
            raise RetryableError("HTTP 503: full", status_code=503, body={"error": {"message": "full"}})
        return await super().__call__(body)


def test_a_failed_prompts_result_keeps_the_servers_error_body_and_echoes_the_prompts_fingerprint(r, redis_url):
    q = Queue("gpu0", connection=r, serializer=OrjsonSerializer)
    for i in range(3):
        q.enqueue("batchfleet.jobs.generate", {"cid": f"c{i}", "seq": i, "url": "/v1/completions",
                                               "body": {"prompt": f"p{i}"}, "fp": f"{i:032x}", "run": "t"},
                  result_ttl=0, job_id=job_id_for("t", f"c{i}"))
    run_burst(redis_url, AnsweringBackend(), capacity=3, max_attempts=2, backoff_base_s=0.01)
    got = results(r)
    assert [got[f"c{i}"].fp for i in range(3)] == [f"{i:032x}" for i in range(3)]
    assert got["c0"].ok and got["c0"].status_code == 200
    assert (got["c1"].status_code, got["c1"].body) == (400, {"object": "error", "message": "too long"})
    assert (got["c2"].status_code, got["c2"].body, got["c2"].error["code"]) == (503, {"error": {"message": "full"}},
                                                                                 "retries_exhausted")


def test_a_resume_while_a_drain_is_under_way_claims_nothing_until_the_drain_is_over(r, redis_url):
    """A worker told to stop drains while its keeper, finishing a server start, resumes the dispatcher.
    A prompt claimed then is not the drain's: it is neither waited for nor handed back, and runs into
    a server about to stop. The drain holds the claims whatever resumes meanwhile."""
    enqueue(r, 6)
    k = Keys("t")

    async def go() -> tuple[list[str], list[str], int, Dispatcher]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        finish = asyncio.Event()
        started: list[str] = []

        async def backend(body: dict) -> dict:
            started.append(body["prompt"])
            await finish.wait()
            return {"choices": [{"text": "ok"}], "usage": {"completion_tokens": 1}}

        d = dispatcher(ledger, FakeServer(backend), Config(run="t", surplus=0))
        claimed: list[int] = []
        real_claim = ledger.claim

        async def claim(n: int, queues: list[str], **kw: bool) -> list:
            claimed.append(n)
            return await real_claim(n, queues, **kw)

        ledger.claim = claim  # type: ignore[method-assign]
        freed = asyncio.Event()  # the claim loop got a free slot after the in-flight prompts finished
        real_acquire = d.limit.slots.acquire_up_to

        async def acquire_up_to(n: int) -> int:
            took = await real_acquire(n)
            if finish.is_set():
                freed.set()
            return took

        d.limit.slots.acquire_up_to = acquire_up_to  # type: ignore[method-assign]
        d.limit.set_capacity(2)
        d.gate.resume()
        flusher = asyncio.create_task(ledger.run_flusher())
        claiming = asyncio.create_task(d.run())
        while len(started) < 2:
            await asyncio.sleep(0.01)
        claims_before = len(claimed)
        draining = asyncio.create_task(d.takeback.drain(30))
        await asyncio.sleep(0)  # the drain has begun: it waits for the two in flight
        d.gate.resume()  # the keeper's server start, finishing
        finish.set()
        await freed.wait()  # the claim loop has had its free slots (and, if it claims, has asked Redis)
        during = claimed[claims_before:]
        handed = await draining
        started_by_the_drains_end = list(started)
        d.gate.pause()
        while not claiming.done():  # redis-py may swallow a cancel that lands inside a claim
            claiming.cancel()
            await asyncio.wait({claiming}, timeout=1)
        await d.takeback.drain(5)
        ledger.close()
        await flusher
        await client.aclose()
        return during, started_by_the_drains_end, handed, d

    during, started, handed, d = asyncio.run(asyncio.wait_for(go(), 60))
    assert during == [] and started == ["p0", "p1"]
    assert handed == 0 and d.tally.done >= 2


def test_a_drain_hands_back_prompts_whose_tasks_it_cancelled_before_they_ran(r, redis_url):
    """A claim comes back just as a drain begins (a respec, a stop): the drain's surplus hand back picks
    the newest prompts, whose tasks have not run a step yet. A task cancelled before its first step never
    runs its coroutine, so its own hand back and slot release never ran: the lease stayed held and was
    renewed forever (the run never finished: seen in bench_prefix, 1 prompt of 10,000 "in flight" for
    12 minutes on a worker with nothing in flight) and the slot was lost. Every claimed prompt must go
    back to its queue, no lease left, every slot free."""
    jids = enqueue(r, 5)
    k = Keys("t")

    class Forever:
        async def __call__(self, body: dict) -> dict:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    async def go():
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, k, worker="w", lease_ttl_s=15)
        d = dispatcher(ledger, FakeServer(Forever()), Config(run="t", surplus=2), capacity=3)
        real = ledger.claim
        draining: list[asyncio.Task] = []

        async def claim_as_a_drain_begins(*args, **kwargs):
            got = await real(*args, **kwargs)
            if got and not draining:  # the drain's first step runs before the tasks of these claims
                draining.append(asyncio.ensure_future(d.takeback.drain(0.2)))
            return got

        ledger.claim = claim_as_a_drain_begins  # type: ignore[method-assign]
        claiming = asyncio.create_task(d.run())
        while not draining:
            await asyncio.sleep(0.01)
        handed = await asyncio.wait_for(draining[0], 30)
        claiming.cancel()
        await asyncio.gather(claiming, return_exceptions=True)
        free = d.limit.slots.free
        await client.aclose()
        return d, handed, free

    d, handed, free = asyncio.run(go())
    assert sorted(x.decode() for x in r.lrange("rq:queue:gpu0", 0, -1)) == sorted(jids)  # all 5 back, once
    assert r.zcard(k.leases) == 0  # no lease left to renew
    assert handed == 5 and d.tally.handed_back == 5
    assert free == 5 and not d.board.tasks
