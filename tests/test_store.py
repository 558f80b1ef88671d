"""The run's store on its own (no Redis): layout, idempotence, feed order, states and their tally,
success-wins results, read-only opening."""

from __future__ import annotations

import sqlite3
import stat
import time
from multiprocessing import Queue, get_context
from pathlib import Path

import orjson
import pytest

from producer import storefile
from producer.enqueue import cost_of
from producer.fingerprint import FileFingerprint, canonical, canonical_request, fingerprint
from producer.store import (
    UNBOUNDED_COST,
    MissingStore,
    State,
    Store,
    StoreError,
)


def rows(n: int, *, start: int = 0, file_id: int = 1) -> list[tuple[str, int, bytes, int, int, int, bytes, None]]:
    out = []
    for i in range(start, start + n):
        body = {"prompt": f"p{i}", "max_tokens": 16 * (i % 3 + 1)}
        out.append((f"c{i}", 1, orjson.dumps(body), file_id, i + 1, 16 * (i % 3 + 1),
                    fingerprint("/v1/completions", body), None))  # no plan key: nothing to group
    return out


def check_tally(store: Store) -> None:
    t = store.recount()
    c = store.counts()
    assert (c["waiting"], c["fed"], c["succeeded"], c["succeeded"] + c["failed"], c["cancelled"]) == (
        t["waiting"], t["fed"], t["ok"], t["done"], t["cancelled"])


def test_fingerprints_do_not_depend_on_how_a_request_is_written_and_never_change() -> None:
    """The one encoding enqueue and serve store (canonical_request) is canonical() and fingerprint();
    key order and whitespace change neither; the values are those stores hold already (pinned)."""
    url = "/v1/chat/completions"
    one = orjson.loads(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}')
    two = orjson.loads(b'{ "max_tokens": 8, "messages": [ {"content": "hi", "role": "user"} ], "model": "m" }')
    assert list(one) != list(two)
    for body in (one, two):
        assert canonical_request(url, body) == (canonical(body), fingerprint(url, body))
        assert fingerprint(url, body).hex() == "3ecd87670e8862952609b74c35a3ffc0"
    assert fingerprint("/v1/completions", one) != fingerprint(url, one)
    assert fingerprint(url, orjson.dumps(two)) == fingerprint(url, one)  # JSON bytes are canonicalised
    many = FileFingerprint()
    many.add_many([("a", b"1" * 16), ("b\u00e9", b"2" * 16)])
    each = FileFingerprint()
    each.add("a", b"1" * 16)
    each.add("b\u00e9", b"2" * 16)
    assert many.hexdigest() == each.hexdigest() == "c07a56e1ca0924420de388b16cc9d193"
    assert many.prompts == each.prompts == 2


def test_a_new_store_is_private_and_keeps_its_identity(tmp_path: Path) -> None:
    path = tmp_path / "state" / "r.sqlite"
    s = Store.create_or_open(path, run="r")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert s.db.execute("PRAGMA page_size").fetchone()[0] == 16384  # fewer, bigger pages: faster big enqueues
    sid = s.id
    s.close()
    again = Store.create_or_open(path, run="r")
    assert again.id == sid and again.path == path.absolute()
    again.close()
    with pytest.raises(StoreError, match="store of run 'r', not 'other'"):
        Store.open(path, run="other")


