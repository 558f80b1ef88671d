"""The worker's batched Redis bookkeeping against a real Redis, checked through RQ's own API."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis.asyncio as aioredis
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry

from batchfleet.jobs import parse_job_data
from batchfleet.keys import FAILURE_TTL_S, Keys
from batchfleet.records import Result
from batchfleet.serializer import OrjsonSerializer
from worker.ledger import FINISH, Ledger


def enqueue(r, queue: str, n: int) -> list[str]:
    q = Queue(queue, connection=r, serializer=OrjsonSerializer)
    ids = []
    for i in range(n):
        job = q.enqueue("batchfleet.jobs.generate", {"cid": f"c{i}", "seq": i, "url": "/v1/completions",
                                                    "body": {"prompt": f"p{i}"}}, result_ttl=0)
        ids.append(job.id)
    return ids


def run(coro):
    return asyncio.run(coro)


async def _ledger(url: str, lease_ttl_s: float = 15.0) -> Ledger:
    return Ledger(aioredis.from_url(url), Keys("t"), worker="w1", lease_ttl_s=lease_ttl_s)


def test_claim_takes_own_queue_first_then_others(r, redis_url):
    own = enqueue(r, "gpu0", 2)
    other = enqueue(r, "gpu1", 3)

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(4, ["gpu0", "gpu1"])
        return [c.jid for c in claims], [c.origin for c in claims], claims

    jids, origins, claims = run(go())
    assert jids == own + other[:2]
    assert origins == ["gpu0", "gpu0", "gpu1", "gpu1"]
    func, args, _ = parse_job_data(claims[0].data)
    assert func == "batchfleet.jobs.generate" and args[0]["cid"] == "c0"
    # RQ sees them as started, in the registry of the queue they came from.
    assert StartedJobRegistry("gpu0", connection=r).count == 2
    assert StartedJobRegistry("gpu1", connection=r).count == 2
    assert Queue("gpu1", connection=r).count == 1
    assert Job.fetch(own[0], connection=r, serializer=OrjsonSerializer).get_status() == JobStatus.STARTED


MESSAGE = "too long — « 9 000 » tokens; a b\n2 3 gpu0"  # multi-byte, spaces, digits: as packed for the script


def test_finish_success_and_failure(r, redis_url):
    ok_id, bad_id = enqueue(r, "gpu0", 2)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        a, b = await ledger.claim(2, ["gpu0"])
        ledger.finish(a, Result(cid="c0", jid=a.jid, seq=0, status_code=200,
                                body={"usage": {"completion_tokens": 7}}))
        ledger.finish(b, Result(cid="c1", jid=b.jid, seq=1, status_code=400,
                                error={"code": "invalid_prompt", "message": MESSAGE}), f"invalid_prompt: {MESSAGE}")
        await ledger.flush()

    run(go())
    assert not r.exists(Keys.job(ok_id))  # result_ttl=0: the success leaves Redis
    assert StartedJobRegistry("gpu0", connection=r).count == 0
    failed = FailedJobRegistry("gpu0", connection=r)
    assert failed.get_job_ids() == [bad_id]
    job = Job.fetch(bad_id, connection=r, serializer=OrjsonSerializer)
    assert job.get_status() == JobStatus.FAILED
    entries = r.xrange(k.results)
    results = [Result.from_json(fields[b"r"]) for _, fields in entries]
    assert [(x.cid, x.ok) for x in results] == [("c0", True), ("c1", False)]
    assert results[1].error == {"code": "invalid_prompt", "message": MESSAGE}
    assert r.hget(Keys.job(bad_id), "exc_info").decode() == f"invalid_prompt: {MESSAGE}"
    assert r.smembers(k.done) == {ok_id.encode(), bad_id.encode()}
    stats = {kk.decode(): int(v) for kk, v in r.hgetall(k.stats).items()}
    assert stats["succeeded"] == 1 and stats["failed"] == 1 and stats["completion_tokens"] == 7
    assert stats["failed:gpu0"] == 1
    # RQ's own requeue works on our failed job.
    failed.requeue(bad_id)
    assert Queue("gpu0", connection=r).job_ids == [bad_id]


def test_lapsed_lease_is_recovered_and_the_late_finish_is_dropped(r, redis_url):
    (jid,) = enqueue(r, "gpu0", 1)
    k = Keys("t")

    async def go():
        dead = await _ledger(redis_url, lease_ttl_s=0.2)
        (claim,) = await dead.claim(1, ["gpu0"])
        await asyncio.sleep(0.3)
        live = await _ledger(redis_url)
        recovered = await live.recover_lapsed()
        assert recovered == [jid]
        # The job is back at the front of its queue, queued again.
        assert r.lrange(Keys.queue("gpu0"), 0, -1) == [jid.encode()]
        # The stalled worker wakes up and reports: refused, no result published.
        dead.finish(claim, Result(cid="c0", jid=jid, seq=0, status_code=200, body={}))
        await dead.flush()
        assert dead.stale == 1
        (again,) = await live.claim(1, ["gpu0"])
        live.finish(again, Result(cid="c0", jid=jid, seq=0, status_code=200, body={}))
        await live.flush()

    run(go())
    assert r.xlen(k.results) == 1
    assert int(r.hget(k.stats, "recovered")) == 1


def test_renewed_leases_are_not_recovered(r, redis_url):
    enqueue(r, "gpu0", 1)

    def redis_now() -> float:
        seconds, micros = r.time()
        return seconds + micros / 1e6

    async def go():
        ledger = await _ledger(redis_url, lease_ttl_s=0.6)
        claimed_at = redis_now()
        await ledger.claim(1, ["gpu0"])
        # Renewed every 0.1 s until Redis's clock is three lease times past the claim: unrenewed, the
        # lease would have lapsed by then.
        while redis_now() < claimed_at + 3 * 0.6:
            await asyncio.sleep(0.1)
            await ledger.renew()
        return await ledger.recover_lapsed()

    assert run(go()) == []


def test_hand_back_puts_jobs_at_the_front(r, redis_url):
    ids = enqueue(r, "gpu0", 3)

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(2, ["gpu0"])
        assert await ledger.hand_back(claims) == 2

    run(go())
    assert sorted(r.lrange(Keys.queue("gpu0"), 0, -1)) == sorted(j.encode() for j in ids)
    assert StartedJobRegistry("gpu0", connection=r).count == 0
    assert Job.fetch(ids[0], connection=r, serializer=OrjsonSerializer).get_status() == JobStatus.QUEUED


@pytest.mark.parametrize("compressed", [True, False])
def test_parse_job_data_never_unpickles(compressed):
    import zlib

    raw = orjson.dumps(["batchfleet.jobs.generate", None, [{"cid": "x"}], {}])
    func, args, kwargs = parse_job_data(zlib.compress(raw) if compressed else raw)
    assert func == "batchfleet.jobs.generate" and args == [{"cid": "x"}] and kwargs == {}
    import pickle

    with pytest.raises(orjson.JSONDecodeError):
        parse_job_data(pickle.dumps(("os.system", None, ["true"], {})))


def test_drop_releases_leases_and_deletes_the_jobs_publishing_nothing(r, redis_url):
    enqueue(r, "gpu0", 3)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(3, ["gpu0"])
        dropped = await ledger.drop(claims[:2])
        again = await ledger.drop(claims[:2])  # already gone: nothing more
        return claims, dropped, again, dict(ledger.held)

    claims, dropped, again, held = run(go())
    assert (dropped, again) == (2, 0)
    assert list(held) == [claims[2].jid]
    assert [bool(r.exists(Keys.job(c.jid))) for c in claims] == [False, False, True]
    assert r.zcard(k.leases) == 1 and StartedJobRegistry("gpu0", connection=r).count == 1
    assert not r.exists(k.results) and not r.exists(k.done) and not r.exists(k.stats)


def test_refeed_hands_the_custom_id_to_the_head_and_deletes_the_job(r, redis_url):
    (jid,) = enqueue(r, "gpu0", 1)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        (claim,) = await ledger.claim(1, ["gpu0"])
        return await ledger.refeed(claim, "c0"), await ledger.refeed(claim, "c0")

    assert run(go()) == (True, False)  # the second finds no lease: nothing twice
    assert r.lrange(k.refeed, 0, -1) == [b"c0"]
    assert not r.exists(Keys.job(jid)) and r.zcard(k.leases) == 0
    assert StartedJobRegistry("gpu0", connection=r).count == 0


def test_a_failed_jobs_hash_expires_with_its_registry_entry(r, redis_url):
    (jid,) = enqueue(r, "gpu0", 1)

    async def go():
        ledger = await _ledger(redis_url)
        (c,) = await ledger.claim(1, ["gpu0"])
        ledger.finish(c, Result(cid="c0", jid=c.jid, seq=0, status_code=400,
                                error={"code": "invalid_prompt", "message": "too long"}), "invalid_prompt: too long")
        await ledger.flush()

    run(go())

    assert FAILURE_TTL_S - 60 < r.ttl(Keys.job(jid)) <= FAILURE_TTL_S
    assert FailedJobRegistry("gpu0", connection=r).get_job_ids() == [jid]


def succeed(ledger: Ledger, claims) -> None:
    """A bare success for each claim, queued for the next flush."""
    for c in claims:
        ledger.finish(c, Result(cid=c.jid, jid=c.jid, seq=0, status_code=200, body={}))


def test_finishes_that_come_while_a_flush_writes_gather_into_the_next_call(r, redis_url):
    """At 1,000 prompts/s a few prompts finish during every flush call. They wait for the next gathered
    flush: written at once by a call of their own (then the ones during that call, and so on) they would
    make 30 calls a second instead of 10, most of them of 1-5 outcomes."""
    enqueue(r, "gpu0", 6)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(6, ["gpu0"])
        real = ledger.r.evalsha
        sizes: list[int] = []

        async def evalsha(sha, numkeys, *keys_and_args):
            if sha == FINISH.sha:
                sizes.append(numkeys - 5 - 2)  # five run keys, a job key per outcome, two registries
                if len(sizes) == 1:  # two more prompts finish while the first call is on its way
                    succeed(ledger, claims[4:])
            return await real(sha, numkeys, *keys_and_args)

        ledger.r.evalsha = evalsha
        succeed(ledger, claims[:4])
        await ledger.flush()
        after_first = list(sizes)
        await ledger.flush()
        return after_first, sizes

    after_first, sizes = run(go())
    assert after_first == [4]  # the two that came during the call wait for the next flush
    assert sizes == [4, 2]
    assert r.zcard(k.leases) == 0 and r.xlen(k.results) == 6


def test_a_flush_that_fails_keeps_every_outcome_for_the_next(r, redis_url):
    enqueue(r, "gpu0", 3)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(3, ["gpu0"])
        real = ledger.r.evalsha
        calls = 0

        async def flaky(sha, *rest):
            nonlocal calls
            calls += sha == FINISH.sha
            if calls == 1:
                raise ConnectionError("Redis went away")
            return await real(sha, *rest)

        ledger.r.evalsha = flaky
        succeed(ledger, claims)
        with pytest.raises(ConnectionError):
            await ledger.flush()
        after_failure = (r.xlen(k.results), r.zcard(k.leases))
        await ledger.flush()
        return after_failure

    assert run(go()) == (0, 3)  # nothing written, every lease still held
    assert r.zcard(k.leases) == 0 and r.xlen(k.results) == 3  # the next flush wrote all three


def test_a_renewal_that_meets_a_finish_on_its_way_does_not_call_that_prompt_lost(r, redis_url):
    """The finish reaches Redis (its lease removed with it) while its reply is still on the way back, and
    a renewal runs meanwhile: the lease is gone because the prompt finished, not because another worker
    took it over. Only the prompt whose lease really lapsed is lost."""
    enqueue(r, "gpu0", 3)
    k = Keys("t")

    async def go():
        ledger = await _ledger(redis_url)
        claims = await ledger.claim(3, ["gpu0"])
        real = ledger.r.evalsha
        written, reply = asyncio.Event(), asyncio.Event()

        async def slow_reply(sha, *rest):
            out = await real(sha, *rest)
            if sha == FINISH.sha:
                written.set()  # in Redis now: the leases of the finished prompts are gone
                await reply.wait()
            return out

        ledger.r.evalsha = slow_reply
        succeed(ledger, claims[:2])
        flushing = asyncio.create_task(ledger.flush())
        await written.wait()
        r.zrem(k.leases, *[m for m in r.zrange(k.leases, 0, -1) if claims[2].jid.encode() in m])  # lapsed
        lost = await ledger.renew()
        reply.set()
        await flushing
        return lost, claims[2].jid

    lost, lapsed = run(go())
    assert lost == [lapsed]
    assert r.xlen(k.results) == 2
