"""`batchfleet serve --gpus` end to end on simulated GPUs, driven by the official `openai` client and by
curl as the README shows: real `rq worker` processes with simulated SGLang servers, the head and the
supervisor, all started by serve. What an outsider sees: the batches' objects and files, and what the
simulated servers say they served."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from openai.types import Batch

from .conftest import free_port_block
from .fleet import ROOT, gone, text_of
from .serveproc import Serve, batch_lines, expected, serve_env, write_lines

pytestmark = pytest.mark.slow
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def gpu_serve(tmp: Path, redis_url: str, *args: str, **env: str) -> Serve:
    e = serve_env(tmp, redis_url, BATCHFLEET_PORT_BASE=str(free_port_block(2)), **env)
    return Serve(tmp, redis_url, "--gpus", "0-1", "--dry-run", *args, env=e)


def records(tmp: Path) -> list[dict[str, Any]]:
    out = []
    for g in (0, 1):
        path = tmp / f"sim-gpu{g}.json"
        if path.exists():
            out.append(orjson.loads(path.read_bytes()))
    return out


def served(tmp: Path) -> int:
    """Requests the simulated servers say they served (the records of the last servers on each GPU)."""
    return sum(sum(rec["requests_by_endpoint"].get(ep, 0) for ep in ENDPOINTS) for rec in records(tmp))


def wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 240,
               seen: list[str] | None = None) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if seen is not None and (not seen or seen[-1] != b.status):
            seen.append(b.status)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}: {b.request_counts}"
        time.sleep(0.1)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).content.splitlines()]


def check_output(lines: list[dict[str, Any]], sent: list[dict[str, Any]]) -> None:
    """Every custom_id once, in input order, each with the answer its request asked for."""
    assert [x["custom_id"] for x in lines] == [s["custom_id"] for s in sent]
    for line, req in zip(lines, sent, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert text_of(line["response"]["body"]) == expected(req)


def test_the_openai_client_runs_two_batches_on_two_simulated_gpus_and_gets_every_answer_exactly_once(
        tmp_path: Path, redis_url: str) -> None:
    sv = gpu_serve(tmp_path, redis_url, SGLANG_SIM_TIME_SCALE="40").start()
    client = sv.client()
    chat = batch_lines(40, max_tokens=24)
    completions = batch_lines(30, url="/v1/completions", max_tokens=16)  # the same custom_ids: req-0 ...
    f1 = client.files.create(file=write_lines(tmp_path / "chat.jsonl", chat).open("rb"), purpose="batch")
    f2 = client.files.create(file=write_lines(tmp_path / "comp.jsonl", completions).open("rb"), purpose="batch")
    b1 = client.batches.create(input_file_id=f1.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"part": "chat"})
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="24h")
    seen: list[str] = []
    done1 = wait_batch(client, b1.id, {"completed"}, seen=seen)
    done2 = wait_batch(client, b2.id, {"completed"})
    order = ["validating", "in_progress", "finalizing", "completed"]
    assert b1.status == "validating" and seen[-1] == "completed"
    assert [order.index(x) for x in seen] == sorted({order.index(x) for x in seen}), seen  # forward only
    for b, sent in ((done1, chat), (done2, completions)):
        assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at  # type: ignore[operator]
        assert b.request_counts is not None and (b.request_counts.total, b.request_counts.completed,
                                                 b.request_counts.failed) == (len(sent), len(sent), 0)
        assert b.error_file_id is None and b.output_file_id is not None
        out = lines_of(client, b.output_file_id)
        check_output(out, sent)
        assert b.usage is not None and b.usage.output_tokens == sum(
            x["response"]["body"]["usage"]["completion_tokens"] for x in out) > 0
        assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    # validated into the store in creation order; both run at once (the window holds both), so the second,
    # with shorter answers, may end first: completion order is not promised
    assert done1.metadata == {"part": "chat"} and done1.in_progress_at <= done2.in_progress_at  # type: ignore[operator]
    assert served(tmp_path) == 70  # every request reached a server exactly once
    out_file = client.files.retrieve(done1.output_file_id)  # type: ignore[arg-type]
    assert (out_file.purpose, out_file.filename) == ("batch_output", f"{done1.id}_output.jsonl")
    assert sv.stop() == 0, sv.log()
    log = sv.log()
    assert "started 2 worker(s)" in log and "the head, the supervisor (advising only)" in log, log


def test_a_cancelled_batch_keeps_its_partial_output_and_the_fleet_serves_the_next_batch(
        tmp_path: Path, redis_url: str) -> None:
    # 4 in flight per GPU, about a second each: the batch takes ~10 s, so a cancel lands mid-batch
    sv = gpu_serve(tmp_path, redis_url, SGLANG_SIM_TIME_SCALE="1", BATCHFLEET_MAX_IN_FLIGHT="4").start()
    client = sv.client()
    sent = batch_lines(80, max_tokens=48)
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", sent).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (now := client.batches.retrieve(b.id)).request_counts.completed < 5:  # type: ignore[union-attr]
        assert now.status == "validating" or now.status == "in_progress", now
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    assert client.batches.cancel(b.id).status == "cancelling"
    b = wait_batch(client, b.id, {"cancelled"}, timeout_s=60)
    assert b.cancelling_at is not None and b.cancelled_at is not None and b.completed_at is None
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert b.request_counts is not None and b.request_counts.completed == len(out) >= 5
    ids = [x["custom_id"] for x in out + err]
    assert [i for i, n in Counter(ids).items() if n > 1] == [] and sorted(ids) == sorted(s["custom_id"] for s in sent)
    assert {x["error"]["code"] for x in err} == {"batch_cancelled"} and len(err) == 80 - len(out) > 0
    by_id = {s["custom_id"]: s for s in sent}
    assert all(text_of(x["response"]["body"]) == expected(by_id[x["custom_id"]]) for x in out)
    # the fleet goes on: the next batch runs to the end
    nxt = batch_lines(6, prefix="next-", max_tokens=8)
    f2 = client.files.create(file=write_lines(tmp_path / "next.jsonl", nxt).open("rb"), purpose="batch")
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/chat/completions", completion_window="24h")
    check_output(lines_of(client, wait_batch(client, b2.id, {"completed"}).output_file_id), nxt)


def test_after_a_cancel_the_servers_stop_generating_within_seconds(tmp_path: Path, redis_url: str) -> None:
    """Long generations in flight on both GPUs; the batch is cancelled: within 1 s of the cancel ending,
    no simulated server runs or queues a request. Leases of 900 s (a worker renews them when it starts,
    then every 300 s) keep the old road, a worker finding its leases gone at its next beat, out of the
    measure: only the announced drop (bf:<run>:drop, bf:<run>:signals) can stop them in time. The servers
    notice a closed connection as SGLang does, at their next 4 s check: only an abort by rid is in time."""
    sv = gpu_serve(tmp_path, redis_url, SGLANG_SIM_TIME_SCALE="1", BATCHFLEET_LEASE_TTL_S="900",
                   SGLANG_SIM_DISCONNECT_CHECK_S="4").start()
    client = sv.client()
    sent = batch_lines(40, max_tokens=1500)
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", sent).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_batch(client, b.id, {"in_progress"}, timeout_s=60)
    deadline = time.monotonic() + 120
    while not (len(recs := records(tmp_path)) == 2 and all(r["running"] > 0 for r in recs)):
        assert time.monotonic() < deadline, recs
        time.sleep(0.2)
    client.batches.cancel(b.id)
    wait_batch(client, b.id, {"cancelled"}, timeout_s=30)
    stopped_by = time.monotonic() + 1.0
    while not all(r["running"] == 0 and r["queued"] == 0 for r in records(tmp_path)):
        assert time.monotonic() < stopped_by, [(r["running"], r["queued"]) for r in records(tmp_path)]
        time.sleep(0.1)
    assert all(r["aborted_total"] > 0 for r in records(tmp_path))  # the servers saw the aborts


def test_a_kill_9_of_serve_mid_batch_and_a_restart_complete_the_batch_exactly_once(
        tmp_path: Path, redis_url: str) -> None:
    sv = gpu_serve(tmp_path, redis_url, SGLANG_SIM_TIME_SCALE="6").start()
    client = sv.client()
    sent = batch_lines(120, max_tokens=32)
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", sent).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (now := client.batches.retrieve(b.id)).request_counts.completed < 10:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    servers = [r["pid"] for r in records(tmp_path)]
    sv.kill()
    # its workers died with it, and their servers with them: nothing holds the GPUs for the restart
    assert all(gone(pid, 30) for pid in servers), f"servers {servers} outlived the serve killed with -9"
    sv.start()
    done = wait_batch(client, b.id, {"completed"})
    assert done.request_counts is not None and (done.request_counts.total, done.request_counts.completed) == (120, 120)
    check_output(lines_of(client, done.output_file_id), sent)
    assert done.error_file_id is None
    assert re.search(r"batch \S+: 120 request\(s\) validated", sv.log_path.with_name(
        sv.log_path.name.replace("-2.log", "-1.log")).read_text())
    assert "validated" not in sv.log()  # the restarted serve found the batch in the store: not validated again


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="the README's flow needs curl and jq "
                    "(.ci/run installs them)")
def test_the_readme_curl_flow_runs_as_written(tmp_path: Path, redis_url: str) -> None:
    block = re.search(r"<!-- serve-curl:.*?-->\n```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README: the curl block of `batchfleet serve` is marked <!-- serve-curl: ... -->"
    key = "sk-readme-7f3e21"
    sv = gpu_serve(tmp_path, redis_url, SGLANG_SIM_TIME_SCALE="40")
    sv.env["BATCHFLEET_API_KEYS"] = key
    sv.start()
    sent = batch_lines(12, max_tokens=16)
    write_lines(tmp_path / "requests.jsonl", sent)
    script = block.group(1).replace("localhost:8000", f"127.0.0.1:{sv.port}").replace("sleep 10", "sleep 0.2")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, timeout=240,
                          env={**os.environ, "KEY": key}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    check_output([orjson.loads(x) for x in (tmp_path / "results.jsonl").read_bytes().splitlines()], sent)
