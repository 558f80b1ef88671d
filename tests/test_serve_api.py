"""`batchfleet serve` driven by the official `openai` client, exactly as users call it, and by plain HTTP
where the client hides what is tested (shapes, status codes). No GPU here: the serve runs the API and
the head; prompts are answered, where a test needs it, by the worker's own Ledger (the real Lua
bookkeeping, tests/test_producer_helpers.py). End to end on simulated GPUs: tests/test_serve_e2e.py."""

from __future__ import annotations

import hashlib
import re
import socket
import stat
import subprocess
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from openai.types import Batch, FileObject

from batchfleet.keys import Keys
from batchfleet.records import Result

from .conftest import free_port
from .serveproc import BIN, Serve, batch_lines, serve_env, write_lines
from .test_producer_helpers import work


def wait_status(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def test_files_and_batches_are_openais_objects_field_by_field_and_list_page_by_page(
        tmp_path: Path, redis_url: str) -> None:
    sv = Serve(tmp_path, redis_url).start()
    client = sv.client()
    path = write_lines(tmp_path / "requests.jsonl", batch_lines(3))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename, f.status) == ("file", "batch", path.stat().st_size,
                                                                    "requests.jsonl", "processed")
    raw_file = sv.http("GET", f"/files/{f.id}").json()
    assert set(raw_file) == set(FileObject.model_fields)  # every field OpenAI documents, nothing else
    assert client.files.content(f.id).content == path.read_bytes()

    batches = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata={"job": f"n{i}"}) for i in range(3)]
    first = batches[0]
    assert (first.status, first.object, first.endpoint, first.metadata) == ("validating", "batch",
                                                                             "/v1/chat/completions", {"job": "n0"})
    assert first.expires_at == first.created_at + 24 * 3600
    b = wait_status(client, first.id, {"in_progress"})
    assert b.request_counts is not None and (b.request_counts.total, b.request_counts.completed) == (3, 0)
    assert b.in_progress_at is not None and b.created_at <= b.in_progress_at and b.model == "sim/tiny-hybrid"
    raw = sv.http("GET", f"/batches/{first.id}").json()
    assert set(raw) == set(Batch.model_fields)
    Batch.model_validate(raw)

    # newest first; limit and after page through them; the client's auto-paging does too
    page = client.batches.list(limit=2)
    assert [x.id for x in page.data] == [batches[2].id, batches[1].id] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert [x.id for x in rest.data] == [first.id] and not rest.has_more
    assert [x.id for x in client.batches.list(limit=1)] == [x.id for x in reversed(batches)]
    assert [x.id for x in client.files.list()] == [f.id]
    assert [x.id for x in client.files.list(purpose="batch_output")] == []

    # deleting a file: gone for every call; an unknown id is a 404 in OpenAI's shape
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    r = sv.http("GET", "/batches/batch_nope")
    assert r.status_code == 404 and r.json()["error"]["message"] == "No such Batch object: batch_nope"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id="file-x", endpoint="/v1/responses", completion_window="24h")


def test_a_key_sees_only_what_it_made_and_a_wrong_key_is_refused(tmp_path: Path, redis_url: str) -> None:
    keys = ("sk-team-a-4d1b7c2e9f", "sk-team-b-88a03e71c5")
    sv = Serve(tmp_path, redis_url, env=serve_env(tmp_path, redis_url, BATCHFLEET_API_KEYS=",".join(keys))).start()
    a, b = sv.client(keys[0]), sv.client(keys[1])
    f = a.files.create(file=write_lines(tmp_path / "in.jsonl", batch_lines(2)).open("rb"), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.AuthenticationError):
        sv.client("sk-wrong").batches.retrieve(batch.id)
    r = sv.http("GET", "/files")  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"http://127.0.0.1:{sv.port}/health").status_code == 200  # the one path without a key
    # the other key: nothing of it, as if it did not exist
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id), lambda: b.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(b.files.list()) == [] and list(b.batches.list()) == []
    with pytest.raises(openai.BadRequestError):
        b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [x.id for x in a.batches.list()] == [batch.id]
    wait_status(a, batch.id, {"in_progress"})
    sv.stop()
    # only a hash of each key is kept; no key is on disk or in a log
    owners = subprocess.run(["sqlite3", str(sv.state / f"{sv.run}.api.sqlite"), "SELECT DISTINCT owner FROM files"],
                            capture_output=True, text=True)
    if owners.returncode == 0:  # the sqlite3 shell may be missing; the scan below holds anyway
        assert owners.stdout.split() == [hashlib.sha256(keys[0].encode()).hexdigest()]
    for p in tmp_path.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            assert all(k.encode() not in data for k in keys), p


