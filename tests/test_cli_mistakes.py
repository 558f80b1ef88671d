"""Every entry point meets a person's mistakes with one line on stderr and its documented exit code,
never a traceback (issue 20 §3): `producer`, `supervisor`, `batchfleet` and `rq worker` with
batchfleet's class, each a real subprocess, against a matrix of wrong inputs: Redis URLs, ports in
use, paths that cannot be written, runs that do not exist, bad numbers, a closed stdout. A mistake
creates nothing in Redis. And docs/cli.md agrees with every `--help`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.cliopts import shown_default
from batchfleet.keys import Keys

from .test_producer_helpers import simple, write_jsonl

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
KNOWN = "prompts"  # the run that exists in each test's Redis


@dataclass
class Case:
    argv: list[str]
    code: int
    words: str = ""  # in the one line on stderr
    env: dict[str, str] = field(default_factory=dict)
    closed_stdout: bool = False  # stdout is a pipe whose reader is gone
    history: bool = False  # the known run has a supervisor history (for `report`)


# {url}: the test's Redis; {hostport}: its host:port; {port}: its port (in use); {file}: a regular file;
# {input}: a valid JSONL file
CASES: dict[str, Case] = {
    # --- producer ---
    "producer: a Redis URL without a scheme shows the fix": Case(
        ["producer", "status"], 2, "has no scheme: write redis://{hostport}/0", env={"REDIS_URL": "{hostport}"}),
    "producer: --redis-url without a scheme shows the fix": Case(
        ["producer", "--redis-url", "{hostport}", "runs"], 2, "write redis://{hostport}/0"),
    "producer: a URL whose port is not a number": Case(
        ["producer", "--redis-url", "redis://127.0.0.1:port/0", "status"], 2, "Port could not be cast"),
    "producer: a Redis that does not answer": Case(
        ["producer", "--redis-url", "redis://127.0.0.1:1/0", "collect"], 2, "Redis at redis://127.0.0.1:1/0"),
    "producer status: an unknown run says did you mean": Case(
        ["producer", "--run", "promts", "status"], 2, "run 'promts' does not exist"),
    "producer export: an unknown run": Case(["producer", "--run", "promts", "export", "{tmp}/o.jsonl"], 2,
                                            "did you mean 'prompts'?"),
    "producer cancel: an unknown run": Case(["producer", "cancel", "--run", "promts"], 2, "did you mean 'prompts'?"),
    "producer purge: an unknown run is not purged": Case(["producer", "purge", "promts", "--yes"], 2,
                                                         "did you mean 'prompts'?"),
    "producer collect: an unknown run": Case(["producer", "--run", "nosuchrun", "collect"], 2,
                                             "runs there: prompts"),
    "producer recover: an unknown run": Case(["producer", "--run", "promts", "recover"], 2, "does not exist"),
    "producer head: a zero interval": Case(["producer", "head", "--interval", "0"], 2,
                                           "argument --interval: '0': must be more than 0"),
    "producer enqueue: --max-tokens not a number": Case(["producer", "enqueue", "{input}", "--max-tokens", "lots"],
                                                        2, "invalid int value: 'lots'"),
    "producer export: a timeout that is not a number": Case(
        ["producer", "--run", KNOWN, "export", "{tmp}/o.jsonl", "--wait", "--timeout", "nan"], 2,
        "is not a finite number"),
    "producer cancel: a negative wait": Case(["producer", "--run", KNOWN, "cancel", "--wait", "-1"], 2,
                                             "must be at least 0"),
    "producer enqueue: a state dir that cannot be created": Case(
        ["producer", "--run", "fresh", "--state-dir", "{file}/state", "enqueue", "{input}", "--no-progress"], 2,
        "{file}/state: Not a directory"),
    "producer export: an OUT that cannot be created": Case(
        ["producer", "--run", KNOWN, "export", "{file}/o.jsonl"], 2, "cannot create its directory"),
    "producer status: a closed stdout": Case(["producer", "--run", KNOWN, "status"], 141, closed_stdout=True),
    "producer runs: a closed stdout": Case(["producer", "runs"], 141, closed_stdout=True),
    # --- supervisor ---
    "supervisor: a Redis URL without a scheme shows the fix": Case(
        ["supervisor", "status"], 2, "write redis://{hostport}/0", env={"REDIS_URL": "{hostport}"}),
    "supervisor watch: a metrics port in use": Case(
        ["supervisor", "--run", KNOWN, "watch", "--metrics-port", "{port}"], 2,
        "cannot serve metrics on 127.0.0.1:{port}"),
    "supervisor run: a metrics address this host does not have": Case(
        ["supervisor", "--run", KNOWN, "run", "--metrics-port", "{port}", "--metrics-addr", "256.0.0.1"], 2,
        "cannot serve metrics on 256.0.0.1"),
    "supervisor status: an unknown run": Case(["supervisor", "--run", "nosuchrun", "status"], 2,
                                              "run 'nosuchrun' does not exist"),
    "supervisor watch --once: an unknown run": Case(["supervisor", "watch", "--once", "--run", "promts"], 2,
                                                    "did you mean 'prompts'?"),
    "supervisor restart: an unknown run creates no keys": Case(
        ["supervisor", "--run", "typo", "restart", "--strategy", "no_buffer"], 2, "run 'typo' does not exist"),
    "supervisor report: an unknown run": Case(["supervisor", "--run", "promts", "report", "{tmp}/r.png"], 2,
                                              "did you mean 'prompts'?"),
    "supervisor watch: a zero window": Case(["supervisor", "watch", "--window", "0"], 2,
                                            "argument --window: '0': must be more than 0"),
    "supervisor run: a port out of range": Case(["supervisor", "run", "--metrics-port", "70000"], 2,
                                                "is not a port"),
    "supervisor restart: a fraction above 1": Case(
        ["supervisor", "--run", KNOWN, "restart", "--strategy", "no_buffer", "--mem-fraction-static", "1.5"], 2,
        "must be between 0 and 1"),
    "supervisor report: an OUT that cannot be written": Case(
        ["supervisor", "--run", KNOWN, "report", "{file}/r.png"], 2, "cannot write {file}/r.png", history=True),
    "supervisor status: a closed stdout": Case(["supervisor", "--run", KNOWN, "status"], 141, closed_stdout=True),
    # --- batchfleet ---
    "batchfleet run: a Redis URL without a scheme shows the fix": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "0"], 2, "write redis://{hostport}/0",
        env={"REDIS_URL": "{hostport}"}),
    "batchfleet run: a state dir that cannot be created": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "0", "--state-dir", "{file}/s"], 2,
        "state dir {file}/s cannot be created or written: Not a directory"),
    "batchfleet run: an OUT that cannot be created": Case(
        ["batchfleet", "run", "{input}", "-o", "{file}/o.jsonl", "--gpus", "0"], 2, "cannot create its directory"),
    "batchfleet run: a negative timeout": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--timeout", "-1"], 2, "must be more than 0"),
    "batchfleet run: GPUs that are not indices": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "all"], 2, "--gpus wants GPU indices"),
    "batchfleet serve: a port in use": Case(["batchfleet", "serve", "--port", "{port}"], 2,
                                            "cannot serve on 127.0.0.1:{port}: in use"),
    "batchfleet serve: a port out of range": Case(["batchfleet", "serve", "--port", "70000"], 2, "is not a port"),
    "batchfleet serve: another address than loopback without API keys": Case(
        ["batchfleet", "serve", "--host", "0.0.0.0", "--port", "{port}"], 2, "without keys"),
    "batchfleet serve: a --tp that is not a number": Case(["batchfleet", "serve", "--tp", "two"], 2,
                                                          "argument --tp: 'two' is not an integer"),
    "batchfleet serve: --tp without --gpus": Case(["batchfleet", "serve", "--tp", "2", "--port", "{port}"], 2,
                                                  "--tp goes with --gpus"),
    "batchfleet serve: GPU groups that do not divide the GPUs given": Case(
        ["batchfleet", "serve", "--gpus", "0-2", "--tp", "2", "--port", "{port}"], 2,
        "--tp 2 does not divide the 3 GPU(s) given (0,1,2)"),
    "batchfleet run: GPU groups that do not divide the GPUs given": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "0-7", "--tp", "3"], 2,
        "--tp 3 does not divide the 8 GPU(s) given"),
    "batchfleet run: a GPU group larger than the host has": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "0-3", "--tp", "8"], 2,
        "--tp 8: a server on 8 GPUs, but this host has 4 (nvidia-smi)", env={"SGLANG_SIM_NUM_GPUS": "4"}),
    "batchfleet run: a completions file for servers started with --is-embedding": Case(
        ["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--gpus", "0"], 2,
        "{input}:1: a /v1/completions request, but BATCHFLEET_SERVER_ARGS has --is-embedding",
        env={"BATCHFLEET_SERVER_ARGS": "--is-embedding"}),
    "batchfleet run: a --tp of 0": Case(["batchfleet", "run", "{input}", "-o", "{tmp}/o.jsonl", "--tp", "0"], 2,
                                        "argument --tp: '0': must be more than 0"),
    "batchfleet serve: a batch limit of 0": Case(["batchfleet", "serve", "--max-requests", "0"], 2,
                                                 "argument --max-requests: '0': must be more than 0"),
    "batchfleet serve: a state dir that cannot be created": Case(
        ["batchfleet", "serve", "--state-dir", "{file}/s", "--port", "{port}"], 2,
        "state dir {file}/s cannot be created or written: Not a directory"),
    # --- rq worker with batchfleet's class ---
    "worker: a Redis URL without a scheme shows the fix": Case(
        ["rq", "worker", "w.gpu0"], 2, "write redis://{hostport}/0", env={"REDIS_URL": "{hostport}"}),
    "worker: --url RQ cannot parse": Case(["rq", "worker", "w.gpu0", "--url", "redis://127.0.0.1:port/0"], 2,
                                          "Port could not be cast"),
    "worker: a setting that is not a number": Case(["rq", "worker", "w.gpu0"], 2,
                                                   "BATCHFLEET_LEASE_TTL_S='soon'",
                                                   env={"BATCHFLEET_LEASE_TTL_S": "soon"}),
    "worker: a state dir that cannot be created": Case(
        ["rq", "worker", "w.gpu0"], 2, "cannot be created or written: Not a directory",
        env={"BATCHFLEET_STATE_DIR": "{file}/state"}),
    "worker: a queue that names no GPU": Case(["rq", "worker", "cpu"], 2, "names no GPU"),
}


def clean_env(redis_url: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHFLEET_", "REDIS_URL", "RQ_"))}
    env.update({"PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{env.get('PATH', '')}", "REDIS_URL": redis_url,
                "RQ_WORKER_CLASS": "worker.GPUWorker", "BATCHFLEET_STATE_DIR": str(tmp / "state"),
                "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid",
                "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim"})
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path, *, closed_stdout: bool = False,
        closed_stderr: bool = False) -> tuple[int, str, str]:
    """A command as a subprocess; with `closed_*`, that stream is a pipe whose reader is already gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([str(BIN / argv[0]), *argv[1:]], env=env, cwd=cwd, timeout=120, text=True,
                           stdout=write if closed_stdout else subprocess.PIPE,
                           stderr=write if closed_stderr else subprocess.PIPE)
    finally:
        os.close(write)
    return p.returncode, p.stdout or "", p.stderr or ""


