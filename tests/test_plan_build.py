"""The plan's sorted pass beside the feed (producer/planbuild.py), on a real SQLite file with the real
thread: the feed goes on while it sorts, the sort never takes the writer lock, the pass is installed
when done, a prompt that became WAITING after its snapshot is planned again, and every prompt is fed
exactly once whatever the pass is doing."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import producer.store
from producer.fingerprint import canonical_request
from producer.plan import prefix_key
from producer.store import State, Store

DOCS = [" ".join(f"d{d}w{i}" for i in range(600)) for d in range(12)]  # ~4.5 KB each


def bodies(n_docs: int = 12, per_doc: int = 4, *, seed: int = 5) -> list[dict]:
    lines = [(d, q) for d in range(n_docs) for q in range(per_doc)]
    random.Random(seed).shuffle(lines)
    # costs spread so that the order by expected work alone is not the plan's
    return [{"model": "m", "max_tokens": 16 + (7 * i) % 97,
             "messages": [{"role": "user", "content": f"{DOCS[d]}\n\nQuestion {q}?"}]}
            for i, (d, q) in enumerate(lines)]


def insert(s: Store, items: list[dict], *, first: int = 0, file: int = 1) -> None:
    rows = []
    for i, body in enumerate(items, start=first):
        c, fp = canonical_request("/v1/chat/completions", body)
        rows.append((f"c{i}", 0, c, file, i + 1, body["max_tokens"], fp, prefix_key(c, "m")))
    with s.write():
        s.insert_prompts(rows)


def planned_order(tmp_path: Path, items: list[dict], fed: list[str] | None = None) -> list[str]:
    """The custom_ids in the order a rebuild inside the feed's transaction plans them (`fed` fed before)."""
    s = Store.create_or_open(tmp_path / f"sync{len(fed or ())}" / "r.sqlite", run="t")
    insert(s, items)
    with s.write():
        seqs = [s.db.execute("SELECT seq FROM prompts WHERE cid = ?", (cid,)).fetchone()[0] for cid in fed or ()]
        s.set_state(seqs, State.WAITING, State.FED)
        s.plan.rebuild()
    order = [cid for (cid,) in s.db.execute("SELECT p.cid FROM plan JOIN prompts p USING (seq) ORDER BY pos")]
    s.close()
    return order