def test_serving_beyond_loopback_needs_keys_and_mistakes_are_one_line(tmp_path: Path, redis_url: str) -> None:
    env = serve_env(tmp_path, redis_url)
    loose = tmp_path / "keys.txt"
    loose.write_text("sk-one\n")
    loose.chmod(0o644)
    # more wrong inputs (a port in use, --tp, a state dir that cannot be made): tests/test_cli_mistakes.py
    cases = [
        (["--host", "0.0.0.0"], "would open the API to other machines without keys"),
        (["--host", "0.0.0.0", "--api-keys-file", str(loose)], "may be read by others"),
    ]
    for argv, words in cases:
        done = subprocess.run([str(BIN / "batchfleet"), "serve", "--state-dir", str(tmp_path / "st"), *argv],
                              env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "st").exists()  # refused before anything was made
    taken = Serve(tmp_path, redis_url).start()
    again = subprocess.run([str(BIN / "batchfleet"), "serve", "--run", "other", "--state-dir", str(tmp_path / "o"),
                            "--port", str(taken.port)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "in use" in again.stderr and "Traceback" not in again.stderr, again.stderr
    loose.chmod(0o600)  # the file's keys, beyond loopback
    sv = Serve(tmp_path, redis_url, "--host", "0.0.0.0", "--api-keys-file", str(loose), run="wide").start()
    with pytest.raises(openai.AuthenticationError):
        sv.client("sk-two").files.list()
    assert list(sv.client("sk-one").files.list()) == []


def test_limits_an_upload_too_big_a_batch_too_long_and_a_bad_line_with_its_number(tmp_path: Path,
                                                                                  redis_url: str) -> None:
    sv = Serve(tmp_path, redis_url, "--max-upload-mb", "0.002", "--max-requests", "2").start()
    client = sv.client()
    big = write_lines(tmp_path / "big.jsonl", batch_lines(20))
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=big.open("rb"), purpose="batch")
    assert exc.value.status_code == 413 and "upload limit of 2,000 bytes" in exc.value.message
    assert list(client.files.list()) == [] and list((sv.state / f"{sv.run}.files").iterdir()) == []
    three = client.files.create(file=write_lines(tmp_path / "three.jsonl", batch_lines(3)).open("rb"), purpose="batch")
    lines = batch_lines(2)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(orjson.dumps(lines[0]) + b"\n" + b'{"custom_id": "x", "method": "POST"\n')
    broken = client.files.create(file=bad.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=bad.open("rb"), purpose="fine-tune")
    too_long = client.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
    invalid = client.batches.create(input_file_id=broken.id, endpoint="/v1/chat/completions", completion_window="24h")
    for batch, (line, code) in ((too_long, (3, "too_many_requests")), (invalid, (2, "invalid_json_line"))):
        b = wait_status(client, batch.id, {"failed"})
        assert b.failed_at is not None and b.in_progress_at is None and b.output_file_id is None
        assert b.errors is not None and b.errors.data is not None
        assert [(e.line, e.code) for e in b.errors.data] == [(line, code)]


def test_a_batch_past_its_window_expires_and_keeps_what_finished(tmp_path: Path, redis_url: str) -> None:
    """The head feeds the queue given (BATCHFLEET_QUEUES); the worker's Ledger answers two prompts."""
    run = "exp"
    queue = f"{run}.gpu0"
    env = serve_env(tmp_path, redis_url, BATCHFLEET_QUEUES=queue)
    sv = Serve(tmp_path, redis_url, "--completion-window-s", "12", env=env, run=run).start()
    client = sv.client()
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", batch_lines(5)).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 10
    answered: list[Result] = []
    while len(answered) < 2 and time.monotonic() < deadline:
        answered += work(redis_url, [queue], 2 - len(answered), run=run)
        time.sleep(0.1)
    assert len(answered) == 2
    deadline = time.monotonic() + 30
    while (b := client.batches.retrieve(batch.id)).request_counts.completed < 2:  # type: ignore[union-attr]
        assert b.status == "in_progress" and time.monotonic() < deadline, b
        time.sleep(0.2)
    b = wait_status(client, batch.id, {"expired"})
    assert b.expired_at is not None and b.expired_at >= b.expires_at  # type: ignore[operator]
    assert b.request_counts is not None and (b.request_counts.total, b.request_counts.completed,
                                             b.request_counts.failed) == (5, 2, 0)
    out = [orjson.loads(x) for x in client.files.content(b.output_file_id).content.splitlines()]  # type: ignore[arg-type]
    err = [orjson.loads(x) for x in client.files.content(b.error_file_id).content.splitlines()]  # type: ignore[arg-type]
    assert sorted(x["custom_id"] for x in out) == sorted(a.cid.split(":")[1] for a in answered)
    assert {x["error"]["code"] for x in err} == {"batch_expired"} and len(out) + len(err) == 5
    assert sorted(x["custom_id"] for x in out + err) == [f"req-{i}" for i in range(5)]


def test_what_serve_keeps_on_disk_is_private(tmp_path: Path, redis_url: str) -> None:
    sv = Serve(tmp_path, redis_url).start()
    client = sv.client()
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", batch_lines(2)).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_status(client, batch.id, {"in_progress"})  # its requests in the store: the cancel writes an error file
    client.batches.cancel(batch.id)
    b = wait_status(client, batch.id, {"cancelled"})
    assert b.error_file_id is not None and b.cancelling_at is not None and b.cancelled_at is not None
    sv.stop()
    for p in [sv.state, *sv.state.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_a_second_serve_or_run_of_the_same_run_says_which_serve_is_active_and_starts_nothing(
        tmp_path: Path, redis_url: str) -> None:
    sv = Serve(tmp_path, redis_url).start()
    assert sv.proc is not None
    env = serve_env(tmp_path, redis_url)
    logs = sv.state / "logs" / sv.run
    write_lines(tmp_path / "in.jsonl", batch_lines(2))
    for argv in (["serve", "--port", str(free_port())],
                 ["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--gpus", "0"]):
        done = subprocess.run([str(BIN / "batchfleet"), *argv, "--run", sv.run, "--state-dir", str(sv.state)],
                              env=env, capture_output=True, text=True, timeout=60)
        errors = [x for x in done.stderr.splitlines() if x.startswith("batchfleet")]  # after the Redis it found
        assert done.returncode == 3 and len(errors) == 1 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert (f"another batchfleet serve of {sv.run} is active ({socket.gethostname()}, pid {sv.proc.pid}, since"
                in errors[0]), errors[0]
    # nothing was started: one head (the live serve's), no worker, nothing enqueued
    assert len(re.findall(r"starts head", (logs / "head.log").read_text())) == 1
    assert sorted(p.name for p in logs.iterdir()) == ["head.log"]
    assert sv.proc.poll() is None and list(sv.client().files.list()) == []  # the live one serves on
    assert sv.stop() == 0
    assert not redis.Redis.from_url(redis_url).exists(Keys(sv.run).launcher)  # released on the way out
    sv.start()  # the next launch of the run: its own header line in the same per-run log
    assert sv.stop() == 0
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert len(re.findall(r"batchfleet serve \(pid \d+\) starts head", (logs / "head.log").read_text())) == 2