@pytest.fixture
def known_run(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A Redis holding run KNOWN (enqueued, 3 prompts), and the placeholders of CASES."""
    from producer.cli import main

    for name in [n for n in os.environ if n.startswith("BATCHFLEET_") or n == "REDIS_URL"]:
        monkeypatch.delenv(name)
    src = write_jsonl(tmp_path / "in.jsonl", simple(3))
    assert main(["--redis-url", redis_url, "--run", KNOWN, "--state-dir", str(tmp_path / "state"), "enqueue",
                 str(src), "--queues", "prompts.gpu0", "--no-progress"]) == 0
    (tmp_path / "a-file").write_text("not a directory\n")
    host_port = redis_url.removeprefix("redis://").partition("/")[0]
    return {"url": redis_url, "hostport": host_port, "port": host_port.rpartition(":")[2],
            "file": str(tmp_path / "a-file"), "input": str(src), "tmp": str(tmp_path)}


@pytest.mark.parametrize("name", list(CASES))
def test_a_mistake_is_one_line_on_stderr_its_documented_exit_code_and_nothing_in_redis(
        name: str, known_run: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    case = CASES[name]
    r = redis.Redis.from_url(redis_url)
    if case.history:
        gpu = {"gpu": 0, "host": "h", "queue": "prompts.gpu0", "in_flight": 1, "effective_max": 2,
               "state": "serving", "strategy": "default", "class": ""}
        for ts in (1.0, 2.0):
            r.xadd(Keys(KNOWN).history, {"s": orjson.dumps({"ts": ts, "tokens_per_s": 1.0, "wall_tokens_per_s": 1.0,
                                                            "backlog": 0, "done": 0, "gpus": {"w0": gpu}})})
    before = {k: r.type(k) for k in r.keys("*")}
    env = clean_env(redis_url, tmp_path)
    env.update({k: v.format(**known_run) for k, v in case.env.items()})
    argv = [a.format(**known_run) for a in case.argv]
    rc, out, err = run(argv, env, tmp_path, closed_stdout=case.closed_stdout)
    lines = [x for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err + out, err
    assert rc == case.code, (rc, err)
    if case.code == 141:
        assert lines == []  # the rest of the output is dropped quietly
    else:
        assert len(lines) == 1, err
        assert case.words.format(**known_run) in lines[0], lines[0]
    assert {k: r.type(k) for k in r.keys("*")} == before  # a mistake creates nothing (and deletes nothing)


def test_an_unknown_run_names_the_closest_runs_first_and_the_rest(redis_url: str, tmp_path: Path) -> None:
    env = clean_env(redis_url, tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", simple(1))
    for run_name in ("alpha", "beta", "prompts-b"):
        assert run(["producer", "--run", run_name, "enqueue", str(src), "--no-progress"], env, tmp_path)[0] == 0
    rc, _, err = run(["supervisor", "--run", "prompts-a", "status"], env, tmp_path)
    assert rc == 2
    assert "did you mean 'prompts-b'?" in err and "runs there: alpha, beta, prompts-b" in err


def test_a_closed_stderr_is_still_the_exit_code_and_no_traceback(redis_url: str, tmp_path: Path) -> None:
    env = clean_env(redis_url, tmp_path)
    rc, out, _ = run(["batchfleet", "run", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                      "--gpus", "0"], env, tmp_path, closed_stderr=True)
    assert rc == 2 and out == ""


# --- docs/cli.md and --help ------------------------------------------------------------------------------
def _parsers() -> dict[str, argparse.ArgumentParser]:
    from fleetrun.cli import build_parser as batchfleet_parser
    from producer.cli import build_parser as producer_parser
    from supervisor.cli import build_parser as supervisor_parser

    return {"producer": producer_parser(), "supervisor": supervisor_parser(), "batchfleet": batchfleet_parser()}


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction))


def _sections(text: str, parsers: dict[str, argparse.ArgumentParser]) -> list[tuple[set[tuple[str, str]], str]]:
    """The `###` sections of docs/cli.md: which (program, subcommand) each is about (subcommand "" for the
    program's own options), by the backticked names in its heading, and its text."""
    out = []
    for part in re.split(r"^(?=##+ )", text, flags=re.M):
        heading, _, body = part.partition("\n")
        if not heading.startswith("### "):
            continue
        about = set()
        for span in re.findall(r"`([^`]+)`", heading):
            words = span.split()
            if words[0] in parsers:
                subs = _subcommands(parsers[words[0]])
                about.add((words[0], words[1] if len(words) > 1 and words[1] in subs else ""))
        out.append((about, body))
    return out


def _rows(body: str) -> dict[str, str]:
    """Option -> its table row, for rows whose first cell names options."""
    rows = {}
    for line in body.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and line.startswith("| `-"):
            for opt in re.findall(r"`(--?[a-z][a-z-]*)", cells[1]):
                rows[opt] = line
    return rows


SHARED = {"-h", "--help", "--run", "--redis-url"}


def test_docs_cli_md_lists_every_command_and_option_with_the_defaults_help_shows() -> None:
    parsers = _parsers()
    sections = _sections((ROOT / "docs" / "cli.md").read_text(), parsers)
    for prog, parser in parsers.items():
        subs = _subcommands(parser)
        for sub, sp in [("", parser), *subs.items()]:
            rows: dict[str, str] = {}
            for about, body in sections:
                if (prog, sub) in about:
                    rows.update(_rows(body))
            where = f"`{prog}{' ' + sub if sub else ''}`"
            assert sub == "" or any((prog, sub) in about for about, _ in sections), f"{where} has no section"
            help_text = " ".join(sp.format_help().split())
            options = {o: a for a in sp._actions for o in a.option_strings if o.startswith("--")}
            for opt, action in options.items():
                if opt in SHARED:
                    continue
                assert opt in rows, f"{where} {opt} is not in docs/cli.md"
                shown = shown_default(action)
                if shown is not None:
                    assert f"(default: {shown})" in help_text, f"{where} --help does not show {opt}'s default"
                    assert re.search(rf"\(default: `?{re.escape(shown)}`?\)", rows[opt]), \
                        f"docs/cli.md: {where} {opt} should say (default: {shown}): {rows[opt]}"
                elif "default" not in (action.help or ""):
                    assert "(default:" not in rows[opt], f"docs/cli.md: {where} {opt} has no default: {rows[opt]}"
            for opt in rows:  # nothing documented that the command does not take
                assert opt in options or opt in SHARED or opt == "-o", f"docs/cli.md: {where} has no option {opt}"
    for about, _ in sections:  # and every section is about a command that exists
        assert about, "a section of docs/cli.md names no command"
