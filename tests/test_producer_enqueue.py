"""`producer enqueue` against a real Redis: every prompt into the store, a window into Redis as RQ jobs,
bad lines, idempotence, Ctrl-C, the run marker."""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq import Queue
from rq.job import Job

from batchfleet.jobs import GENERATE, job_id_for
from batchfleet.keys import RQ_QUEUES, Keys
from batchfleet.records import Prompt
from batchfleet.serializer import OrjsonSerializer
from producer import parse as parse_module
from producer.collect import collect_once
from producer.fingerprint import fingerprint
from producer.locate import HOST
from producer.store import Store

from .test_producer_helpers import RUN, Cli, job_prompt, make_cli, queued_ids, simple, work, write_jsonl

CHAT = "/v1/chat/completions"


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def store_rows(tmp_path: Path) -> dict[str, tuple[int, int, int]]:
    """cid -> (seq, line, state), read straight from the SQLite file."""
    db = sqlite3.connect(tmp_path / "state" / f"{RUN}.sqlite")
    rows = db.execute("SELECT cid, seq, line, state FROM prompts")
    return {cid: (seq, line, state) for cid, seq, line, state in rows}


def rq_info(redis_url: str) -> dict[str, int]:
    out = subprocess.run([str(Path(sys.executable).parent / "rq"), "info", "--raw", "-u", redis_url, "--only-queues"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return {line.split()[1]: int(line.split()[2].rstrip(",")) for line in out.splitlines() if line.startswith("queue ")}


def test_jobs_are_lean_rq_jobs_and_the_run_is_marked(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"id": "b", "prompt": "Once upon", "temperature": 0.5},
        {"id": 3, "messages": [{"role": "user", "content": "x"}]},
    ])
    rc, out, err = cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--max-tokens", "64", "--no-progress")
    assert rc == 0, err
    assert "3 new" in out and "fed to Redis: gpu0 2, gpu1 1" in out
    q0, q1 = (Queue(q, connection=r, serializer=OrjsonSerializer) for q in ("gpu0", "gpu1"))
    assert (q0.count, q1.count) == (2, 1)
    assert r.smembers(RQ_QUEUES) == {b"rq:queue:gpu0", b"rq:queue:gpu1"}
    assert rq_info(redis_url) == {"gpu0": 2, "gpu1": 1}

    jid = job_id_for(RUN, "b")
    job = Job.fetch(jid, connection=r, serializer=OrjsonSerializer)
    assert job.func_name == GENERATE and job.get_status() == "queued" and job.origin in ("gpu0", "gpu1")
    (prompt,) = job.args
    body = {"prompt": "Once upon", "temperature": 0.5, "max_tokens": 64, "model": "default"}
    assert Prompt.from_dict(prompt) == Prompt(cid="b", seq=2, url="/v1/completions", run=RUN, body=body,
                                              fp=fingerprint("/v1/completions", body).hex())
    # lean: the fields RQ needs (data for Job.restore, origin for `rq requeue`, status for get_status)
    assert set(r.hkeys(Keys.job(jid))) == {b"data", b"origin", b"status"}
    assert int(r.hget(Keys(RUN).stats, "enqueued")) == 3

    marker = {k.decode(): v.decode() for k, v in r.hgetall(Keys(RUN).meta).items()}
    store = Store.open(tmp_path / "state" / f"{RUN}.sqlite", run=RUN, readonly=True)
    assert marker == {"store_id": store.id, "host": HOST, "path": str(store.path), "created": repr(store.created),
                      "queues": "gpu0,gpu1"}


