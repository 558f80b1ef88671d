"""Fair share between a shared fleet's tenants (producer/share.py) and the feed that applies it
(producer/feed.py, a real redis-server): weights, max-min, priority, a tenant that comes back, a head
that restarts. The end to end through `batchfleet serve` and the official SDK: test_serve_share.py."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.config import Config
from batchfleet.keys import Keys
from batchfleet.records import TenantFigures
from producer.collect import CollectSummary
from producer.feed import HIGH_ROOM, Feeder, window_target
from producer.share import HIGH, LOW, NORMAL, FairShare
from producer.store import Store, WaitingInput
from producer.tenants import TenantBook, read_tenants


def _waiting(*specs: tuple[int, str, int]) -> list[WaitingInput]:
    return [WaitingInput(f, t, p) for f, t, p in specs]


def _run(share: FairShare, waiting: list[WaitingInput], weights: dict[str, float], steps: int,
         tokens: dict[str, int], t0: float = 0.0) -> dict[str, int]:
    """Feed one prompt a step (a server that finishes each at the next step), return tokens per tenant."""
    got = {t: 0 for t in tokens}
    for i in range(steps):
        now = t0 + i * 0.1
        pick = share.pick(waiting, weights, now)
        assert pick is not None
        tenant = pick.input.tenant
        share.charge(tenant, [tokens[tenant]])
        share.observed(tenant, tokens[tenant], 1, now)
        got[tenant] += tokens[tenant]
    return got


def test_output_tokens_are_shared_by_weight_whatever_the_prompts_cost() -> None:
    share = FairShare()
    # A asks for long answers, B for short ones: the share is of output tokens, not of prompts
    got = _run(share, _waiting((1, "A", NORMAL), (2, "B", NORMAL)), {"A": 1, "B": 3}, 4000, {"A": 400, "B": 100})
    assert got["B"] / (got["A"] + got["B"]) == pytest.approx(0.75, abs=0.01)


def test_a_tenant_that_was_idle_is_fed_first_until_its_usage_meets_the_others() -> None:
    share = FairShare(half_life_s=300)
    _run(share, _waiting((1, "A", NORMAL)), {}, 600, {"A": 100})  # A alone for 60 s
    order = []
    for i in range(20):
        pick = share.pick(_waiting((1, "A", NORMAL), (2, "B", NORMAL)), {}, 60 + i * 0.1)
        assert pick is not None
        order.append(pick.input.tenant)
        share.charge(pick.input.tenant, [100])
    assert order == ["B"] * 20  # B's small batch runs as on an empty fleet
    # ... and no more than that: once its usage met A's, they share half and half
    got = _run(share, _waiting((1, "A", NORMAL), (2, "B", NORMAL)), {}, 20_000, {"A": 100, "B": 100}, t0=62)
    late = _run(share, _waiting((1, "A", NORMAL), (2, "B", NORMAL)), {}, 1000, {"A": 100, "B": 100}, t0=2062)
    assert got["B"] > got["A"]
    assert late["B"] / (late["A"] + late["B"]) == pytest.approx(0.5, abs=0.01)


def test_a_returning_tenant_with_a_huge_batch_has_the_fleet_for_about_one_half_life() -> None:
    share = FairShare(half_life_s=300)
    _run(share, _waiting((1, "A", NORMAL)), {}, 36_000, {"A": 100})  # A alone for an hour
    waiting = _waiting((1, "A", NORMAL), (2, "C", NORMAL))
    first_a = None
    for i in range(20_000):  # 10 prompts of 100 tokens a second, as A had
        now = 3600 + i * 0.1
        pick = share.pick(waiting, {}, now)
        assert pick is not None
        share.charge(pick.input.tenant, [100])
        share.observed(pick.input.tenant, 100, 1, now)
        if pick.input.tenant == "A":
            first_a = now - 3600
            break
    assert first_a is not None and 240 <= first_a <= 360  # ~one half-life (300 s), then they share


def test_high_is_picked_first_and_to_the_front_low_only_when_nothing_else_waits() -> None:
    share = FairShare()
    waiting = _waiting((1, "A", LOW), (2, "B", NORMAL), (3, "C", HIGH))
    pick = share.pick(waiting, {})
    assert pick is not None and pick.input.file == 3 and pick.front
    pick = share.pick(waiting[:2], {})
    assert pick is not None and pick.input.file == 2 and not pick.front
    pick = share.pick(waiting[:1], {})
    assert pick is not None and pick.input.file == 1
    assert share.pick([], {}) is None


def test_within_a_tenant_its_older_input_first() -> None:
    pick = FairShare().pick(_waiting((4, "A", NORMAL), (7, "A", NORMAL)), {})
    assert pick is not None and pick.input.file == 4


def test_a_shared_fleet_keeps_seconds_of_work_per_queue() -> None:
    c = Config(window_s=60, share_window_s=4)
    assert window_target(c, 72, 8.5) == 510  # 60 s of 8.5 prompts/s
    assert window_target(c, 72, 8.5, shared=True) == 34  # 4 s of it
    assert window_target(c, 72, 0.5, shared=True) == 18  # never under a quarter of the capacity
    assert window_target(c, 72, 0.0, shared=True) == 144  # nothing finished yet: fill the servers
    # no worker has reported yet (serve just started): a chunk, not window_default, or the first batch
    # would be fed whole before the share could weigh it against the next
    assert window_target(c, 0, 0.0) == c.window_default and window_target(c, 0, 0.0, shared=True) == 16


# --- the feed, on a real Redis -----------------------------------------------------------------------

def _shared_store(path: Path, inputs: list[tuple[str, str, int, int, int]]) -> Store:
    """A store as serve makes it: fed by input, each input owned. inputs: (name, tenant, priority, n,
    max_tokens)."""
    store = Store.create_or_open(path, run="t")
    with store.write():
        store.order_feed_by_input()
        for name, tenant, priority, n, max_tokens in inputs:
            f = store.file_id(name)
            store.shares.own(f, tenant, priority)
            store.insert_prompts([(f"{name}:{i}", 1, orjson.dumps({"max_tokens": max_tokens, "prompt": f"{name} {i}"}),
                                   f, i + 1, max_tokens, b"", None) for i in range(n)])
    return store


def _queued(r: redis.Redis, q: str) -> list[str]:
    return [orjson.loads(r.hget(Keys.job(j.decode()), "data"))[2][0]["cid"] for j in r.lrange(Keys.queue(q), 0, -1)]


def test_the_feed_shares_the_queues_by_weight_and_in_creation_order_within_a_tenant(r: redis.Redis,
                                                                                    tmp_path: Path) -> None:
    store = _shared_store(tmp_path / "s.sqlite", [("a1", "A", NORMAL, 3000, 100), ("b1", "B", NORMAL, 3000, 100),
                                                  ("a2", "A", NORMAL, 3000, 100)])
    with store.write():
        store.shares.set_weights({"B": 3})
    feeder = Feeder(Config(run="t"), r, store)
    assert feeder.shared()
    out = feeder.feed({"gpu0": 2000, "gpu1": 2000})
    assert out.total == 4000
    cids = _queued(r, "gpu0") + _queued(r, "gpu1")
    by = {p: sum(c.startswith(p) for c in cids) for p in ("a1", "b1", "a2")}
    assert by["a2"] == 0  # A's older batch first
    assert by["b1"] / 4000 == pytest.approx(0.75, abs=0.04)  # by weight, within a chunk (128) or so
    store.close()


def test_a_high_batch_goes_to_the_front_of_every_queue_in_its_order(r: redis.Redis, tmp_path: Path) -> None:
    store = _shared_store(tmp_path / "s.sqlite", [("a1", "A", NORMAL, 100, 100)])
    feeder = Feeder(Config(run="t"), r, store)
    feeder.feed({"gpu0": 20, "gpu1": 20})
    with store.write():
        f = store.file_id("urgent")
        store.shares.own(f, "B", HIGH)
        store.insert_prompts([(f"urgent:{i}", 1, b'{"max_tokens":9,"prompt":"u"}', f, i + 1, 9, b"", None)
                              for i in range(6)])
    feeder.feed({"gpu0": 3, "gpu1": 3})
    heads = [_queued(r, q)[:3] for q in ("gpu0", "gpu1")]
    assert sorted(heads[0] + heads[1]) == [f"urgent:{i}" for i in range(6)]
    for head in heads:
        assert head == sorted(head, key=lambda c: int(c.split(":")[1]))  # in the batch's order
    assert [len(_queued(r, q)) for q in ("gpu0", "gpu1")] == [23, 23]
    store.close()


def test_a_high_batch_is_fed_to_queues_already_at_their_window_but_at_most_high_room_beyond(
        r: redis.Redis, tmp_path: Path) -> None:
    """A full fleet's queues hold their window: no room for anything, yet a high batch waits for no
    window to drain. A pass puts it at the front of each queue, up to HIGH_ROOM beyond the window (a
    huge high batch does not flood Redis); normal work gets nothing."""
    store = _shared_store(tmp_path / "s.sqlite", [("a1", "A", NORMAL, 200, 100)])
    feeder = Feeder(Config(run="t"), r, store)
    targets = {"gpu0": 20, "gpu1": 20}
    assert feeder.top_up(targets).total == 40
    with store.write():
        f = store.file_id("urgent")
        store.shares.own(f, "B", HIGH)
        store.insert_prompts([(f"urgent:{i}", 1, b'{"max_tokens":9,"prompt":"u"}', f, i + 1, 9, b"", None)
                              for i in range(500)])
    out = feeder.top_up(targets)
    assert out.total == 2 * HIGH_ROOM
    for q in ("gpu0", "gpu1"):
        queued = _queued(r, q)
        assert len(queued) == 20 + HIGH_ROOM
        assert all(c.startswith("urgent:") for c in queued[:HIGH_ROOM])
        assert not any(c.startswith("urgent:") for c in queued[HIGH_ROOM:])
    assert feeder.top_up(targets).total == 0  # nothing claimed: nothing more
    store.close()


def test_a_head_that_starts_finds_what_was_fed_and_publishes_each_tenants_figures(r: redis.Redis,
                                                                                  tmp_path: Path) -> None:
    store = _shared_store(tmp_path / "s.sqlite", [("a1", "A", NORMAL, 50, 100), ("b1", "B", NORMAL, 50, 100)])
    first = Feeder(Config(run="t"), r, store)
    first.feed({"gpu0": 40})
    again = Feeder(Config(run="t"), r, store)  # a head restarted: what is in Redis still counts
    assert again.shared()
    assert {t: u.in_redis for t, u in again.share.tenants.items()} == {"A": 24, "B": 16}  # chunks of 16
    book = TenantBook(r, Keys("t"), store, again.share)
    with store.read():
        f_a = store.file_id("a1")
    got = CollectSummary()
    got.by_input[f_a] = [10, 1234]
    book.observe(got)
    book.publish(force=True)
    figures = read_tenants(r, Keys("t"))
    assert set(figures) == {"A", "B"}
    a = figures["A"]
    assert isinstance(a, TenantFigures) and a.output_tokens == 1234 and a.results == 10 and a.share == 1.0
    assert a.waiting + figures["B"].waiting == 60
    r.hset(Keys("t").tenants, "forged", b"{not json")  # data from Redis: skipped, never a crash
    assert set(read_tenants(r, Keys("t"))) == {"A", "B"}
    store.close()
