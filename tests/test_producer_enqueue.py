"""`producer enqueue` against a real Redis: RQ sees the jobs, bad lines, idempotence, spreading."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis
from rq import Queue
from rq.job import Job

from batchfleet.jobs import GENERATE
from batchfleet.keys import FAILURE_TTL_S, RQ_QUEUES, Keys
from batchfleet.records import job_id_for
from batchfleet.serializer import OrjsonSerializer
from producer.collect import collect_once
from producer.store import Store

from .test_producer_helpers import RUN, Cli, finish, make_cli, queued_ids, simple, write_jsonl

CHAT = "/v1/chat/completions"


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def prompt_rows(tmp_path: Path) -> dict[str, tuple[int, str]]:
    db = sqlite3.connect(tmp_path / "state" / f"{RUN}.sqlite")
    return {cid: (seq, src) for cid, seq, src in db.execute("SELECT cid, seq, src FROM prompts")}


def test_jobs_are_rq_jobs(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"id": "b", "prompt": "Once upon", "temperature": 0.5},
        {"id": 3, "messages": [{"role": "user", "content": "x"}]},
    ])
    rc, out, err = cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--max-tokens", "64", "--no-progress")
    assert rc == 0, err
    assert "3 new" in out
    q0, q1 = (Queue(q, connection=r, serializer=OrjsonSerializer) for q in ("gpu0", "gpu1"))
    assert (q0.count, q1.count) == (2, 1)
    assert r.smembers(RQ_QUEUES) == {b"rq:queue:gpu0", b"rq:queue:gpu1"}

    jid = job_id_for(RUN, "b")
    job = Job.fetch(jid, connection=r, serializer=OrjsonSerializer)
    assert job.func_name == GENERATE
    assert job.description == "generate(b)"
    assert job.origin == "gpu1" and job.get_status() == "queued"
    assert (job.result_ttl, job.failure_ttl, job.timeout) == (0, FAILURE_TTL_S, 3600)
    (prompt,) = job.args
    assert prompt == {"cid": "b", "seq": 1, "url": "/v1/completions", "src": f"{f}:2", "run": "t",
                      "body": {"prompt": "Once upon", "temperature": 0.5, "max_tokens": 64, "model": "default"}}
    # lean: exactly the fields the contract names
    assert set(r.hkeys(Keys.job(jid))) == {b"created_at", b"enqueued_at", b"data", b"origin", b"description",
                                           b"status", b"timeout", b"result_ttl", b"failure_ttl"}
    assert int(r.hget(Keys(RUN).stats, "enqueued")) == 3

    info = subprocess.run([str(Path(sys.executable).parent / "rq"), "info", "--raw", "-u", redis_url,
                           "--only-queues"], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "queue gpu0 2" in info and "queue gpu1 1" in info


def test_bad_lines_go_to_stderr_and_rejects_file(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok1", "prompt": "x"},
        b"{not json",
        {"id": "", "prompt": "x"},
        {"id": "a", "prompt": "x", "messages": []},
        {"id": "b", "prompt": "x", "temprature": 1},
        {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"id": "ok2", "prompt": "y"},
    ])
    rc, _, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 1
    for lineno, reason in [(2, "not JSON"), (3, "id is empty"), (4, "both prompt and messages"),
                           (5, "unknown sampling key 'temprature'"), (6, "unknown url")]:
        assert f"{f}:{lineno}: {reason}" in err
    rejects = [orjson.loads(x) for x in (tmp_path / "in.jsonl.rejects.jsonl").read_bytes().splitlines()]
    assert [x["line"] for x in rejects] == [2, 3, 4, 5, 6]
    assert rejects[0] == {"file": str(f), "line": 2, "reason": rejects[0]["reason"], "text": "{not json"}
    assert len(queued_ids(r, "gpu0")) == 2

    # a clean run replaces the old rejects file, a custom path is honoured
    write_jsonl(f, simple(2))
    assert cli("enqueue", str(f), "--no-progress", "--rejects", str(tmp_path / "r.jsonl"))[0] == 0
    assert not (tmp_path / "r.jsonl").exists()


def test_duplicates_inside_a_file_run_once(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "1"}, {"id": "y", "prompt": "2"},
                                            {"id": "x", "prompt": "3"}])
    rc, out, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 1
    assert f"{f}:3: duplicate custom_id 'x' (first at line 1)" in err
    assert "2 new" in out and "1 duplicates" in out
    assert len(queued_ids(r, "gpu0")) == 2


def test_reenqueue_is_idempotent(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(2500))
    assert cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--no-progress")[0] == 0
    before = (queued_ids(r, "gpu0", "gpu1"), prompt_rows(tmp_path), r.hget(Keys(RUN).stats, "enqueued"))
    rc, out, _ = cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--no-progress")
    assert rc == 0
    assert "0 new, 2,500 already queued or running" in out
    assert (queued_ids(r, "gpu0", "gpu1"), prompt_rows(tmp_path), r.hget(Keys(RUN).stats, "enqueued")) == before
    assert sorted(seq for seq, _ in before[1].values()) == list(range(2500))


def test_finished_prompts_are_not_enqueued_again(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(4))
    cli("enqueue", str(f), "--no-progress")
    a, b, c, _ = queued_ids(r, "gpu0")
    finish(r, a)
    finish(r, b, ok=False)
    collect_once(r, Store(tmp_path / "state" / f"{RUN}.sqlite"), Keys(RUN))
    finish(r, c)  # done in Redis, not collected yet
    rc, out, _ = cli("enqueue", str(f), "--no-progress")
    assert rc == 0
    assert "0 new, 2 already queued or running, 2 already finished" in out
    assert len(queued_ids(r, "gpu0")) == 1


def test_round_robin_and_seq_across_files(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", simple(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", simple(3, "b"))
    out = cli("enqueue", str(a), "--queues", "gpu0,gpu1,gpu2", "--no-progress")[1]
    assert [len(queued_ids(r, q)) for q in ("gpu0", "gpu1", "gpu2")] == [4, 3, 3]
    assert "queues: gpu0 4, gpu1 3, gpu2 3" in out
    cli("enqueue", str(b), "--queues", "gpu0,gpu1,gpu2", "--no-progress")
    rows = prompt_rows(tmp_path)
    assert min(rows[f"b{i}"][0] for i in range(3)) > max(rows[f"a{i}"][0] for i in range(10))
    assert rows["b2"] == (12, f"{b}:3")


def test_streams_from_a_pipe(redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    """The first batch is in Redis while the input is still open: the file is not read whole."""
    env = {"BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_STATE_DIR": str(tmp_path), "BATCHFLEET_RUN": RUN,
           "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "enqueue", "-", "--no-progress"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(b"".join(orjson.dumps(x) + b"\n" for x in simple(1500)))
    proc.stdin.flush()
    deadline = time.monotonic() + 20
    while r.llen(Keys.queue("gpu0")) < 1000:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.stdin.write(b"".join(orjson.dumps(x) + b"\n" for x in simple(500, "q")))
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert r.llen(Keys.queue("gpu0")) == 2000


def test_usage_and_redis_errors_exit_2(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(1))
    assert cli("enqueue", str(tmp_path / "missing.jsonl"))[0] == 2
    rc, _, err = cli("enqueue", str(f), "--param", "bogus=1")
    assert rc == 2 and "unknown sampling key 'bogus'" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = make_cli(f"redis://:sekrit@127.0.0.1:{port}/0", tmp_path / "s2", monkeypatch, capsys)
    rc, _, err = dead("enqueue", str(f))
    assert rc == 2
    assert f"127.0.0.1:{port}" in err and "sekrit" not in err and "***" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_odd_custom_ids_survive_the_script(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    odd = ["a\u0000b", "ünï cödé", "x" * 300, 'q"uote\n']
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": cid, "prompt": "p"} for cid in odd])
    assert cli("enqueue", str(f), "--no-progress")[0] == 0
    for cid in odd:
        job = Job.fetch(job_id_for(RUN, cid), connection=r, serializer=OrjsonSerializer)
        assert job.args[0]["cid"] == cid and job.description == f"generate({cid})"


def test_crash_between_redis_and_store_heals(cli: Cli, r: redis.Redis, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs queued but their rows never committed: the next run finds them present, adds the rows."""
    f = write_jsonl(tmp_path / "in.jsonl", simple(3))

    def crash(*_: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    with monkeypatch.context() as m:
        m.setattr(Store, "add_prompts", crash)
        assert cli("enqueue", str(f), "--no-progress")[0] == 2
    assert len(queued_ids(r, "gpu0")) == 3 and prompt_rows(tmp_path) == {}
    rc, out, _ = cli("enqueue", str(f), "--no-progress")
    assert rc == 0 and "0 new, 3 already queued or running" in out
    assert len(queued_ids(r, "gpu0")) == 3 and sorted(prompt_rows(tmp_path)) == ["p0", "p1", "p2"]