def test_the_store_holds_the_run_redis_a_window(redis_url: str, r: redis.Redis, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cli = make_cli(redis_url, tmp_path / "state", monkeypatch, capsys, env={"BATCHFLEET_WINDOW_DEFAULT": "40"})
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": "x", "max_tokens": 16 * (1 + i % 5)}
                                            for i in range(1000)])
    rc, out, _ = cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--no-progress")
    assert rc == 0
    assert "1,000 new" in out and "fed to Redis: gpu0 40, gpu1 40" in out and "920 prompt(s) wait in the store" in out
    assert rq_info(redis_url) == {"gpu0": 40, "gpu1": 40}
    assert len(r.keys("rq:job:*")) == 80
    rows = store_rows(tmp_path)
    assert len(rows) == 1000 and sum(1 for _, _, st in rows.values() if st == 1) == 80
    # the window is the longest expected work: every fed prompt has max_tokens 80, dealt over both queues
    fed = [job_prompt(r, j) for j in queued_ids(r, "gpu0", "gpu1")]
    assert {p.body["max_tokens"] for p in fed} == {80}
    assert [p.seq for p in fed[:3]] == [5, 15, 25]  # gpu0's head, in input order
    # enqueueing more adds to the store; Redis does not grow past the window
    g = write_jsonl(tmp_path / "more.jsonl", simple(500, "q", max_tokens=999))
    assert cli("enqueue", str(g), "--no-progress")[0] == 0
    assert rq_info(redis_url) == {"gpu0": 40, "gpu1": 40}
    assert len(store_rows(tmp_path)) == 1500