def build_tables(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE name GLOB 'plan_build_*'")]
    finally:
        db.close()


def feed_all(s: Store, limit: int) -> list[str]:
    """Feed until nothing is left, a pass beside the feed awaited when one runs: the custom_ids fed."""
    fed: list[str] = []
    for _ in range(200):
        with s.write():
            rows = s.next_to_feed(limit)
            s.fed_rows(rows)
        fed += [r.cid for r in rows]
        if s.plan.building is not None:
            s.plan.building.done.wait(30)
        elif not rows:
            break
    return fed


@pytest.fixture
def beside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(producer.store, "BACKGROUND_FROM", 1)  # every pass runs beside the feed


def test_the_feed_goes_on_while_the_pass_sorts_without_the_writer_lock_and_feeds_each_prompt_once(
        tmp_path: Path, beside: None) -> None:
    items = bodies()
    expected = planned_order(tmp_path, items)
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    insert(s, items)
    fed: list[str] = []

    # an enqueue in another process holds the writer lock and adds a prompt while the head's feed pass
    # (reads only, here: it could not take the lock) starts a pass and goes on by expected work; the
    # pass sorts all the same (its snapshot has not that prompt), and its copy waits for the lock
    other = Store.open(path, run="t")
    with other.write():
        late = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": DOCS[0] + " late?"}]}
        c, fp = canonical_request("/v1/chat/completions", late)
        other.insert_prompts([(f"c{len(items)}", 0, c, 1, len(items) + 1, 8, fp, prefix_key(c, "m"))])
        first = s.next_to_feed(5)  # the plan is stale and empty: a pass starts
        build = s.plan.building
        assert build is not None
        assert build.sorted.wait(30), "the sort waited for the writer lock"
        assert not build.done.wait(0.5), f"the copy wrote without the writer lock ({build.error!r})"
    other.close()
    assert [r.pos for r in first] == [0] * 5
    by_cost = sorted(range(len(items)), key=lambda i: (-items[i]["max_tokens"], i))[:5]
    assert [r.cid for r in first] == [f"c{i}" for i in by_cost]
    with s.write():
        assert s.fed_rows(first) == 5
    fed += [r.cid for r in first]
    assert build.done.wait(30)
    assert build.error is None, repr(build.error)

    with s.write():  # installed: the plan's order, less what was fed meanwhile; still stale (the late one)
        rows = s.next_to_feed(100)
        s.fed_rows(rows)
        assert s.db.execute("SELECT COUNT(*) FROM plan").fetchone()[0] == len(items)  # its snapshot's
    assert all(r.pos > 0 for r in rows)
    assert [r.cid for r in rows] == [c for c in expected if c not in fed]
    fed += [r.cid for r in rows]
    assert s.get_meta("plan_stale") not in (None, "0")
    assert build_tables(path) == []  # the pass's table is the plan now

    with s.write():  # nothing left in that plan: another pass, the late prompt by expected work meanwhile
        rows = s.next_to_feed(100)
        s.fed_rows(rows)
    fed += [r.cid for r in rows]
    assert sorted(fed) == sorted(f"c{i}" for i in range(len(items) + 1)) and len(fed) == len(set(fed))
    with s.read():
        assert s.counts()["waiting"] == 0
    s.close()  # stops the pass still running or drops its table
    assert build_tables(path) == []


def test_a_store_fed_by_input_is_planned_beside_the_feed_per_input(tmp_path: Path, beside: None) -> None:
    a, b = bodies(6, 4, seed=1), bodies(6, 4, seed=2)
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    with s.write():
        s.order_feed_by_input()
    insert(s, a, file=1)
    insert(s, b, first=len(a), file=2)
    with s.write():
        assert s.next_to_feed(3, file=2) != []  # starts the pass
    build = s.plan.building
    assert build is not None and build.by_input and build.done.wait(30) and build.error is None
    with s.write():
        two = s.next_to_feed(100, file=2)
        one = s.next_to_feed(100, file=1)
    assert all(r.pos > 0 for r in one + two)
    assert {r.cid for r in one} == {f"c{i}" for i in range(len(a))}
    assert {r.cid for r in two} == {f"c{i}" for i in range(len(a), len(a) + len(b))}
    # the pass's table kept its index on (file, pos): `next(file=)` reads it, no second index is made
    assert len(s.db.execute("SELECT * FROM pragma_index_list('plan')").fetchall()) == 1
    with s.write():
        s.order_feed_by_input()
    assert len(s.db.execute("SELECT * FROM pragma_index_list('plan')").fetchall()) == 1
    s.close()


def test_a_rebuild_inside_the_feed_overtakes_a_pass_beside_it(tmp_path: Path, beside: None) -> None:
    items = bodies()
    expected = planned_order(tmp_path, items)
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    insert(s, items)
    with s.write():
        assert all(r.pos == 0 for r in s.next_to_feed(1))  # a pass starts (nothing fed)
    build = s.plan.building
    assert build is not None and build.done.wait(30)
    with s.write():
        assert s.plan.rebuild() == len(items)  # e.g. `--no-plan` turned off again: now, in this transaction
    assert s.plan.building is None and build_tables(path) == []
    with s.write():
        assert [r.cid for r in s.next_to_feed(100)] == expected
    s.close()


def test_closing_the_store_stops_a_pass_and_leaves_every_prompt_waiting(tmp_path: Path, beside: None) -> None:
    items = bodies(12, 8)
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    insert(s, items)
    with s.write():
        s.next_to_feed(1)
    assert s.plan.building is not None
    s.close()  # a head stopped in the middle of a pass (SIGTERM): the pass stops with it
    assert build_tables(path) == []
    s = Store.open(path, run="t")
    with s.read():
        assert s.counts()["waiting"] == len(items)
    fed = feed_all(s, 10)
    assert sorted(fed) == sorted(f"c{i}" for i in range(len(items))) and len(fed) == len(set(fed))
    s.close()


def test_a_process_that_feeds_once_leaves_a_large_stores_plan_to_the_head(tmp_path: Path, beside: None) -> None:
    items = bodies()
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    insert(s, items)
    s.plan.beside = False  # `producer enqueue`'s one feed pass
    with s.write():
        first = s.next_to_feed(5)
        s.fed_rows(first)
    assert s.plan.building is None and [r.pos for r in first] == [0] * 5
    s.close()
    head = Store.open(path, run="t")  # the head's store plans it beside its feed
    with head.write():
        head.next_to_feed(1)
    build = head.plan.building
    assert build is not None and build.done.wait(30) and build.error is None
    with head.write():
        rows = head.next_to_feed(100)
    assert [r.cid for r in rows] == planned_order(tmp_path, items, [r.cid for r in first])  # the 43 left
    head.close()


_KILLED_MID_PASS = """
import os, sys, time
from pathlib import Path
import producer.store
from producer.store import Store
producer.store.BACKGROUND_FROM = 1
s = Store.open(Path(sys.argv[1]), run="t")
with s.write():
    s.next_to_feed(1)
while not s.db.execute("SELECT 1 FROM sqlite_master WHERE name GLOB 'plan_build_*'").fetchone():
    time.sleep(0.005)
print("copying", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_head_killed_during_a_pass_leaves_a_table_the_next_install_drops_and_feeds_each_prompt_once(
        tmp_path: Path, beside: None) -> None:
    items = bodies()
    path = tmp_path / "r.sqlite"
    s = Store.create_or_open(path, run="t")
    insert(s, items)
    s.close()
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_PASS, str(path)], capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert child.returncode == -9 and child.stdout == "copying\n", child.stderr
    left = build_tables(path)
    assert len(left) == 1
    head = Store.open(path, run="t")
    fed = feed_all(head, 7)
    assert sorted(fed) == sorted(f"c{i}" for i in range(len(items))) and len(fed) == len(set(fed))
    assert left[0] not in build_tables(path)
    head.close()
    assert build_tables(path) == []
