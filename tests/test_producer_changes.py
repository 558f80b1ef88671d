"""A known custom_id whose line now asks another request: refused by default (nothing stored), rerun
with `--rerun-changed` (only those prompts; the late answer of a replaced request is never taken for
the new one's); which input a run came from; a store made before fingerprints. Real Redis, the
worker's own Ledger as the worker (no server)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from batchfleet.jobs import job_id_for, parse_job_data
from batchfleet.keys import Keys
from batchfleet.records import Prompt, Result
from producer.fingerprint import FileFingerprint, fingerprint
from producer.store import Store
from worker.ledger import Ledger

from .test_producer_helpers import RUN, Cli, job_prompt, make_cli, queued_ids, summary, write_jsonl

COMPLETIONS = "/v1/completions"


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def prompts(**texts: str) -> list[object]:
    return [{"id": cid, "prompt": text, "max_tokens": 8} for cid, text in texts.items()]


def serve(redis_url: str, *, fail: frozenset[str] = frozenset(), between: Callable[[], None] = lambda: None,
          fp_of: Callable[[Prompt], str] = lambda p: p.fp) -> list[Prompt]:
    """Play a worker on gpu0: claim every queued job, call `between` (the jobs are in flight then),
    then finish each one: its answer is its prompt's text (a failure for the custom_ids in `fail`),
    its fingerprint `fp_of(prompt)` (a worker echoes the prompt's)."""

    async def go() -> list[Prompt]:
        client = aioredis.from_url(redis_url)
        ledger = Ledger(client, Keys(RUN), worker="w0", lease_ttl_s=600)
        try:
            claims = await ledger.claim(1000, ["gpu0"])
            got = [Prompt.from_dict(parse_job_data(c.data)[1][0]) for c in claims]
            between()
            for c, p in zip(claims, got, strict=True):
                if p.cid in fail:
                    res = Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=400, fp=fp_of(p),
                                 body={"object": "error", "message": "too long", "code": 400},
                                 error={"code": "invalid_prompt", "message": "HTTP 400: too long"})
                else:
                    res = Result(cid=p.cid, jid=c.jid, seq=p.seq, status_code=200, fp=fp_of(p),
                                 body={"choices": [{"text": p.body["prompt"]}], "usage": {"completion_tokens": 1}})
                ledger.finish(c, res, exc_string="invalid_prompt: too long" if p.cid in fail else "")
            await ledger.flush()
            return got
        finally:
            await client.aclose()

    return asyncio.run(go())


def exported(cli: Cli, tmp_path: Path) -> tuple[int, dict[str, dict]]:
    out = tmp_path / "out.jsonl"
    rc, _, err = cli("export", str(out))
    assert rc in (0, 1), err
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids))  # 0 duplicated
    return rc, {x["custom_id"]: x for x in lines}


def answer(line: dict) -> object:
    resp = line["response"]
    return resp["body"]["choices"][0]["text"] if resp["status_code"] == 200 else resp["status_code"]


def db_rows(tmp_path: Path) -> dict[str, tuple[int, bytes]]:
    db = sqlite3.connect(tmp_path / "state" / f"{RUN}.sqlite")
    return {cid: (state, body) for cid, state, body in db.execute("SELECT cid, state, body FROM prompts")}


