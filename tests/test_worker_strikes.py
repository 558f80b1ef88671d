"""The ledger's Lua rules, exhaustively and fast, on fakeredis (with Lua): the lease arithmetic on
Redis's clock (which the test moves by hand, while the worker's own clock is wildly off), and the
strike arithmetic of server deaths. End-to-end tests cover the same rules with real processes."""

from __future__ import annotations

import asyncio
import itertools
import types
from collections.abc import Iterator

import fakeredis
import orjson
import pytest
from fakeredis.commands_mixins import server_mixin

from batchfleet import rqlayout
from batchfleet.keys import Keys
from batchfleet.records import Result
from batchfleet.scripts import lua_helpers
from worker import ledger as ledger_module
from worker.ledger import MAX_STRIKES, Claim, ClaimKind, Ledger

K = Keys("t")


class RedisClock:
    """What fakeredis's TIME answers (Redis's clock), moved by the test."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisClock]:
    c = RedisClock()
    monkeypatch.setattr(server_mixin, "time", types.SimpleNamespace(time=c.time))
    # The worker's own wall clock is an hour off and must not matter to any lease decision.
    monkeypatch.setattr(ledger_module, "time", types.SimpleNamespace(time=lambda: c.now + 3600,
                                                                    monotonic=__import__("time").monotonic))
    yield c


def make_jobs(r: fakeredis.FakeRedis, n: int, queue: str = "gpu0") -> list[str]:
    ids = []
    for i in range(n):
        jid = f"j{i}"
        r.hset(Keys.job(jid), mapping={"data": orjson.dumps(["batchfleet.jobs.generate", None, [{}], {}]),
                                       "origin": queue, "status": "queued"})
        r.rpush(Keys.queue(queue), jid)
        ids.append(jid)
    return ids


def where(r: fakeredis.FakeRedis, jid: str) -> str:
    """The one place a job is in: a list (queue, suspects, isolate), leased, failed, or nowhere."""
    places = []
    for name, key in (("queue", Keys.queue("gpu0")), ("suspects", K.suspects), ("isolate", K.isolate)):
        places += [name] * r.lrange(key, 0, -1).count(jid.encode())
    if any(rqlayout.execution_job(m) == jid for m in r.zrange(K.leases, 0, -1)):
        places.append("leased")
    if r.hget(Keys.job(jid), "status") == b"failed":
        places.append("failed")
    assert len(places) <= 1, f"{jid} is in {places}"
    return places[0] if places else "nowhere"


def run(coro):  # one event loop per call, as fakeredis's async client is bound to it
    return asyncio.run(coro)


async def _ledger(server: fakeredis.FakeServer, ttl: float = 15.0, worker: str = "w") -> Ledger:
    return Ledger(fakeredis.FakeAsyncRedis(server=server), K, worker=worker, lease_ttl_s=ttl)


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def r(server: fakeredis.FakeServer) -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis(server=server)


# --- leases on Redis's clock ------------------------------------------------------------------------
def test_lease_expiry_is_redis_time_plus_ttl_whatever_the_workers_clock(server, r, clock):
    make_jobs(r, 2)

    async def go():
        ledger = await _ledger(server, ttl=15)
        await ledger.claim(2, ["gpu0"])

    run(go())
    assert [s for _, s in r.zrange(K.leases, 0, -1, withscores=True)] == [clock.now + 15] * 2
    # The started registry and the job's timestamps come from Redis's clock too.
    assert r.zrange(Keys.started("gpu0"), 0, -1, withscores=True)[0][1] == clock.now + 24 * 3600
    assert r.hget(Keys.job("j0"), "started_at").decode() == rqlayout.timestamp(clock.now)


@pytest.mark.parametrize("elapsed", [0.0, 5.0, 14.999, 15.0, 15.001, 60.0])
def test_a_lease_lapses_exactly_at_its_expiry_on_redis_clock(server, r, clock, elapsed):
    (jid,) = make_jobs(r, 1)

    async def go():
        holder = await _ledger(server, ttl=15, worker="a")
        await holder.claim(1, ["gpu0"])
        clock.now += elapsed
        other = await _ledger(server, ttl=15, worker="b")
        return await other.recover_lapsed()

    recovered = run(go())
    lapsed = elapsed > 15.0  # the lease holds up to and including its expiry instant
    assert recovered == ([jid] if lapsed else [])
    assert where(r, jid) == ("queue" if lapsed else "leased")


def test_renewal_extends_from_redis_time_and_reports_a_lease_already_recovered(server, r, clock):
    a_id, b_id = make_jobs(r, 2)

    async def go():
        holder = await _ledger(server, ttl=10, worker="a")
        await holder.claim(2, ["gpu0"])
        clock.now += 9
        assert await holder.renew() == []
        clock.now += 9  # 18 s after the claim: alive only thanks to the renewal
        other = await _ledger(server, ttl=10, worker="b")
        assert await other.recover_lapsed() == []
        # Now the holder goes silent for a while: its leases lapse and another worker takes them back.
        clock.now += 11
        assert sorted(await other.recover_lapsed()) == [a_id, b_id]
        return await holder.renew(), holder.held

    lost, held = run(go())
    assert sorted(lost) == [a_id, b_id] and held == {}  # the silent worker learns it lost them


def test_a_late_finish_after_recovery_is_refused(server, r, clock):
    (jid,) = make_jobs(r, 1)

    async def go():
        holder = await _ledger(server, ttl=10, worker="a")
        (claim,) = await holder.claim(1, ["gpu0"])
        clock.now += 11
        other = await _ledger(server, ttl=10, worker="b")
        await other.recover_lapsed()
        holder.finish(claim, Result(cid="c", jid=jid, seq=0, status_code=200, body={}))
        await holder.flush()
        return holder.stale

    assert run(go()) == 1
    assert r.xlen(K.results) == 0 and where(r, jid) == "queue"


# --- strikes ------------------------------------------------------------------------------------------
def _die(server, r, clock, start: dict[str, int], inside: set[str], jids: list[str]):
    """Claim `jids` (after giving them `start` strikes), then report a server death with `inside`."""
    for jid, n in start.items():
        if n:
            r.hset(K.strikes, jid, n)

    async def go():
        ledger = await _ledger(server)
        claims = await ledger.claim(len(jids), ["gpu0"])
        by = {c.jid: c for c in claims}
        entries = [(by[j], Result(cid=j, jid=j, seq=0, status_code=0, error={"code": "server_crash",
                                                                              "message": "died"}))
                   for j in jids if j in inside]
        return await ledger.after_server_death(entries, [by[j] for j in jids if j not in inside],
                                               exc_string="server_crash: died")

    return run(go())


CASES = [(starts, mask) for k in (1, 2, 3) for starts in itertools.product(range(MAX_STRIKES), repeat=k)
         for mask in itertools.product((False, True), repeat=k)]


@pytest.mark.parametrize(("starts", "mask"), CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_strike_arithmetic(server, r, clock, starts, mask):
    jids = make_jobs(r, len(starts))
    inside = {j for j, m in zip(jids, mask, strict=True) if m}
    out = _die(server, r, clock, dict(zip(jids, starts, strict=True)), inside, jids)
    alone = len(inside) == 1
    quarantined = []
    for jid, s0 in zip(jids, starts, strict=True):
        strikes = int(r.hget(K.strikes, jid) or 0)
        if jid not in inside:  # not inside the dead server: back where its strikes say, no new strike
            assert strikes == s0
            assert where(r, jid) == ("queue", "suspects", "isolate")[s0]
        elif alone and s0 + 1 >= MAX_STRIKES:  # its 3rd death, alone: quarantined with its result
            quarantined.append(jid)
            assert where(r, jid) == "failed" and strikes == 0
            assert r.hget(Keys.job(jid), "exc_info") == b"server_crash: died"
        else:  # a strike, never past "run alone" unless alone
            assert strikes == min(s0 + 1, MAX_STRIKES - 1)
            assert where(r, jid) == ("queue", "suspects", "isolate")[strikes]
    assert out.quarantined == quarantined
    assert out.struck == len(inside) and out.handed_back == len(jids) - len(inside)
    results = [Result.from_json(f[b"r"]) for _, f in r.xrange(K.results)]
    assert [x.jid for x in results] == quarantined and all(x.error["code"] == "server_crash" for x in results)
    stats = {k.decode(): int(v) for k, v in r.hgetall(K.stats).items()}
    assert stats["server_deaths"] == 1 and stats.get("quarantined", 0) == len(quarantined)
    assert stats.get("failed", 0) == len(quarantined) and stats.get("handed_back", 0) == out.handed_back


def test_a_bystander_never_reaches_quarantine_however_often_it_shares_a_death(server, r, clock):
    poison, bystander = make_jobs(r, 2)
    for _ in range(10):  # ten deaths with both inside
        _die(server, r, clock, {}, {poison, bystander}, [poison, bystander])
        for key in (K.suspects, K.isolate):  # both back in line: put them on the queue for the next claim
            while (jid := r.lpop(key)) is not None:
                r.rpush(Keys.queue("gpu0"), jid)
    assert int(r.hget(K.strikes, bystander)) == MAX_STRIKES - 1 and where(r, bystander) == "queue"
    assert r.xlen(K.results) == 0


def test_claims_take_a_group_of_suspects_beside_normal_work_and_a_solo_prompt_comes_alone(server, r, clock):
    """Issue 21 §3 (the rule changed from "at most one suspect per worker"): a claim takes a group of up
    to `suspects` suspects, then normal work; a worker with a group in flight asks for none."""
    jids = make_jobs(r, 8)
    for j in ("j0", "j1", "j2", "j3"):
        r.lrem(Keys.queue("gpu0"), 0, j)
    r.rpush(K.suspects, "j0", "j1", "j2")
    r.rpush(K.isolate, "j3")

    async def go():
        ledger = await _ledger(server)
        solo = await ledger.claim(4, ["gpu0"], suspects=2, take_solo=True)
        mixed = await ledger.claim(4, ["gpu0"], suspects=2, take_solo=True)
        normal = await ledger.claim(4, ["gpu0"], suspects=0, take_solo=True)
        return solo, mixed, normal

    solo, mixed, normal = run(go())
    assert [(c.jid, c.kind) for c in solo] == [("j3", ClaimKind.SOLO)]
    assert [(c.jid, c.kind) for c in mixed] == [("j0", ClaimKind.SUSPECT), ("j1", ClaimKind.SUSPECT),
                                                ("j4", ClaimKind.NORMAL), ("j5", ClaimKind.NORMAL)]
    assert [(c.jid, c.kind) for c in normal] == [("j6", ClaimKind.NORMAL), ("j7", ClaimKind.NORMAL)]
    assert r.lrange(K.suspects, 0, -1) == [b"j2"]  # not asked (a group in flight): the suspect waits
    assert jids


def test_when_the_queues_are_dry_a_group_of_suspects_fills_the_free_slots(server, r, clock):
    make_jobs(r, 1)
    r.rpush(K.suspects, *[f"s{i}" for i in range(10)])
    for i in range(10):
        r.hset(Keys.job(f"s{i}"), mapping={"data": b"x", "origin": "gpu0", "status": "queued"})

    async def go():
        ledger = await _ledger(server)
        return await ledger.claim(8, ["gpu0"], suspects=2, suspects_dry=6)

    got = run(go())
    assert [(c.jid, c.kind) for c in got] == [("s0", ClaimKind.SUSPECT), ("s1", ClaimKind.SUSPECT),
                                              ("j0", ClaimKind.NORMAL)] + [
                                                 (f"s{i}", ClaimKind.SUSPECT) for i in range(2, 6)]
    assert r.llen(K.suspects) == 4


def test_a_stray_copy_of_a_running_job_is_never_claimed_twice(server, r, clock):
    (jid,) = make_jobs(r, 1)

    async def go():
        a = await _ledger(server, worker="a")
        first = await a.claim(1, ["gpu0"])
        r.rpush(Keys.queue("gpu0"), jid)  # e.g. a forged or repeated push of the same id
        b = await _ledger(server, worker="b")
        return first, await b.claim(1, ["gpu0"])

    first, second = run(go())
    assert [c.jid for c in first] == [jid] and second == []
    assert r.llen(Keys.queue("gpu0")) == 0 and r.zcard(K.leases) == 1


def test_hand_back_that_raises_forgets_the_claim_so_its_lease_lapses(server, r, clock):
    (jid,) = make_jobs(r, 1)

    async def go():
        ledger = await _ledger(server, ttl=10)
        (claim,) = await ledger.claim(1, ["gpu0"])

        async def broken(*_):
            raise ConnectionError("Redis went away")

        ledger.r.evalsha = broken  # the one call fails; nothing else is faked
        with pytest.raises(ConnectionError):
            await ledger.hand_back([claim])
        assert ledger.held == {}  # no longer renewed
        clock.now += 11
        return await (await _ledger(server)).recover_lapsed()

    assert run(go()) == [jid]


# --- RQ timestamps from Redis's clock -------------------------------------------------------------------
@pytest.mark.parametrize("ts", [0, 951_782_400, 951_868_799.5, 1_709_164_800.25, 4_107_542_400, 1_800_000_000.123456])
def test_iso_timestamps_match_python(ts):
    r = fakeredis.FakeRedis()
    s, us = int(ts), round((ts - int(ts)) * 1e6)
    got = r.eval(lua_helpers("iso") + "return iso(tonumber(ARGV[1]), tonumber(ARGV[2]))", 0, s, us).decode()
    assert got == rqlayout.timestamp(s + us / 1e6)


def test_claim_dataclass_defaults():
    c = Claim(jid="x", origin="gpu0", data=b"")
    assert c.kind is ClaimKind.NORMAL