def test_bad_lines_go_to_stderr_and_rejects_file(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ok1", "prompt": "x"},
        b"{not json",
        {"id": "", "prompt": "x"},
        {"id": "a", "prompt": "x", "messages": []},
        {"id": "b", "prompt": "x", "temprature": 1},
        {"custom_id": "c", "method": "POST", "url": "/v1/responses", "body": {"input": "x"}},
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
    assert len(queued_ids(r, "gpu0")) == 2 and sorted(store_rows(tmp_path)) == ["ok1", "ok2"]

    # a clean run replaces the old rejects file, a custom path is honoured
    write_jsonl(f, simple(2))
    assert cli("enqueue", str(f), "--no-progress", "--rejects", str(tmp_path / "r.jsonl"))[0] == 0
    assert not (tmp_path / "r.jsonl").exists()


def test_duplicates_inside_a_file_run_once(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    # the second x is in the same batch as the first, the second y in a later one; the same request
    # again is a duplicate, another request under the same custom_id a rejected line
    f = write_jsonl(tmp_path / "in.jsonl", [{"id": "x", "prompt": "1"}, {"id": "y", "prompt": "2"},
                                            {"id": "x", "prompt": "1"}, *simple(6000), {"id": "y", "prompt": "4"}])
    rc, out, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 1
    assert f"{f}:3: duplicate custom_id 'x' (first at line 1)" in err
    assert f"{f}:6004: custom_id 'y' is already on line 2 with a different request" in err
    assert "6,002 new" in out and "1 rejected, 1 duplicates" in out
    rows = store_rows(tmp_path)
    assert rows["x"] == (1, 1, 1) and rows["y"] == (2, 2, 1) and len(rows) == 6002


def test_reenqueue_is_idempotent(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(2500))
    assert cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--no-progress")[0] == 0
    before = (queued_ids(r, "gpu0", "gpu1"), store_rows(tmp_path), r.hget(Keys(RUN).stats, "enqueued"))
    rc, out, _ = cli("enqueue", str(f), "--queues", "gpu0,gpu1", "--no-progress")
    assert rc == 0
    assert "0 new, 2,500 already in the store" in out
    assert (queued_ids(r, "gpu0", "gpu1"), store_rows(tmp_path), r.hget(Keys(RUN).stats, "enqueued")) == before
    assert sorted(seq for seq, _, _ in before[1].values()) == list(range(1, 2501))


def test_finished_prompts_are_not_enqueued_again(cli: Cli, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(4))
    cli("enqueue", str(f), "--no-progress")
    work(redis_url, ["gpu0"], keep=lambda cid: cid in ("p0", "p1"), fail=lambda cid: cid == "p1")
    collect_once(r, Store.open(tmp_path / "state" / f"{RUN}.sqlite", run=RUN), Keys(RUN))
    work(redis_url, ["gpu0"], keep=lambda cid: cid == "p2")  # done in Redis, not collected yet
    rc, out, _ = cli("enqueue", str(f), "--no-progress")
    assert rc == 0
    assert "0 new, 2 already in the store, 2 already finished" in out
    assert queued_ids(r, "gpu0") == [job_id_for(RUN, "p3")]


def test_seq_runs_across_files(cli: Cli, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", simple(10, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", simple(3, "b"))
    cli("enqueue", str(a), "--no-progress")
    cli("enqueue", str(b), "--no-progress")
    rows = store_rows(tmp_path)
    assert min(rows[f"b{i}"][0] for i in range(3)) > max(rows[f"a{i}"][0] for i in range(10))
    assert rows["b2"] == (13, 3, 1)


def test_streams_from_a_pipe(redis_url: str, tmp_path: Path) -> None:
    """The first batch is in the store while the input is still open: the file is not read whole."""
    env = {"BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_STATE_DIR": str(tmp_path), "BATCHFLEET_RUN": RUN,
           "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.Popen([sys.executable, "-m", "producer.cli", "enqueue", "-", "--no-progress"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(b"".join(orjson.dumps(x) + b"\n" for x in simple(6000)))
    proc.stdin.flush()
    deadline = time.monotonic() + 30

    def stored() -> int:
        if not (tmp_path / f"{RUN}.sqlite").exists():
            return 0
        try:
            return sqlite3.connect(tmp_path / f"{RUN}.sqlite").execute("SELECT COUNT(*) FROM prompts").fetchone()[0]
        except sqlite3.OperationalError:
            return 0

    while stored() < 5000:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.stdin.write(b"".join(orjson.dumps(x) + b"\n" for x in simple(500, "q")))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert stored() == 6500


def test_ctrl_c_keeps_what_was_written_and_a_rerun_completes(cli: Cli, r: redis.Redis, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(12_000))
    real = parse_module.parse_line
    seen = [0]

    def interrupted(raw: bytes, *args: Any, **kwargs: Any) -> object:
        seen[0] += 1
        if seen[0] == 7000:
            raise KeyboardInterrupt
        return real(raw, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr("producer.enqueue.parse_line", interrupted)
        rc, _, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 130 and "run the same command again" in err
    assert len(store_rows(tmp_path)) == 5000  # the batches committed before Ctrl-C; the one in progress is not
    rc, out, _ = cli("enqueue", str(f), "--no-progress")
    assert rc == 0 and "7,000 new, 5,000 already in the store" in out
    rows = store_rows(tmp_path)
    assert sorted(seq for seq, _, _ in rows.values()) == list(range(1, 12_001))
    assert all(rows[f"p{i}"][1] == i + 1 for i in range(12_000))  # each custom_id once, at its own line


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
        assert job.args[0]["cid"] == cid


def test_a_crash_between_redis_and_the_store_heals(cli: Cli, r: redis.Redis, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs written to Redis but the store never marked them FED: the next feed pass finds them present
    and only marks them; no job is written twice."""
    f = write_jsonl(tmp_path / "in.jsonl", simple(3))

    def crash(*_: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    with monkeypatch.context() as m:
        m.setattr(Store, "set_state", crash)
        assert cli("enqueue", str(f), "--no-progress")[0] == 2
    assert len(queued_ids(r, "gpu0")) == 3 and {st for _, _, st in store_rows(tmp_path).values()} == {0}
    rc, out, _ = cli("enqueue", str(f), "--no-progress")
    assert rc == 0 and "0 new, 3 already in the store" in out and "fed to Redis" not in out
    assert len(queued_ids(r, "gpu0")) == 3 and {st for _, _, st in store_rows(tmp_path).values()} == {1}
    assert int(r.hget(Keys(RUN).stats, "enqueued")) == 3


def test_the_bundled_sample_enqueues_with_the_four_rejects_the_demo_shows(cli: Cli, tmp_path: Path) -> None:
    """`make demo`'s input: 2,102 prompts stored and 4 lines rejected, each named (a stray line of another
    kind than the file's must be one of those rejects, not a refusal of the whole file)."""
    sample = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
    rc, out, err = cli("enqueue", str(sample), "--queues", "gpu0", "--no-progress",
                       "--rejects", str(tmp_path / "rejects.jsonl"))
    assert rc == 1, err  # some lines rejected, the rest stored
    assert "2,102 new" in out and "4 rejected" in out, out
    assert [ln.split(":")[1] for ln in err.splitlines() if ln.startswith(str(sample))] == ["101", "701", "1302", "1502"]