def test_a_file_whose_requests_changed_is_refused_and_rerun_changed_reruns_only_those(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    for d in ("dA", "dB"):
        (tmp_path / d).mkdir()
    a = write_jsonl(tmp_path / "dA" / "prompts.jsonl", prompts(p0="a0", p1="a1", p2="a2", p3="a3"))
    assert cli("enqueue", str(a), "--queues", "gpu0", "--no-progress")[0] == 0
    serve(redis_url, fail=frozenset({"p3"}))
    assert cli("collect")[0] == 0
    rc, before = exported(cli, tmp_path)
    assert rc == 0 and {c: answer(x) for c, x in before.items()} == {"p0": "a0", "p1": "a1", "p2": "a2", "p3": 400}

    # another file of the same name: p1 and p3 ask something else, p4 is new
    b = write_jsonl(tmp_path / "dB" / "prompts.jsonl", prompts(p0="a0", p1="b1", p2="a2", p3="b3", p4="b4"))
    stored, stats = db_rows(tmp_path), r.hgetall(Keys(RUN).stats)
    rc, out, err = cli("enqueue", str(b), "--queues", "gpu0", "--no-progress")
    assert rc == 2, out + err
    assert err.startswith(f"producer: {b}:2: custom_id 'p1' is in the store of run {RUN} with a different request; "
                          f"2 custom_ids differ in all; nothing of {b} was enqueued")
    assert "--run NAME" in err and "--rerun-changed" in err and len(err.strip().splitlines()) == 1
    # nothing of the file was stored or fed, and no stored answer went out as its answer
    assert db_rows(tmp_path) == stored and r.hgetall(Keys(RUN).stats) == stats and queued_ids(r, "gpu0") == []
    assert exported(cli, tmp_path) == (0, before)

    rc, out, err = cli("enqueue", str(b), "--queues", "gpu0", "--no-progress", "--rerun-changed")
    assert rc == 0, err
    assert summary(out) == (5, "1 new, 0 already in the store, 2 already finished, 2 changed (run again), "
                               "0 rejected, 0 duplicates")
    # the changed ones wait with their new request (p3's failed job left RQ's registry for the new one)
    assert sorted(queued_ids(r, "gpu0")) == sorted(job_id_for(RUN, c) for c in ("p1", "p3", "p4"))
    for cid, text in (("p1", "b1"), ("p3", "b3")):
        p = job_prompt(r, job_id_for(RUN, cid))
        assert p.body["prompt"] == text and p.fp == fingerprint(COMPLETIONS, p.body).hex()
    rc, partial = exported(cli, tmp_path)
    assert rc == 1 and {c: answer(x) for c, x in partial.items()} == {"p0": "a0", "p2": "a2"}  # old results gone

    assert sorted(p.cid for p in serve(redis_url)) == ["p1", "p3", "p4"]  # only those ran again
    assert cli("collect")[0] == 0
    rc, after = exported(cli, tmp_path)
    assert rc == 0 and {c: answer(x) for c, x in after.items()} == {"p0": "a0", "p1": "b1", "p2": "a2", "p3": "b3",
                                                                   "p4": "b4"}
    assert list(after) == ["p0", "p1", "p2", "p3", "p4"]  # input order, one line each
    st = orjson.loads(cli("status", "--json")[1])
    assert (st["totals"]["prompts"], st["totals"]["succeeded"], st["totals"]["pending"]) == (5, 5, 0)


def test_a_late_answer_to_a_replaced_request_is_never_taken_for_the_new_one(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "in.jsonl", prompts(p0="a0", p1="a1", p2="a2"))
    assert cli("enqueue", str(a), "--queues", "gpu0", "--no-progress")[0] == 0
    b = write_jsonl(tmp_path / "in2.jsonl", prompts(p0="b0", p1="b1", p2="a2"))
    said: list[str] = []

    def rerun_while_in_flight() -> None:
        rc, out, err = cli("enqueue", str(b), "--queues", "gpu0", "--no-progress", "--rerun-changed")
        assert rc == 0, err
        said.append(out)

    # p0..p2 are in flight on a worker when p0 and p1 are replaced; then they finish: p0 echoes its old
    # request's fingerprint, p1 none (a worker older than fingerprints), p2 none (its request stands)
    old = serve(redis_url, between=rerun_while_in_flight, fp_of=lambda p: p.fp if p.cid == "p0" else "")
    assert [p.body["prompt"] for p in old] == ["a0", "a1", "a2"] and "2 changed (run again)" in said[0]
    rc, out, err = cli("collect")
    assert rc == 0 and "collected 1 succeeded" in out
    assert "dropped 2 late result(s) of requests `enqueue --rerun-changed` replaced" in err
    assert (r.xlen(Keys(RUN).results), r.scard(Keys(RUN).done)) == (0, 0)
    rc, partial = exported(cli, tmp_path)
    assert rc == 1 and {c: answer(x) for c, x in partial.items()} == {"p2": "a2"}

    # the replaced ones wait in the store again; a feed pass gives them their new request
    assert cli("recover")[0] == 0
    again = serve(redis_url)
    assert sorted((p.cid, p.body["prompt"]) for p in again) == [("p0", "b0"), ("p1", "b1")]
    assert cli("collect")[0] == 0
    rc, done = exported(cli, tmp_path)
    assert rc == 0 and {c: answer(x) for c, x in done.items()} == {"p0": "b0", "p1": "b1", "p2": "a2"}


def test_a_late_failure_of_a_replaced_request_leaves_rq_so_the_new_request_is_fed(
        cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "in.jsonl", prompts(p0="a0"))
    assert cli("enqueue", str(a), "--queues", "gpu0", "--no-progress")[0] == 0
    b = write_jsonl(tmp_path / "in2.jsonl", prompts(p0="b0"))

    def rerun() -> None:
        assert cli("enqueue", str(b), "--queues", "gpu0", "--no-progress", "--rerun-changed")[0] == 0

    serve(redis_url, fail=frozenset({"p0"}), between=rerun)  # the old request fails (a job in RQ's failed registry)
    assert r.zcard(Keys.failed("gpu0")) == 1
    assert cli("collect")[0] == 0
    assert r.zcard(Keys.failed("gpu0")) == 0 and not r.exists(Keys.job(job_id_for(RUN, "p0")))
    assert cli("recover")[0] == 0
    assert [p.body["prompt"] for p in serve(redis_url)] == ["b0"]
    assert cli("collect")[0] == 0
    assert {c: answer(x) for c, x in exported(cli, tmp_path)[1].items()} == {"p0": "b0"}


def test_within_a_file_and_on_resume_a_custom_id_again_is_a_duplicate_or_a_rejected_line(
        cli: Cli, redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [*prompts(x="1", y="2"), *prompts(x="1"), *prompts(y="other")])
    rc, out, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 1 and summary(out) == (4, "2 new, 0 already in the store, 0 already finished, 1 rejected, "
                                           "1 duplicates")
    assert f"{f}:3: duplicate custom_id 'x' (first at line 1)" in err
    assert f"{f}:4: custom_id 'y' is already on line 2 with a different request" in err
    serve(redis_url)
    assert cli("collect")[0] == 0
    rc, out, err = cli("enqueue", str(f), "--no-progress")  # the same on resume: never "already finished"
    assert rc == 1 and summary(out) == (4, "0 new, 0 already in the store, 2 already finished, 1 rejected, "
                                           "1 duplicates")
    assert f"{f}:4: custom_id 'y' is already on line 2 with a different request" in err


def test_runs_and_status_name_the_input_and_the_fingerprint_of_its_requests(cli: Cli, tmp_path: Path) -> None:
    rows = prompts(p0="a0", p1="a1", p2="a2")
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    # the same requests written otherwise: keys in another order, spaces, CRLF, a blank line
    same = b"\r\n".join(orjson.dumps({"max_tokens": 8, "prompt": x["prompt"], "id": x["id"]}).replace(b",", b", ")
                        for x in rows) + b"\r\n\r\n"
    (tmp_path / "b.jsonl").write_bytes(same)
    assert cli("enqueue", str(a), "--no-progress")[0] == 0
    expected = FileFingerprint()
    for x in rows:
        expected.add(x["id"], fingerprint(COMPLETIONS, {"prompt": x["prompt"], "max_tokens": 8, "model": "default"}))
    fp = expected.hexdigest()
    (run,) = orjson.loads(cli("runs", "--json")[1])
    assert [(i["name"], i["path"], i["fingerprint"], i["prompts"]) for i in run["inputs"]] == [
        (str(a), str(a.absolute()), fp, 3)]
    rc, out, _ = cli("enqueue", str(tmp_path / "b.jsonl"), "--no-progress")
    assert rc == 0 and "3 already in the store" in out
    st = orjson.loads(cli("status", "--json")[1])
    assert [i["fingerprint"] for i in st["inputs"]] == [fp, fp]
    assert f"input {(tmp_path / 'b.jsonl').absolute()} (requests {fp[:12]}, 3 prompts)" in cli("status")[1]
    assert f"{RUN}: input {(tmp_path / 'b.jsonl').absolute()} (requests {fp[:12]}, 3 prompts) (+1 earlier)" \
        in cli("runs")[1]
    # a refused file is not an input of the run
    assert cli("enqueue", str(write_jsonl(tmp_path / "c.jsonl", prompts(p0="changed"))), "--no-progress")[0] == 2
    assert len(orjson.loads(cli("status", "--json")[1])["inputs"]) == 2


# The layout of a store made before fingerprints (schema 2), as that batchfleet wrote it.
SCHEMA_2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE files (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE prompts (seq INTEGER PRIMARY KEY, cid TEXT NOT NULL UNIQUE, ep INTEGER NOT NULL, body BLOB NOT NULL,
                      file INTEGER NOT NULL, line INTEGER NOT NULL, cost INTEGER NOT NULL,
                      state INTEGER NOT NULL DEFAULT 0);
CREATE INDEX prompts_waiting ON prompts(cost DESC, seq) WHERE state = 0;
CREATE INDEX prompts_fed ON prompts(seq) WHERE state = 1;
CREATE TABLE results (seq INTEGER PRIMARY KEY, ok INTEGER NOT NULL, line BLOB NOT NULL, finished_at REAL NOT NULL);
CREATE TABLE tally (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
"""


def test_a_store_made_before_fingerprints_keeps_working_and_is_migrated(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "state" / f"{RUN}.sqlite"
    path.parent.mkdir(mode=0o700)
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_2)
    db.executemany("INSERT INTO meta VALUES (?, ?)", [("schema", "2"), ("store_id", "0" * 32), ("run", RUN),
                                                      ("created", "1.0"), ("host", "h"), ("rejected_results", "0")])
    db.execute("INSERT INTO files VALUES (1, 'old.jsonl')")
    bodies = [{"prompt": f"a{i}", "max_tokens": 8, "model": "default"} for i in range(2)]
    db.executemany("INSERT INTO prompts (cid, ep, body, file, line, cost, state) VALUES (?, 1, ?, 1, ?, 8, ?)",
                   [("p0", orjson.dumps(bodies[0]), 1, 2), ("p1", orjson.dumps(bodies[1]), 2, 0)])
    jid = job_id_for(RUN, "p0")
    old_line = {"id": f"batch_req_{jid}", "custom_id": "p0", "response": {"status_code": 400, "request_id": jid,
                "body": None}, "error": {"code": "invalid_prompt", "message": "HTTP 400: too long"}}
    db.execute("INSERT INTO results VALUES (1, 0, ?, 5.0)", (orjson.dumps(old_line),))
    db.executemany("INSERT INTO tally VALUES (?, ?)", [("waiting", 1), ("fed", 0), ("done", 1), ("ok", 0),
                                                       ("cancelled", 0)])
    db.commit()
    db.close()

    ro = Store.open(path, run=RUN, readonly=True)  # read as it is where it cannot be migrated
    assert ro.schema == "2" and ro.inputs() == [] and ro.counts()["prompts"] == 2
    ro.close()
    st = orjson.loads(cli("status", "--json")[1])
    assert st["totals"]["prompts"] == 2 and st["inputs"] == []

    f = write_jsonl(tmp_path / "in.jsonl", prompts(p0="a0", p1="a1"))
    rc, out, err = cli("enqueue", str(f), "--no-progress")  # the stored requests' fingerprints, from their bodies
    assert rc == 0, err
    assert summary(out) == (2, "0 new, 1 already in the store, 1 already finished, 0 rejected, 0 duplicates")
    store = Store.open(path, run=RUN, readonly=True)
    assert store.schema == "4" and [i.fp for i in store.inputs()] != []  # migrated to this layout
    (line,) = [orjson.loads(x) for x in (line for _, line in store.result_rows())]
    assert line == {"id": f"batch_req_{jid}", "custom_id": "p0", "error": None, "response": {
        "status_code": 400, "request_id": jid, "body": {"error": {"message": "HTTP 400: too long"}}}}
    store.close()
    rc, _, err = cli("enqueue", str(write_jsonl(tmp_path / "in2.jsonl", prompts(p0="a0", p1="b1"))), "--no-progress")
    assert rc == 2 and "in2.jsonl:2: custom_id 'p1' is in the store" in err
