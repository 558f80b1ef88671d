"""The CLI a person meets (issue 10): exit codes and messages of `producer export` / `enqueue`, input
validation that agrees between the two line forms, compressed input and output, `--errors`,
`producer runs`, shared options before or after the subcommand, `producer status` wording, and
the optional extras' messages. Real Redis; workers played with the worker's own Ledger."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.keys import Keys
from batchfleet.records import WorkerState, WorkerStatus
from producer.parse import Reject, parse_line

from .test_producer_helpers import RUN, Cli, make_cli, simple, work, write_jsonl

BIN = Path(sys.executable).parent


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def enqueue(cli: Cli, tmp_path: Path, n: int, name: str = "in.jsonl") -> Path:
    f = write_jsonl(tmp_path / name, simple(n))
    rc, _, err = cli("enqueue", str(f), "--queues", "gpu0", "--no-progress")
    assert rc == 0, err
    return f


def lines(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    elif path.name.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
    return [orjson.loads(x) for x in raw.splitlines()]


# --- producer export: exit codes and messages ----------------------------------------------------------
def test_export_exit_codes_complete_pending_and_errors(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 4)
    out = tmp_path / "out" / "results.jsonl"
    rc, _, err = cli("export", str(out))
    assert rc == 1 and out.exists() and lines(out) == []  # pending: the partial file is written
    assert "4 prompts have no result yet" in err
    work(redis_url, ["gpu0"], 4, fail=lambda cid: cid == "p2")
    rc, _, _ = cli("export", str(out))
    assert rc == 0 and [x["custom_id"] for x in lines(out)] == ["p0", "p1", "p2", "p3"]
    # usage or I/O errors: 2, one line, no traceback
    for target, words in ((tmp_path, "is a directory"),
                          (tmp_path / "in.jsonl" / "x.jsonl", "cannot create its directory")):
        rc, _, err = cli("export", str(target))
        assert rc == 2 and words in err and "Traceback" not in err, err


def test_export_of_a_run_that_does_not_exist_is_an_error(cli: Cli, tmp_path: Path) -> None:
    rc, _, err = cli("export", str(tmp_path / "o.jsonl"), "--run", "nosuch")
    assert rc == 2 and "nothing was enqueued in this run" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_export_errors_file_and_compressed_outputs(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 5)
    work(redis_url, ["gpu0"], 5, fail=lambda cid: cid in ("p1", "p3"))
    out, errs = tmp_path / "ok.jsonl", tmp_path / "errors.jsonl"
    rc, stdout, _ = cli("export", str(out), "--errors", str(errs))
    assert rc == 0 and "2 failed prompt(s) to" in stdout
    assert [x["custom_id"] for x in lines(out)] == ["p0", "p2", "p4"]
    assert [x["custom_id"] for x in lines(errs)] == ["p1", "p3"]
    assert all(x["error"] is None and x["response"]["status_code"] == 400 for x in lines(errs))  # HTTP errors
    default = tmp_path / "all.jsonl"
    assert cli("export", str(default))[0] == 0 and len(lines(default)) == 5  # the default keeps every line
    for name in ("all.jsonl.gz", "all.jsonl.zst"):
        assert cli("export", str(tmp_path / name))[0] == 0
        assert lines(tmp_path / name) == lines(default)
    rc, _, err = cli("export", str(tmp_path / "all.parquet"))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert rc == 2 and "pip install 'batchfleet[parquet]'" in err and "Traceback" not in err
    else:
        assert rc == 0


# --- input ---------------------------------------------------------------------------------------------
def test_input_directory_empty_file_and_compressed_input(cli: Cli, tmp_path: Path) -> None:
    rc, _, err = cli("enqueue", str(tmp_path), "--no-progress")
    assert rc == 2 and "is a directory" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n")
    rc, _, err = cli("enqueue", str(empty), "--no-progress")
    assert rc == 0 and "holds no prompts" in err
    rows = b"".join(orjson.dumps(x) + b"\n" for x in simple(3, prefix="g"))
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(rows))
    rc, out, _ = cli("enqueue", str(tmp_path / "in.jsonl.gz"), "--queues", "gpu0", "--no-progress")
    assert rc == 0 and "3 new" in out
    import zstandard

    (tmp_path / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(orjson.dumps(x) + b"\n" for x in simple(2, prefix="z"))))
    rc, out, err = cli("enqueue", str(tmp_path / "in.jsonl.zst"), "--queues", "gpu0", "--no-progress")
    assert rc == 0 and "2 new" in out, err
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    rc, _, err = cli("enqueue", str(tmp_path / "bad.jsonl.gz"), "--no-progress")
    assert rc == 2 and "cannot read" in err and "Traceback" not in err


def test_validation_agrees_between_the_two_forms() -> None:
    batch = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    parse_line(orjson.dumps(batch), {}, "m")
    with pytest.raises(Reject, match="unknown key 'temperature' in a batch-form line"):
        parse_line(orjson.dumps({**batch, "temperature": 0.5}), {}, "m")
    with pytest.raises(Reject, match="unknown sampling key 'temprature'"):
        parse_line(orjson.dumps({"id": "a", "prompt": "x", "temprature": 0.5}), {}, "m")
    for line in ({**batch, "body": {"prompt": "x", "stream": True}}, {"id": "a", "prompt": "x", "stream": True}):
        with pytest.raises(Reject, match="stream is not used in batch"):
            parse_line(orjson.dumps(line), {}, "m")
    # an integer id is accepted and becomes the string custom_id (documented in docs/cli.md)
    assert parse_line(orjson.dumps({"id": 7, "prompt": "x"}), {}, "m")[0] == "7"


def test_ctrl_c_of_enqueue_says_what_is_stored_and_that_rerunning_resumes(redis_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_") and k != "REDIS_URL"}
    env.update(BATCHFLEET_REDIS_URL=redis_url, BATCHFLEET_RUN="ctrlc", BATCHFLEET_STATE_DIR=str(tmp_path / "s"))
    p = subprocess.Popen([str(BIN / "producer"), "enqueue", "-", "--queues", "gpu0", "--no-progress"], env=env,
                         stdin=subprocess.PIPE, stderr=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path)
    assert p.stdin is not None and p.stderr is not None
    p.stdin.write(b"not json\n")  # its reject message says the loop is reading
    p.stdin.flush()
    assert b"stdin:1: not JSON" in p.stderr.readline()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert b"interrupted: the store of run ctrlc holds 0 prompt(s)" in err
    assert b"run the same command again to resume" in err and b"Traceback" not in err


# --- shared options, runs, status ------------------------------------------------------------------------
def test_run_and_redis_url_before_or_after_the_subcommand(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetrun.cli import build_parser as batchfleet_parser
    from producer.cli import build_parser as producer_parser
    from supervisor.cli import build_parser as supervisor_parser

    for parser, cmd in ((producer_parser(), ["status"]), (supervisor_parser(), ["status"]),
                        (batchfleet_parser(), ["run", "f.jsonl", "-o", "o.jsonl"])):
        before = parser.parse_args(["--run", "a", "--redis-url", "redis://x:1/0", *cmd])
        after = parser.parse_args([*cmd, "--run", "a", "--redis-url", "redis://x:1/0"])
        neither = parser.parse_args(cmd)
        assert (before.run, before.redis_url) == (after.run, after.redis_url) == ("a", "redis://x:1/0")
        assert (neither.run, neither.redis_url) == (None, None)
        mixed = parser.parse_args(["--run", "a", *cmd, "--redis-url", "redis://y:2/0"])
        assert (mixed.run, mixed.redis_url) == ("a", "redis://y:2/0")


def test_producer_runs_lists_runs_with_counts(cli: Cli, redis_url: str, tmp_path: Path) -> None:
    enqueue(cli, tmp_path, 3)
    work(redis_url, ["gpu0"], 2, fail=lambda cid: cid == "p1")
    rc, out, _ = cli("runs", "--json")
    assert rc == 0
    rows = orjson.loads(out)
    assert [(x["run"], x["prompts"], x["succeeded"], x["failed"], x["pending"], x["counts_from"]) for x in rows] \
        == [(RUN, 3, 0, 0, 3, "store")]  # results not collected yet: the store's truth
    cli("collect")
    rc, out, _ = cli("runs")
    assert rc == 0 and out.splitlines()[0].split()[:5] == ["run", "prompts", "succeeded", "failed", "pending"]
    assert out.splitlines()[1].split()[:5] == [RUN, "3", "1", "1", "1"]


def test_status_has_no_phantom_queue_and_names_a_server_that_cannot_start(cli: Cli, r: redis.Redis,
                                                                        tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "in.jsonl", simple(2))
    assert cli("enqueue", str(f), "--no-progress")[0] == 0  # no --queues, no worker: gpu0 by default
    k = Keys(RUN)
    r.sadd(k.workers, "h.gpu3.1")
    r.set(k.status("h.gpu3.1"), WorkerStatus(worker="h.gpu3.1", host="h", queue="h.gpu3", gpu=3, state=WorkerState.DOWN,
                                             message="could not run /bad/python --help: no such file",
                                             ts=time.time()).to_json(), ex=30)
    rc, out, _ = cli("status")
    assert rc == 0
    assert "server DOWN: could not run /bad/python --help: no such file" in out
    assert "0.0 tokens/s" not in out and "no throughput measured yet" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("gpu", "h.gpu", "queue"))]
    assert rows == ["queue", "gpu0", "h.gpu3"]  # gpu0 holds the 2 prompts; the worker's queue
    r.delete(Keys.queue("gpu0"))  # now gpu0 holds nothing, served nothing, has no worker: no row
    rows = [line.split()[0] for line in cli("status")[1].splitlines() if line.startswith(("gpu", "h.gpu"))]
    assert rows == ["h.gpu3"]


# --- extras ---------------------------------------------------------------------------------------------
def _without(module: str, code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{module!r}] = None\n{code}"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})


def test_report_without_its_extra_says_how_to_install(redis_url: str) -> None:
    done = _without("matplotlib", "from supervisor.cli import main; sys.exit(main(['report', '/tmp/x.png']))",
                    {"REDIS_URL": redis_url})
    assert done.returncode == 2 and "pip install 'batchfleet[report]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_core_imports_need_no_extras() -> None:
    """A GPU host without matplotlib runs the worker, producer and supervisor."""
    done = _without("matplotlib", "import worker, producer.cli, supervisor.cli, fleetrun.cli, supervisor.run")
    assert done.returncode == 0, done.stderr


# --- batchfleet run: usage errors before anything starts --------------------------------------------------
def test_batchfleet_run_usage_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from fleetrun.cli import UsageError, main, parse_gpus, run_name_for

    assert parse_gpus("0-3,6") == (0, 1, 2, 3, 6) and parse_gpus("2") == (2,)
    with pytest.raises(UsageError):
        parse_gpus("all")
    assert run_name_for(Path("/x/my prompts.jsonl.gz")) == "my_prompts"
    for name in [n for n in os.environ if n.startswith("BATCHFLEET_") or n == "REDIS_URL"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BATCHFLEET_MODEL_PATH", "sim/tiny-hybrid")
    f = write_jsonl(tmp_path / "p.jsonl", simple(1))
    cases = [
        (["run", str(tmp_path), "-o", str(tmp_path / "o.jsonl"), "--gpus", "0"], "is a directory"),
        (["run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--gpus", "0"], "no such file"),
        (["run", str(f), "-o", str(tmp_path), "--gpus", "0"], "is a directory; give a file name"),
        (["run", str(f), "-o", str(tmp_path / "o.jsonl"), "--gpus", "x"], "--gpus wants GPU indices"),
    ]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
    monkeypatch.delenv("BATCHFLEET_MODEL_PATH")
    assert main(["run", str(f), "-o", str(tmp_path / "o.jsonl"), "--gpus", "0"]) == 2
    assert "BATCHFLEET_MODEL_PATH is not set" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.redis"))  # nothing was started
