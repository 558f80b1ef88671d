"""What users' input files really look like: a byte order mark, CRLF line ends, an empty file, a huge
line; the counts an enqueue prints add up to the file's lines; `producer runs` shows cancelled
prompts. Real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import redis

from fleetrun.cli import main as batchfleet_main

from .test_producer_helpers import RUN, Cli, make_cli, simple, summary, work, write_jsonl


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def test_a_byte_order_mark_and_crlf_line_ends_are_read_as_plain_lines(cli: Cli, tmp_path: Path) -> None:
    lines = [orjson.dumps(x) for x in simple(3)]
    f = tmp_path / "windows.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join([lines[0], b"", lines[1], lines[2]]) + b"\r\n")
    rc, out, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 0, err
    assert summary(out) == (4, "3 new, 0 already in the store, 0 already finished, 0 rejected, 0 duplicates, 1 blank")
    assert not (tmp_path / "windows.jsonl.rejects.jsonl").exists()
    # a byte order mark anywhere but at the start is no whitespace: that line is rejected
    g = tmp_path / "mid.jsonl"
    g.write_bytes(lines[0] + b"\n\xef\xbb\xbf" + lines[1] + b"\n")
    rc, _, err = cli("enqueue", str(g), "--no-progress")
    assert rc == 1 and f"{g}:2: not JSON" in err


@pytest.mark.parametrize("content", [b"", b"\n\n  \r\n"])
def test_an_empty_input_leaves_no_store_and_no_redis_key(cli: Cli, r: redis.Redis, tmp_path: Path,
                                                         content: bytes) -> None:
    f = tmp_path / "empty.jsonl"
    f.write_bytes(content)
    rc, _, err = cli("enqueue", str(f), "--no-progress")
    assert not (tmp_path / "state").exists() and r.dbsize() == 0
    assert rc == 0 and f"warning: {f} holds no prompts (it is empty or only blank lines): nothing enqueued" in err


def test_an_empty_input_from_a_pipe_leaves_nothing_either(redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    env = {"BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_STATE_DIR": str(tmp_path / "state"), "BATCHFLEET_RUN": RUN,
           "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run([sys.executable, "-m", "producer.cli", "enqueue", "-", "--no-progress"], input=b"\n",
                          env=env, capture_output=True, timeout=60)
    assert not (tmp_path / "state").exists() and r.dbsize() == 0
    assert done.returncode == 0 and b"stdin holds no prompts" in done.stderr, done.stderr


def test_batchfleet_run_of_an_empty_file_starts_nothing_and_writes_an_empty_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in list(os.environ):
        if name.startswith("BATCHFLEET_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHFLEET_MODEL_PATH", "sim/tiny-hybrid")
    (tmp_path / "prompts.jsonl").write_bytes(b"\n")
    out, state = tmp_path / "results.jsonl", tmp_path / "st"
    rc = batchfleet_main(["run", str(tmp_path / "prompts.jsonl"), "-o", str(out), "--gpus", "0",
                          "--state-dir", str(state)])
    err = capsys.readouterr().err
    assert not state.exists()  # no private Redis, no store
    assert rc == 0 and out.read_bytes() == b"", err
    assert "holds no prompts" in err and "nothing ran" in err


def test_the_rejects_file_quotes_the_start_of_a_huge_line_and_never_holds_it_whole(
        cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("producer.inputs.MAX_LINE_BYTES", 1 << 20, raising=False)  # as MAX_BODY_BYTES + 64 KiB
    not_json = b'{"id": "big", "prompt": "' + b"x" * 300_000  # no closing quote
    too_long = b'{"id": "huge", "prompt": "' + b"y" * (3 << 20) + b'"}'
    odd_key = orjson.dumps({"id": "k", "prompt": "x", "z" * 100_000: 1})  # its reason quotes the key
    f = write_jsonl(tmp_path / "in.jsonl", [*simple(1), not_json, too_long, odd_key, *simple(1, "q")])
    rc, out, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 1
    assert (tmp_path / "in.jsonl.rejects.jsonl").stat().st_size < 8192
    rejects = [orjson.loads(x) for x in (tmp_path / "in.jsonl.rejects.jsonl").read_bytes().splitlines()]
    assert [(x["line"], x["bytes"], len(x["text"].encode())) for x in rejects] == [
        (2, len(not_json) + 1, 1024), (3, len(too_long) + 1, 1024), (4, len(odd_key) + 1, 1024)]
    assert rejects[1]["text"].startswith('{"id": "huge", "prompt": "yyy')
    assert rejects[2]["reason"].startswith("unknown sampling key 'zzz") and len(rejects[2]["reason"]) < 600
    assert f"{f}:2: not JSON" in err
    assert f"{f}:3: line of {len(too_long) + 1:,} bytes is longer than any request may be" in err
    assert max(len(line) for line in err.splitlines()) < 1000  # stderr quotes no line whole either
    assert summary(out) == (5, "2 new, 0 already in the store, 0 already finished, 3 rejected, 0 duplicates")


def test_the_counts_of_a_resume_add_up_to_the_files_lines(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    rows: list[object] = [*simple(6), b"", b"{not json", {"id": "p1", "prompt": "text 1"},
                          {"id": "p2", "prompt": "another"}]
    f = write_jsonl(tmp_path / "in.jsonl", rows)
    rc, out, _ = cli("enqueue", str(f), "--queues", "gpu0", "--no-progress")
    assert rc == 1 and summary(out) == (10, "6 new, 0 already in the store, 0 already finished, 2 rejected, "
                                            "1 duplicates, 1 blank")
    work(redis_url, ["gpu0"], keep=lambda cid: cid in ("p0", "p1", "p2"), fail=lambda cid: cid == "p2")
    assert cli("collect")[0] == 0
    f = write_jsonl(f, [*rows, *simple(2, "n")])  # two lines added, then resumed
    rc, out, _ = cli("enqueue", str(f), "--queues", "gpu0", "--no-progress")
    lines, counts = summary(out)
    assert rc == 1 and (lines, counts) == (12, "2 new, 3 already in the store, 3 already finished, 2 rejected, "
                                               "1 duplicates, 1 blank")
    assert sum(int(part.split()[0]) for part in counts.split(", ")) == lines == len(f.read_bytes().splitlines())


def test_producer_runs_shows_cancelled_prompts(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "in.jsonl", simple(5))), "--queues", "gpu0",
               "--no-progress")[0] == 0
    work(redis_url, ["gpu0"], 2)
    assert cli("cancel", "--wait", "0")[0] == 0
    (run,) = orjson.loads(cli("runs", "--json")[1])
    assert (run["prompts"], run["succeeded"], run["failed"], run["cancelled"], run["pending"]) == (5, 2, 0, 3, 0)
    header, row = cli("runs")[1].splitlines()[:2]
    assert header.split()[:6] == ["run", "prompts", "succeeded", "failed", "pending", "cancelled"]
    assert row.split()[:6] == [RUN, "5", "2", "0", "0", "3"]
