"""`batchfleet serve`'s parts without its HTTP server: the store's spans (a batch's counts, export and
cancel), the feed order of a store ordered by input, and the batch engine against a real Redis, with
the worker's own Ledger playing the workers (tests/test_producer_helpers.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import redis

from batchapi.engine import COUNT_EVERY_S, Engine, Limits
from batchapi.objects import BatchRecord, BatchStatus, FileRecord, new_batch_id, new_file_id
from batchapi.registry import Registry
from batchapi.server import prepare_store
from batchfleet.config import Config
from batchfleet.jobs import job_id_for
from batchfleet.keys import Keys
from batchfleet.records import Result
from producer.collect import collect_once
from producer.ends import cancel_prompts, cancelled_line
from producer.export import write_export
from producer.feed import feed_pass
from producer.store import Span, State, Store, StoreError

from .test_producer_helpers import work
from .test_store import rows

RUN = "sv"


def test_a_span_has_its_own_counts_export_and_cancel(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(4))  # seqs 1-4: one input
        s.insert_prompts(rows(3, start=4, file_id=2))  # seqs 5-7: another
        s.set_state([1, 2, 5, 6], State.WAITING, State.FED)
        s.store_results([(1, State.FED, 1, b'"c0 ok"', 1.0), (2, State.FED, 0, b'"c1 failed"', 1.0),
                         (5, State.FED, 1, b'"c4 ok"', 1.0)])
    first, second = Span(1, 4), Span(5, 7)
    with s.read():
        assert s.counts_in(first, 1) == {"prompts": 4, "succeeded": 1, "failed": 1, "pending": 2, "waiting": 2,
                                      "fed": 0, "cancelled": 0}
        assert s.counts_in(second, 2) == {"prompts": 3, "succeeded": 1, "failed": 0, "pending": 2, "waiting": 1,
                                       "fed": 1, "cancelled": 0}
        assert s.fed_cids(second) == ["c5"] and s.fed_cids() == ["c5"]
    with s.write():
        out = s.cancel([State.WAITING, State.FED], lambda cid: f'"{cid} cancelled"'.encode(), 9.0, span=first)
    assert [cid for _, cid in out] == ["c2", "c3"]
    assert s.cancelled_at() is None  # the run goes on: the other input is still fed
    with s.read():
        assert s.counts_in(first, 1)["pending"] == 0 and s.counts_in(first, 1)["cancelled"] == 2
        assert s.counts_in(second, 2)["pending"] == 2
    w = write_export(s, tmp_path / "out.jsonl", errors=tmp_path / "err.jsonl", span=(first, 1), private=True,
                     rewrite=lambda line: line.replace(b'"c', b'"x'))
    assert (tmp_path / "out.jsonl").read_bytes() == b'"x0 ok"\n'
    assert (tmp_path / "err.jsonl").read_bytes() == b'"x1 failed"\n"x2 cancelled"\n"x3 cancelled"\n'
    assert (w.written, w.errors_written, w.succeeded, w.failed, w.cancelled) == (1, 3, 1, 1, 2)
    assert (tmp_path / "out.jsonl").stat().st_mode & 0o777 == 0o600
    with s.read():
        assert s.span_of("c") == (Span(1, 7), 7)


def test_a_store_ordered_by_input_feeds_an_older_input_before_a_newer_one(tmp_path: Path) -> None:
    s = Store.create_or_open(tmp_path / "r.sqlite", run="r")
    with s.write():
        s.insert_prompts(rows(3, file_id=1))  # max_tokens 16, 32, 48
        s.insert_prompts(rows(3, start=3, file_id=2))
    with s.write():
        by_cost = [cid for _, cid, *_ in s.next_to_feed(6)]
        s.order_feed_by_input()
        by_input = [cid for _, cid, *_ in s.next_to_feed(6)]
    assert by_cost == ["c2", "c5", "c1", "c4", "c0", "c3"]  # longest first over the whole run
    assert by_input == ["c2", "c1", "c0", "c5", "c4", "c3"]  # the first input first, longest first within it
    plan = s.db.execute("EXPLAIN QUERY PLAN SELECT seq FROM prompts WHERE state = 0 ORDER BY file, cost DESC, seq "
                        "LIMIT 5").fetchall()
    assert "prompts_waiting_input" in str(plan) and "TEMP B-TREE" not in str(plan)
    # a span's counts read indexes of what they count, never the span's rows (a poll stays cheap)
    traced: list[str] = []
    s.db.set_trace_callback(traced.append)
    with s.read():
        assert s.counts_in(Span(4, 6), 2)["waiting"] == 3
    s.db.set_trace_callback(None)
    for sql in (q for q in traced if q.startswith("SELECT")):
        plan = str(s.db.execute("EXPLAIN QUERY PLAN " + sql).fetchall())
        assert "USING INDEX" in plan.replace("COVERING ", "") and "SCAN" not in plan, (sql, plan)


# --- the engine ------------------------------------------------------------------------------------------
def requests(n: int, *, start: int = 0, url: str = "/v1/completions") -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": url,
                                  "body": {"model": "m", "prompt": f"text {i}", "max_tokens": 8}}) + b"\n"
                    for i in range(start, start + n))


class Rig:
    """The API's registry, the batch engine (driven pass by pass) and the run's store, in this process."""

    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.config = Config(redis_url=redis_url, run=RUN, state_dir=tmp / "state")
        self.r = redis.Redis.from_url(redis_url)
        self.store_path = prepare_store(self.config, self.r, ("gpu0",))
        self.registry = Registry(self.config.state_dir, RUN)
        self.engine = Engine(self.config, self.registry, self.store_path, self.r, Limits(model="m"), queues=("gpu0",))
        self.engine.open()
        assert self.engine.store is not None
        self.store: Store = self.engine.store

    def batch(self, data: bytes, *, owner: str = "") -> BatchRecord:
        fid = new_file_id()
        self.registry.file_path(fid).write_bytes(data)
        self.registry.add_file(FileRecord(id=fid, owner=owner, filename="in.jsonl", bytes=len(data), purpose="batch",
                                          created_at=int(time.time())))
        now = int(time.time())
        b = BatchRecord(id=new_batch_id(), owner=owner, input_file_id=fid, endpoint="/v1/completions",
                        completion_window="24h", created_at=now, expires_at=now + 3600)
        self.registry.put_batch(b)
        return b

    def now(self, b: BatchRecord) -> BatchRecord:
        return self.registry.batches[b.id]

    def cancel(self, b: BatchRecord) -> None:
        """What POST /v1/batches/{id}/cancel does to the record."""
        self.registry.update(b.id, lambda cur: replace(cur, status=BatchStatus.CANCELLING,
                                                       cancelling_at=int(time.time())))


def test_a_cancelled_batch_keeps_what_finished_drops_the_rest_and_a_late_result_never_enters_its_files(
        tmp_path: Path, redis_url: str) -> None:
    rig = Rig(tmp_path, redis_url)
    a, b = rig.batch(requests(6)), rig.batch(requests(4))  # the same custom_ids in both
    rig.engine.step()
    rig.engine.step()
    a, b = rig.now(a), rig.now(b)
    assert (a.status, a.total, b.status, b.total) == (BatchStatus.IN_PROGRESS, 6, BatchStatus.IN_PROGRESS, 4)
    assert feed_pass(rig.config, rig.r, rig.store, ("gpu0",)).total == 10
    keys = Keys(RUN)
    done = work(redis_url, ["gpu0"], 2, run=RUN)  # the oldest batch's first two: answered
    assert [res.cid for res in done] == [f"{a.id}:r0", f"{a.id}:r1"]
    work(redis_url, ["gpu0"], 2, hold=True, run=RUN)  # its next two: in flight on a worker that will not drop them
    held = [job_id_for(RUN, f"{a.id}:r{i}") for i in (2, 3)]
    sub = rig.r.pubsub()
    sub.subscribe(keys.signals)
    assert sub.get_message(timeout=5)["type"] == "subscribe"

    rig.cancel(a)
    rig.engine.step()
    a = rig.now(a)
    assert a.status is BatchStatus.CANCELLED and a.cancelled_at is not None
    assert (a.total, a.completed, a.failed) == (6, 2, 0)  # the cancelled ones are not failures
    out = rig.registry.file_path(a.output_file_id).read_bytes()
    err = rig.registry.file_path(a.error_file_id).read_bytes()
    assert [orjson.loads(x)["custom_id"] for x in out.splitlines()] == ["r0", "r1"]
    assert [(x["custom_id"], x["error"]["code"]) for x in map(orjson.loads, err.splitlines())] == [
        (f"r{i}", "batch_cancelled") for i in range(2, 6)]
    assert a.usage == {"input_tokens": 6, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 20,
                       "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 26}
    # The workers were told which prompts to drop: those in flight (the queued ones are gone from the queue).
    assert rig.r.sismember(keys.drop, held[0]) and rig.r.sismember(keys.drop, held[1])
    assert orjson.loads(sub.get_message(timeout=5)["data"]) == {"drop": 2}  # the two in flight
    assert 0 < rig.r.ttl(keys.drop) <= 24 * 3600
    # The other batch runs on: not cancelled, its prompts still queued; the run is not cancelled.
    assert rig.now(b).status is BatchStatus.IN_PROGRESS and not rig.r.exists(keys.cancel)
    assert rig.store.cancelled_at() is None and len(rig.r.lrange(Keys.queue("gpu0"), 0, -1)) == 4

    # A worker that never dropped its prompt gets a result in anyway: the store takes it, the batch's files
    # and counts do not change.
    late = Result(cid=f"{a.id}:r2", jid=held[0], seq=3, status_code=200, worker="w9",
                  body={"choices": [{"text": "late"}], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    rig.r.xadd(keys.results, {"r": late.to_json()})
    rig.r.sadd(keys.done, held[0])
    head = Store.open(rig.store_path, run=RUN)  # the head collects, in its own process
    assert collect_once(rig.r, head, keys).succeeded == 1
    with rig.store.read():
        assert rig.store.counts_in(Span(a.lo, a.hi), a.input_id)["succeeded"] == 3  # the store took it
    rig.engine.step()
    a2 = rig.now(a)
    assert (a2.status, a2.completed, a2.usage) == (a.status, 2, a.usage)
    assert rig.registry.file_path(a.output_file_id).read_bytes() == out
    assert rig.registry.file_path(a.error_file_id).read_bytes() == err

    # The other batch completes; its custom_ids come back without the batch's prefix.
    work(redis_url, ["gpu0"], run=RUN)
    collect_once(rig.r, head, keys)
    deadline = time.monotonic() + COUNT_EVERY_S + 10
    while (b := rig.now(b)).status is BatchStatus.IN_PROGRESS:  # counted again within COUNT_EVERY_S
        assert time.monotonic() < deadline, b
        rig.engine.step()
        time.sleep(0.05)
    assert b.status is BatchStatus.COMPLETED and b.error_file_id is None and (b.completed, b.failed) == (4, 0)
    assert b.in_progress_at <= b.finalizing_at <= b.completed_at
    lines = [orjson.loads(x) for x in rig.registry.file_path(b.output_file_id).read_bytes().splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2", "r3"]


def test_a_bad_line_fails_the_batch_with_its_line_number_and_stores_nothing(tmp_path: Path, redis_url: str) -> None:
    rig = Rig(tmp_path, redis_url)
    chat = orjson.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}}) + b"\n"
    bad = requests(2) + b"not json\n" + chat + requests(1, start=1) + b'{"id": "s", "prompt": "simple form"}\n'

    b = rig.batch(bad)
    rig.engine.step()
    b = rig.now(b)
    assert b.status is BatchStatus.FAILED and b.failed_at is not None and b.in_progress_at is None
    assert [(e["line"], e["code"]) for e in b.errors] == [
        (3, "invalid_json_line"), (4, "invalid_url"), (5, "duplicate_custom_id"), (6, "invalid_request")]
    assert "custom_id 'r1' is already on line 2" in b.errors[2]["message"]
    with rig.store.read():
        assert rig.store.counts()["prompts"] == 0  # nothing of it in the store
    good = rig.batch(requests(3))
    rig.engine.step()
    assert rig.now(good).status is BatchStatus.IN_PROGRESS and (rig.now(good).lo, rig.now(good).hi) == (1, 3)


def test_a_batch_over_the_request_limit_fails_and_a_batch_stored_before_a_crash_is_found_again(
        tmp_path: Path, redis_url: str) -> None:
    rig = Rig(tmp_path, redis_url)
    rig.engine.limits.max_requests = 3
    over = rig.batch(requests(4))
    rig.engine.step()
    assert [(e["line"], e["code"]) for e in rig.now(over).errors] == [(4, "too_many_requests")]
    b = rig.batch(requests(3))
    rig.engine.step()
    stored = rig.now(b)
    assert stored.status is BatchStatus.IN_PROGRESS
    # serve killed after the store's commit, before the record said so: validated again, found, not stored twice
    rig.registry.put_batch(replace(stored, status=BatchStatus.VALIDATING, in_progress_at=None, input_id=None,
                                   lo=None, hi=None, total=0))
    rig.engine.step()
    again = rig.now(b)
    assert (again.status, again.lo, again.hi, again.total) == (BatchStatus.IN_PROGRESS, stored.lo, stored.hi, 3)
    with rig.store.read():
        assert rig.store.counts()["prompts"] == 3


def test_cancel_prompts_of_the_whole_run_still_flags_it_and_tells_the_workers_what_to_drop(
        tmp_path: Path, redis_url: str) -> None:
    """The run-wide cancel (`producer cancel`) is the span-less case of the same steps: the flag, and the
    in-flight prompts announced for the workers to drop."""
    rig = Rig(tmp_path, redis_url)
    b = rig.batch(requests(3))
    rig.engine.step()
    feed_pass(rig.config, rig.r, rig.store, ("gpu0",))
    work(redis_url, ["gpu0"], 2, hold=True, run=RUN)
    sub = rig.r.pubsub()
    sub.subscribe(Keys(RUN).signals)
    sub.get_message(timeout=5)
    s = cancel_prompts(rig.r, rig.store, Keys(RUN), lambda cid: cancelled_line(RUN, cid, 1.0), 1.0)
    assert s.cancelled == 3 and s.removed == {"queued": 1, "in_flight": 2}
    assert rig.r.hget(Keys(RUN).cancel, "at") is not None and rig.store.cancelled_at() == 1.0
    assert rig.r.smembers(Keys(RUN).drop) == {job_id_for(RUN, f"{b.id}:r{i}").encode() for i in (0, 1)}
    assert orjson.loads(sub.get_message(timeout=5)["data"]) == {"drop": 2}
    with pytest.raises(StoreError, match="run sv was cancelled"):  # serve will not take batches it cannot run
        prepare_store(rig.config, rig.r, ("gpu0",))