def test_opening_never_creates(tmp_path: Path) -> None:
    with pytest.raises(MissingStore):
        Store.open(tmp_path / "nowhere" / "r.sqlite", run="r", readonly=True)
    assert list(tmp_path.iterdir()) == []
    Store.create_or_open(tmp_path / "r.sqlite", run="r").close()
    ro = Store.open(tmp_path / "r.sqlite", run="r", readonly=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"), ro.write():
        ro.insert_prompts(rows(1))
    ro.close()


def test_a_store_being_created_is_missing_never_half_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head starts before the first enqueue (the Procfile's order) and polls the store's path. Before
    each statement `create_or_open` runs, another connection opens the store as the head does
    (read-write): it must find no store yet (MissingStore: the head waits) or the whole store in WAL mode,
    never a half-made one: tables committed before their meta rows read as "made by another version"
    and the head would exit 2."""
    path = tmp_path / "state" / "r.sqlite"
    seen: list[str] = []
    connect = storefile.connect

    def peek(statement: str) -> None:
        try:
            Store.open(path, run="r").close()
            seen.append("whole")
        except MissingStore:
            seen.append("missing")
        except (StoreError, sqlite3.Error) as exc:
            seen.append(f"refused: {exc}")

    def traced(p: Path, *, readonly: bool) -> sqlite3.Connection:
        db = connect(p, readonly=readonly)
        if p == path.parent / p.name and p.name != path.name:  # the creator's own connection to its new file
            db.set_trace_callback(peek)
        return db

    monkeypatch.setattr(storefile, "connect", traced)  # the connections `create` makes
    Store.create_or_open(path, run="r").close()
    monkeypatch.undo()
    assert len(seen) > 10 and set(seen) == {"missing"}, seen  # every peek came while it was being made
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.sqlite"]  # no temporary file left
    assert path.read_bytes()[18:20] == b"\x02\x02"  # in WAL mode from its first appearance
    Store.open(path, run="r", readonly=True).close()


def test_a_file_system_without_hard_links_still_gets_a_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(storefile.os, "link", no_links)
    path = tmp_path / "state" / "r.sqlite"
    Store.create_or_open(path, run="r").close()
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.sqlite"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes()[18:20] == b"\x02\x02"
    Store.open(path, run="r", readonly=True).close()


def _open_when_it_appears(path: Path, out: Queue) -> None:
    """The head's loop: poll the path, open the store read-write the moment it is there."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            store = Store.open(path, run="r")
        except MissingStore:
            continue
        except (StoreError, sqlite3.Error) as exc:
            out.put(f"opener: {type(exc).__name__}: {exc}")
            return
        out.put(store.id)
        store.close()
        return
    out.put("opener: timed out")


def _create(path: Path, out: Queue) -> None:
    try:
        store = Store.create_or_open(path, run="r")
        out.put(store.id)
        store.close()
    except (StoreError, sqlite3.Error) as exc:
        out.put(f"creator: {type(exc).__name__}: {exc}")


@pytest.mark.slow
def test_two_enqueues_and_two_heads_racing_for_a_new_store_all_get_the_same_one(tmp_path: Path) -> None:
    """Real processes, 300 times: two `create_or_open` (two enqueues) and two openers polling the path
    (heads). Each gets the same store; none gets "database is locked" or a half-made store: the store
    is made aside and linked into place, so no opener meets a file being switched to WAL."""
    ctx = get_context("fork")
    failures: list[str] = []
    for i in range(300):
        path = tmp_path / f"s{i}" / "r.sqlite"
        path.parent.mkdir()
        out = ctx.Queue()
        procs = [ctx.Process(target=_open_when_it_appears, args=(path, out)) for _ in range(2)]
        procs += [ctx.Process(target=_create, args=(path, out)) for _ in range(2)]
        for proc in procs:
            proc.start()
        got = [out.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join(10)
        if len(set(got)) != 1 or any(" " in g for g in got):
            failures.append(f"round {i}: {got}")
        tmp = sorted(p.name for p in path.parent.iterdir() if not p.name.startswith("r.sqlite"))
        if tmp:  # (r.sqlite-wal and -shm may stay: two connections closing at once both leave them)
            failures.append(f"round {i}: temporary files left: {tmp}")
    assert failures == []


def test_an_old_layout_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "r.sqlite")
    db.execute("CREATE TABLE prompts (cid TEXT PRIMARY KEY, seq INTEGER, jid TEXT, src TEXT)")
    db.close()
    with pytest.raises(StoreError, match="not a batchfleet store of this version"):
        Store.open(tmp_path / "r.sqlite", run="r")


def test_insert_is_idempotent_by_custom_id_and_keeps_input_order(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        assert s.insert_prompts(rows(10)) == 10
        assert s.insert_prompts(rows(10)) == 0  # the same custom_ids again: nothing changes
        assert s.insert_prompts(rows(5, start=8)) == 3
    assert s.counts() == {"prompts": 13, "succeeded": 0, "failed": 0, "pending": 13, "waiting": 13, "fed": 0,
                          "cancelled": 0}
    fp = {row[0]: row[6] for row in rows(13)}
    assert s.known(["c0", "c12", "zz"]) == {"c0": (1, 1, 1, 0, fp["c0"]), "c12": (13, 1, 13, 0, fp["c12"])}
    check_tally(s)


def test_feed_order_is_longest_first_then_input_order(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(9))
        first = s.next_to_feed(4)
        assert [row[1] for row in first] == ["c2", "c5", "c8", "c1"]  # max_tokens 48, 48, 48, then 32
        assert first[0][2] == "/v1/completions" and orjson.loads(first[0][3]) == {"prompt": "p2", "max_tokens": 48}
        assert s.set_state([seq for seq, *_ in first], State.WAITING, State.FED) == 4
        assert [row[1] for row in s.next_to_feed(3)] == ["c4", "c7", "c0"]
        assert s.set_state([3], State.WAITING, State.FED) == 0  # c2 is FED already: not moved twice
    assert [cid for _, cid in s.fed()] == ["c1", "c2", "c5", "c8"]
    assert [cid for _, cid in s.fed(after=3, limit=2)] == ["c5", "c8"]
    check_tally(s)


def test_results_success_wins_and_export_keeps_input_order(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(3))
        s.set_state([1, 2, 3], State.WAITING, State.FED)
        assert s.store_results([(3, State.FED, 1, b'"c2 ok"', 10.0), (1, State.FED, 0, b'"c0 failed"', 11.0)]) == 2
        # c0 is retried (`rq requeue`) and succeeds; then a stray late failure of c2 arrives
        assert s.store_results([(1, State.DONE, 1, b'"c0 ok"', 12.0), (3, State.DONE, 0, b'"c2 late"', 13.0)]) == 0
    assert [line for _, line in s.result_rows()] == [b'"c0 ok"', b'"c2 ok"']
    assert s.counts() == {"prompts": 3, "succeeded": 2, "failed": 0, "pending": 1, "waiting": 0, "fed": 1,
                          "cancelled": 0}
    assert s.pending_examples(5) == ["c1"]
    assert not s.fix_tally()
    check_tally(s)


def test_a_drifted_tally_is_repaired(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(4))
        s.db.execute("UPDATE tally SET n = 99 WHERE name = 'waiting'")
        assert s.fix_tally()
    assert s.counts()["waiting"] == 4


def test_expected_cost() -> None:
    assert cost_of({"max_tokens": 64}) == 64
    assert cost_of({"max_completion_tokens": 7}) == 7
    assert cost_of({"prompt": "x"}) == UNBOUNDED_COST


def test_cancel_marks_the_rest_cancelled_and_a_late_result_replaces_its_line(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(5))
        s.set_state([1, 2, 3], State.WAITING, State.FED)
        s.store_results([(1, State.FED, 1, b'"c0 ok"', 10.0)])
        out = s.cancel([State.WAITING, State.FED], lambda cid: f'"{cid} cancelled"'.encode(), at=20.0)
    assert sorted(cid for _, cid in out) == ["c1", "c2", "c3", "c4"]
    assert s.cancelled_at() == 20.0 and not s.in_redis()
    assert s.counts() == {"prompts": 5, "succeeded": 1, "failed": 0, "pending": 0, "waiting": 0, "fed": 0,
                          "cancelled": 4}
    assert [line for _, line in s.result_rows()] == [b'"c0 ok"', b'"c1 cancelled"', b'"c2 cancelled"',
                                                     b'"c3 cancelled"', b'"c4 cancelled"']
    check_tally(s)
    # A worker that finished before it saw the flag: its (real) results replace the cancelled lines.
    with s.write():
        late = [(2, State.CANCELLED, 1, b'"c1 ok"', 19.0), (3, State.CANCELLED, 0, b'"c2 no"', 1.0)]
        assert s.store_results(late) == 2
    assert [line for _, line in s.result_rows()][:3] == [b'"c0 ok"', b'"c1 ok"', b'"c2 no"']
    assert s.counts() == {"prompts": 5, "succeeded": 2, "failed": 1, "pending": 0, "waiting": 0, "fed": 0,
                          "cancelled": 2}
    assert not s.fix_tally()
    check_tally(s)


def test_refeed_puts_only_failed_prompts_back_and_their_next_result_ends_them(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(3))
        s.set_state([1, 2, 3], State.WAITING, State.FED)
        s.store_results([(1, State.FED, 0, b'"c0 failed"', 10.0), (2, State.FED, 1, b'"c1 ok"', 10.0)])
        assert s.refeed(["c0", "c1", "c2", "nope"]) == 1  # c1 succeeded, c2 has no result: untouched
    assert s.counts()["waiting"] == 1 and s.counts()["failed"] == 0
    check_tally(s)
    with s.write():
        s.set_state([1], State.WAITING, State.FED)
        s.store_results([(1, State.FED, 0, b'"c0 failed again"', 11.0)])
    assert next(line for _, line in s.result_rows()) == b'"c0 failed again"'
    assert s.counts() == {"prompts": 3, "succeeded": 1, "failed": 1, "pending": 1, "waiting": 0, "fed": 1,
                          "cancelled": 0}
    check_tally(s)
