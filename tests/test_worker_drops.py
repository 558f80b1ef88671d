"""Cancelled prompts stop at once (issue 21 §4), the worker's side of `Keys.drop` / `Keys.signals`, on a
real Redis: the producer's `announce_drop` reaches a subscribed worker within a second, and a worker
that missed the message drops the prompts at its lease beat, before renewing, so their removed
leases never read as lost to another worker."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import redis.asyncio as aioredis

from batchfleet.keys import Keys
from batchfleet.rqlayout import execution_job
from producer.ends import announce_drop
from worker.drops import DropWatch
from worker.leases import LeaseKeeper
from worker.ledger import Ledger

from .test_worker_ledger import enqueue


def _setup(redis_url: str, run: str) -> tuple[Ledger, Keys]:
    k = Keys(run)
    return Ledger(aioredis.from_url(redis_url), k, worker="w1", lease_ttl_s=15.0), k


def _remove_leases(r, k: Keys, jids: list[str]) -> None:
    """What `producer cancel` does to jobs in flight before it announces them: their leases go."""
    for member in r.zrange(k.leases, 0, -1):
        if execution_job(member) in jids:
            r.zrem(k.leases, member)


def test_a_worker_that_missed_the_signal_drops_at_its_lease_beat_without_calling_them_lost(
        r, redis_url, caplog: pytest.LogCaptureFixture) -> None:
    run_name = f"dropbeat{time.monotonic_ns()}"
    ids = enqueue(r, f"{run_name}.gpu0", 3)

    async def go() -> tuple[set[str], list[str], int]:
        ledger, k = _setup(redis_url, run_name)
        claims = await ledger.claim(3, [f"{run_name}.gpu0"])
        assert sorted(c.jid for c in claims) == sorted(ids)
        cancelled = ids[:2]
        _remove_leases(r, k, cancelled)
        r.sadd(k.drop, *cancelled)  # announced while this worker was not subscribed: no message reaches it
        dropped: set[str] = set()
        lost: list[str] = []

        async def drop(jids: set[str]) -> int:
            dropped.update(jids)
            await ledger.drop([ledger.held[j] for j in jids])
            return len(jids)

        async def nothing(n: int) -> None:
            return None

        watch = DropWatch(ledger.r, k, held=lambda: list(ledger.held), drop=drop, on_check=nothing)
        keeper = LeaseKeeper(ledger, on_lost=lost.extend, check_drops=watch.check)
        await keeper.beat()
        return dropped, lost, len(ledger.held)

    with caplog.at_level(logging.WARNING):
        dropped, lost, held = run(go())
    assert dropped == set(ids[:2]) and lost == [] and held == 1
    assert "lost the lease" not in caplog.text


def test_a_subscribed_worker_drops_within_a_second_of_the_announcement(r, redis_url) -> None:
    run_name = f"dropsig{time.monotonic_ns()}"
    ids = enqueue(r, f"{run_name}.gpu0", 3)

    async def go() -> tuple[set[str], float]:
        ledger, k = _setup(redis_url, run_name)
        await ledger.claim(3, [f"{run_name}.gpu0"])
        got = asyncio.Event()
        dropped: set[str] = set()

        async def drop(jids: set[str]) -> int:
            dropped.update(jids)
            got.set()
            return len(jids)

        async def nothing(n: int) -> None:
            return None

        watch = DropWatch(ledger.r, k, held=lambda: list(ledger.held), drop=drop, on_check=nothing)
        task = asyncio.create_task(watch.run())
        try:
            await asyncio.wait_for(watch.subscribed.wait(), 5)
            t0 = time.monotonic()
            await asyncio.to_thread(announce_drop, r, k, [ids[1]])
            await asyncio.wait_for(got.wait(), 5)
            return dropped, time.monotonic() - t0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    dropped, took = run(go())
    assert dropped == {ids[1]} and took < 1.0


def run(coro):
    return asyncio.run(coro)


def _time_out_under(client: aioredis.Redis) -> int:
    """Leave each connection the pool has lent out (the subscription's) as a partition that outlived TCP's
    retransmissions leaves it: its transport closed, its reader holding `TimeoutError(110, 'Connection
    timed out')`. redis-py still calls it connected, and a read with a timeout returns None at once."""
    n = 0
    for conn in list(client.connection_pool._in_use_connections):
        conn._reader.set_exception(TimeoutError(110, "Connection timed out"))
        conn._writer.transport.abort()
        n += 1
    return n


def test_the_watch_never_starves_the_worker_when_its_subscription_timed_out_and_it_subscribes_again(
        r, redis_url) -> None:
    """The subscription's connection timed out under the watch (as on a host cut off for a minute): the
    worker's other tasks keep running (a ticker meant to tick every 50 ms does, about that often), the
    watch subscribes again, and a drop announced after that still reaches it. Before, `get_message`
    returned None at once for ever and the loop never yielded: the worker stopped reporting."""
    run_name = f"dropcut{time.monotonic_ns()}"
    k = Keys(run_name)

    async def go() -> tuple[int, bool]:
        client = aioredis.from_url(redis_url, socket_timeout=10, socket_connect_timeout=5)
        checks = 0

        async def drop(jids: set[str]) -> int:
            return 0

        async def counted(n: int) -> None:
            nonlocal checks
            checks += 1

        watch = DropWatch(client, k, held=lambda: [], drop=drop, on_check=counted)
        task = asyncio.create_task(watch.run())
        await asyncio.wait_for(watch.subscribed.wait(), 10)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.2)
        assert _time_out_under(client) == 1
        try:
            await asyncio.wait_for(asyncio.sleep(4.0), 30)  # returns late if the loop is starved
        finally:
            tick.cancel()
        ticks_in_4s = ticks
        deadline = time.monotonic() + 15
        while not watch.subscribed.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        before = checks
        announce_drop(r, k, ["some-job"])
        deadline = time.monotonic() + 5
        while checks == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        reached = checks > before
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()
        return ticks_in_4s, reached

    out: list[tuple[int, bool]] = []
    # in a thread of its own: a starved loop never returns, and the test must fail, not hang
    runner = threading.Thread(target=lambda: out.append(asyncio.run(go())), daemon=True)
    runner.start()
    runner.join(60)
    assert out, "the watch's event loop never came back: starved by a subscription that answers nothing at once"
    ticks, reached = out[0]
    assert ticks >= 40, f"the event loop was starved: {ticks} ticks of ~84 in 4.2 s"
    assert reached, "a drop announced after the watch subscribed again did not reach it"
