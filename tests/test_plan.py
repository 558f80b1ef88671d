"""The prefix plan (producer/plan.py) and its parts in the store, the feed and the worker's claim: pure
keys and units, then against a real Redis."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import orjson
import redis
import redis.asyncio as aioredis

from batchfleet.config import Config
from batchfleet.keys import Keys
from producer.feed import Feeder
from producer.fingerprint import canonical_request
from producer.plan import ANCHORS, SHARED_MIN, Dealer, PlanRow, common_prefix, conversation, prefix_key
from producer.store import Store
from worker.ledger import Ledger

DOCS = [" ".join(f"d{d}w{i}" for i in range(600)) for d in range(12)]  # ~4.5 KB each


def chat(doc: str, question: str, *, model: str = "m", max_tokens: int = 64) -> dict:
    return {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": "Answer from the document."},
                         {"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]}


def canon(body: dict, url: str = "/v1/chat/completions") -> bytes:
    return canonical_request(url, body)[0]


def test_prompts_sharing_a_prefix_share_the_leading_components_of_their_keys() -> None:
    a, b = canon(chat(DOCS[0], "who?")), canon(chat(DOCS[0], "where?"))
    other = canon(chat(DOCS[1], "who?"))
    ka, kb, ko = prefix_key(a, "m"), prefix_key(b, "m"), prefix_key(other, "m")
    shared = common_prefix(conversation(a), conversation(b))
    assert shared >= len(DOCS[0]) and common_prefix(conversation(a), conversation(other)) < 100
    depth = sum(1 for anchor in ANCHORS if anchor <= shared)  # anchors within the shared prefix
    assert ka[:2 * depth] == kb[:2 * depth] and len(ka) == 2 * depth  # nothing of the tail is hashed
    assert ka[:2] != ko[:2]
    # the model seeds the chain: an adapter's prompts are cached apart
    assert prefix_key(a, "m:adapter")[:2] != ka[:2]
    # a conversation shorter than the first anchor is not worth grouping
    assert prefix_key(canon({"max_tokens": 8, "prompt": "hi"}, "/v1/completions")) == b""


def test_sorting_by_key_puts_each_documents_questions_side_by_side_whatever_the_input_order() -> None:
    lines = [(d, q) for d in range(12) for q in range(8)]
    random.Random(7).shuffle(lines)
    keys = sorted((prefix_key(canon(chat(DOCS[d], f"question {q}?")), "m"), d) for d, q in lines)
    docs_in_order = [d for _, d in keys]
    runs = [d for i, d in enumerate(docs_in_order) if i == 0 or docs_in_order[i - 1] != d]
    assert sorted(runs) == list(range(12))  # each document is one run of 8


def test_common_prefix_agrees_with_a_byte_by_byte_scan() -> None:
    rng = random.Random(3)
    for _ in range(500):
        a = os.urandom(rng.randint(0, 12000))
        b = a[: rng.randint(0, len(a))] + os.urandom(rng.randint(0, 30))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n


def row(seq: int, body: dict) -> PlanRow:
    return PlanRow(seq, f"c{seq}", "/v1/chat/completions", canon(body), "", seq)


def test_units_hold_consecutive_prompts_sharing_a_prefix_and_stay_within_their_bound() -> None:
    rows = [row(i + 1, chat(DOCS[i // 8], f"q{i}")) for i in range(24)]  # three documents of 8, in plan order
    units = Dealer(unit_max=5).units(rows)
    assert [len(u.rows) for u in units] == [5, 3, 5, 3, 5, 3]
    assert [u.grp for u in units] == ["1", "6", "9", "14", "17", "22"]
    assert all(s >= SHARED_MIN for u in units for s in u.shared[1:])
    lone = Dealer().units([row(1, {"max_tokens": 4, "messages": [{"role": "user", "content": "x" * 700}]}),
                           row(2, {"max_tokens": 4, "messages": [{"role": "user", "content": "y" * 700}]})])
    assert [u.grp for u in lone] == ["", ""]  # a unit of one prompt carries no unit in its job


def test_a_unit_goes_whole_to_the_queue_whose_last_prompt_it_shares_most_with() -> None:
    dealer = Dealer(unit_max=4)
    doc_a = [row(i + 1, chat(DOCS[0], f"a{i}")) for i in range(8)]
    doc_b = [row(i + 9, chat(DOCS[1], f"b{i}")) for i in range(8)]
    first = dealer.deal(dealer.units(doc_a[:4] + doc_b[:4]), {"q0": 4, "q1": 4})
    assert [[r.seq for u in first[q] for r in u.rows] for q in ("q0", "q1")] == [[1, 2, 3, 4], [9, 10, 11, 12]]
    # the next pass: each document's rest follows it to its queue, whatever the order of room
    second = dealer.deal(dealer.units(doc_b[4:] + doc_a[4:]), {"q0": 10, "q1": 10})
    assert [[r.seq for u in second[q] for r in u.rows] for q in ("q0", "q1")] == [[5, 6, 7, 8], [13, 14, 15, 16]]
    # the prediction: all but each queue's first prompt share the document with the one before
    assert dealer.shared["q0"] >= 7 * len(DOCS[0]) and dealer.total["q0"] >= 8 * len(DOCS[0])
    # a unit that continues its queue's document (cut at unit_max) is of its first unit's family
    assert [u.grp for u in first["q0"] + second["q0"]] == ["1", "5/1"]
    assert [u.grp for u in first["q1"] + second["q1"]] == ["9", "13/9"]


def store_with(tmp_path: Path, bodies: list[dict]) -> Store:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="t")
    rows = []
    for i, body in enumerate(bodies):
        c, fp = canonical_request("/v1/chat/completions", body)
        rows.append((f"c{i}", 0, c, 1, i + 1, body["max_tokens"], fp, prefix_key(c, body["model"])))
    with s.write():
        s.insert_prompts(rows)
    return s


def test_the_store_feeds_in_plan_order_and_plans_again_when_prompts_wait_anew(tmp_path: Path) -> None:
    lines = [(d, q) for d in range(4) for q in range(5)]
    random.Random(1).shuffle(lines)
    s = store_with(tmp_path, [chat(DOCS[d], f"q{q}") for d, q in lines])
    with s.write():
        first = s.next_to_feed(10)
        docs = [lines[r.seq - 1][0] for r in first]
        assert [d for i, d in enumerate(docs) if i == 0 or docs[i - 1] != d] == docs[::5]  # whole documents
        s.fed_rows(first[:7])
        rest = s.next_to_feed(100)
    assert [r.seq for r in rest] == [r.seq for r in first[7:]] + [r.seq for r in rest[3:]] and len(rest) == 13
    with s.write():  # a prompt waits anew (a refused late result): planned again once the plan runs dry
        assert s.stale([first[0].seq]) == 1
        assert [r.seq for r in s.next_to_feed(100)] == [r.seq for r in rest]
        s.fed_rows(rest[:12])
        assert [r.seq for r in s.next_to_feed(100)] == [rest[12].seq]
        s.fed_rows([rest[12]])
        assert [r.seq for r in s.next_to_feed(100)] == [first[0].seq]
    with s.write():
        s.plan.turn(False)  # --no-plan: longest expected work first, then input order
        assert [r.seq for r in s.next_to_feed(3)] == [first[0].seq]
    assert s.counts()["fed"] == 19 and s.counts()["waiting"] == 1


def test_a_documents_questions_stay_side_by_side_when_they_ask_for_different_lengths(tmp_path: Path) -> None:
    """Longest expected work first is per family of prompts with one key: a document whose questions
    ask for 16, 64 or 256 tokens is fed whole (at its longest question's place), not in three bands."""
    lines = [(d, q) for d in range(4) for q in range(6)]
    random.Random(2).shuffle(lines)
    lengths = {0: 16, 1: 64, 2: 256}
    s = store_with(tmp_path, [chat(DOCS[d], f"q{q}", max_tokens=lengths[(d + q) % 3] if d < 3 else 8)
                              for d, q in lines])
    with s.write():
        order = [lines[r.seq - 1][0] for r in s.next_to_feed(100)]
    runs = [d for i, d in enumerate(order) if i == 0 or order[i - 1] != d]
    assert sorted(runs) == [0, 1, 2, 3] and runs[-1] == 3, order  # one run per document; the shortest last


def test_the_head_deals_whole_documents_to_queues_and_their_jobs_name_their_unit(r: redis.Redis,
                                                                                  tmp_path: Path) -> None:
    lines = [(d, q) for d in range(6) for q in range(6)]
    random.Random(2).shuffle(lines)
    s = store_with(tmp_path, [chat(DOCS[d], f"q{q}") for d, q in lines])
    out = Feeder(Config(run="t"), r, s).feed({"gpu0": 18, "gpu1": 18})
    assert out.fed == {"gpu0": 18, "gpu1": 18}
    for q in ("gpu0", "gpu1"):
        jids = r.lrange(Keys.queue(q), 0, -1)
        grps = [r.hget(Keys.job(j.decode()), "grp") for j in jids]
        data = [orjson.loads(r.hget(Keys.job(j.decode()), "data"))[2][0]["cid"] for j in jids]
        docs = [lines[int(c[1:])][0] for c in data]
        assert len(set(docs)) == 3 and all(docs.count(d) == 6 for d in set(docs))  # three whole documents
        assert len(set(grps)) == 3 and None not in grps


def test_a_thief_takes_whole_units_from_the_tail_of_another_queue_and_splits_one_only_when_it_is_all(
        r: redis.Redis, redis_url: str) -> None:
    victim = Keys.queue("gpu1")
    units = {"u1": 3, "u2": 3, "u3": 3}  # front to tail
    jids = []
    for grp, n in units.items():
        for i in range(n):
            jid = f"j-{grp}-{i}"
            r.hset(Keys.job(jid), mapping={"data": "x", "origin": "gpu1", "status": "queued", "grp": grp})
            jids.append(jid)
    r.rpush(victim, *jids)

    async def claim(n: int) -> list[str]:
        client = aioredis.from_url(redis_url)
        try:
            ledger = Ledger(client, Keys("t"), worker="w", lease_ttl_s=15)
            return sorted(c.jid for c in await ledger.claim(n, ["gpu0", "gpu1"]))
        finally:
            await client.aclose()

    assert asyncio.run(claim(5)) == sorted(f"j-u3-{i}" for i in range(3))  # u3 whole; u2 not split for 2 slots
    assert asyncio.run(claim(2)) == ["j-u2-1", "j-u2-2"]  # 2 slots, the last units in reach: u2's tail
    assert [j.decode() for j in r.lrange(victim, 0, -1)] == ["j-u1-0", "j-u1-1", "j-u1-2", "j-u2-0"]
    assert r.hget(Keys.job("j-u3-0"), "status") == b"started"
    assert asyncio.run(claim(10)) == sorted(["j-u1-0", "j-u1-1", "j-u1-2", "j-u2-0"])  # all it holds


def test_a_queue_whose_tail_is_no_unit_is_stolen_from_the_front_as_before(r: redis.Redis, redis_url: str) -> None:
    jids = [f"p{i}" for i in range(4)]
    for jid in jids:
        r.hset(Keys.job(jid), mapping={"data": "x", "origin": "gpu1", "status": "queued"})
    r.rpush(Keys.queue("gpu1"), *jids)

    async def claim(n: int) -> list[str]:
        client = aioredis.from_url(redis_url)
        try:
            return [c.jid for c in await Ledger(client, Keys("t"), worker="w", lease_ttl_s=15).claim(n, ["gpu0",
                                                                                                      "gpu1"])]
        finally:
            await client.aclose()

    assert asyncio.run(claim(2)) == ["p0", "p1"]


def test_of_the_prompts_one_claim_brings_each_units_first_goes_out_first() -> None:
    from worker.dispatcher import leaders_first
    from worker.ledger import Claim

    claims = [Claim(f"j{i}", "gpu0", b"", grp=g) for i, g in enumerate([b"1", b"1", b"1", b"4", b"4", b"", b"7"])]
    assert [c.jid for c in leaders_first(claims)] == ["j0", "j3", "j5", "j6", "j1", "j4", "j2"]
    plain = [Claim(f"p{i}", "gpu0", b"") for i in range(3)]
    assert leaders_first(plain) == plain  # no plan: the claim's own order
    # units of one family (a template cut into units): one leader for them all, then the other units'
    family = [Claim(f"f{i}", "gpu0", b"", grp=g) for i, g in enumerate([b"1", b"1", b"3/1", b"3/1", b"5", b"5"])]
    assert [c.jid for c in leaders_first(family)] == ["f0", "f4", "f1", "f5", "f2", "f3"]


def test_a_units_later_prompts_follow_close_behind_its_first_in_blocks() -> None:
    from worker.dispatcher import LEADERS_BLOCK_BYTES, leaders_first
    from worker.ledger import Claim

    big = b"x" * (LEADERS_BLOCK_BYTES // 2 + 1)  # two units' firsts fill a block
    claims = [Claim(f"{g}{k}", "gpu0", big, grp=g.encode()) for g in "ABC" for k in range(2)]
    assert [c.jid for c in leaders_first(claims)] == ["A0", "B0", "A1", "B1", "C0", "C1"]


def test_a_store_whose_prompts_have_no_key_feeds_in_its_own_order_without_a_sorted_pass(tmp_path: Path) -> None:
    bodies = [{"model": "m", "max_tokens": t, "messages": [{"role": "user", "content": f"short {i}"}]}
              for i, t in enumerate([8, 64, 16, 64])]
    s = store_with(tmp_path, bodies)
    with s.write():
        assert s.plan.rebuild() == 0  # nothing shares a prefix worth grouping: no plan rows
    with s.write():
        rows = s.next_to_feed(10)
        assert [r.cid for r in rows] == ["c1", "c3", "c2", "c0"] and all(r.pos == 0 for r in rows)
        s.fed_rows(rows[:2])
    assert [r.cid for r in s.next_to_feed(10)] == ["c2", "c0"]
    # a keyed prompt arriving later makes a plan again
    long = {"model": "m", "max_tokens": 99, "messages": [{"role": "user", "content": "doc " * 200}]}
    c, fp = canonical_request("/v1/chat/completions", long)
    with s.write():
        s.insert_prompts([("c9", 0, c, 1, 9, 99, fp, prefix_key(c, "m"))])
        s.plan.stale()
        assert s.plan.rebuild() == 3
    assert [r.cid for r in s.next_to_feed(10)] == ["c9", "c2", "c0"]


def test_the_sorted_pass_reads_the_waiting_index_alone_never_the_prompts_rows(tmp_path: Path) -> None:
    """The plan's sorted pass over 10M waiting prompts must not read their bodies (~700 B each): the
    waiting index holds the key, the input and the cost, in a store fed by cost and in one fed by input."""
    lines = [(d, q) for d in range(3) for q in range(4)]
    s = store_with(tmp_path, [chat(DOCS[d], f"q{q}") for d, q in lines])
    for by_input in (False, True):
        traced: list[str] = []
        with s.write():
            if by_input:
                s.order_feed_by_input()  # builds the plan again, from the other index
            s.db.set_trace_callback(traced.append)
            assert s.plan.rebuild() == 12
            s.db.set_trace_callback(None)
        passes = [q for q in traced if q.startswith("INSERT INTO plan")]
        assert len(passes) == 1, traced
        steps = str(s.db.execute("EXPLAIN QUERY PLAN " + passes[0]).fetchall())
        index = "prompts_waiting_input" if by_input else "prompts_waiting"
        assert f"SCAN prompts USING COVERING INDEX {index}" in steps, steps
