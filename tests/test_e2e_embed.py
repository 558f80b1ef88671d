"""Embedding runs with real parts (issue 30): producer CLI -> Redis/RQ -> `rq worker` processes owning
simulated `--is-embedding` servers -> head -> export. Every vector is checked exactly against the
simulator's public rule (`sglang_sim.embedding.expected_embedding`); a worker killed with -9 loses and
duplicates nothing; a run of the other kind than its fleet is refused once, never sent."""

from __future__ import annotations

import base64
import signal
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.records import Result
from sglang_sim.embedding import expected_embedding

from .fleet import Fleet, write_prompts

pytestmark = pytest.mark.slow

EMB = "/v1/embeddings"
HIDDEN = 256  # tiny-embed's hidden_size
EMBED_ENV = {"SGLANG_SIM_PROFILE": "tiny-embed", "BATCHFLEET_MODEL_PATH": "sim/tiny-embed",
             "BATCHFLEET_SERVER_ARGS": "--is-embedding"}
# `dimensions` is refused by a model that does not declare Matryoshka (0.5.23, as the simulator): this one does
MATRYOSHKA = {**EMBED_ENV,
              "BATCHFLEET_SERVER_ARGS": """--is-embedding --json-model-override-args '{"is_matryoshka": true}'"""}


def embed_rows(n: int) -> list[dict[str, Any]]:
    """Every input form OpenAI takes, both encodings, some with dimensions."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        body: dict[str, Any]
        match i % 5:
            case 0:
                body = {"input": f"document number {i} about things"}
            case 1:
                body = {"input": [f"first {i}", f"second {i} words", f"third {i}"]}
            case 2:
                body = {"input": [i, i + 1, 7], "dimensions": 64}
            case 3:
                body = {"input": [[i, 3], [5, i, 9]], "encoding_format": "base64"}
            case _:
                body = {"input": f"short {i}", "dimensions": 31, "encoding_format": "base64"}
        rows.append({"custom_id": f"e{i}", "method": "POST", "url": EMB, "body": body})
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def vector(item: dict[str, Any]) -> list[float]:
    v = item["embedding"]
    if isinstance(v, str):
        raw = base64.b64decode(v)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return v


def check_line(row: dict[str, Any], line: dict[str, Any]) -> None:
    """One export line is OpenAI's batch output of an embedding, each vector exactly the simulator's."""
    assert line["error"] is None and line["custom_id"] == row["custom_id"], line
    assert set(line) == {"id", "custom_id", "response", "error"}
    resp = line["response"]
    assert resp["status_code"] == 200 and resp["request_id"]
    body, req = resp["body"], row["body"]
    assert body["object"] == "list" and body["model"]
    value = req["input"]
    inputs = [value] if isinstance(value, str) or isinstance(value[0], int) else value
    assert [d["index"] for d in body["data"]] == list(range(len(inputs)))
    for item, one in zip(body["data"], inputs, strict=True):
        assert item["object"] == "embedding"
        expected = expected_embedding(one, hidden_size=HIDDEN, dimensions=req.get("dimensions"))
        assert isinstance(item["embedding"], str) is (req.get("encoding_format") == "base64")
        assert vector(item) == expected
    usage = body["usage"]
    tokens = sum(len(x.split()) if isinstance(x, str) else len(x) for x in inputs)
    assert usage["prompt_tokens"] == usage["total_tokens"] == tokens


def settled(fleet: Fleet) -> int:
    """Prompts of the run with their final line in the store (a result, or failed by the head)."""
    db = sqlite3.connect(fleet.tmp / "state" / f"{fleet.run}.sqlite")
    try:
        return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:  # locked by the head for a moment
        return 0
    finally:
        db.close()


def export(fleet: Fleet, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "results.jsonl"
    fleet.producer("export", str(out))
    return [orjson.loads(x) for x in out.read_bytes().splitlines()]


def test_an_embedding_worker_killed_with_kill_9_loses_and_duplicates_no_line(tmp_path: Path, redis_url: str) -> None:
    fleet = Fleet(tmp_path, redis_url, gpus=2, env={**MATRYOSHKA, "SGLANG_SIM_TIME_SCALE": "0.01"})
    rows = embed_rows(600)
    write_rows(tmp_path / "docs.jsonl", rows)
    fleet.producer("enqueue", "docs.jsonl", "--queues", fleet.queues)
    victim = fleet.start_worker(0)
    fleet.wait_for(lambda: fleet.r.zcard(Keys.started(fleet.queue(0))) >= 20, 60, "gpu0 to have embeddings in flight")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    in_flight = fleet.r.zcard(fleet.k.leases)
    assert in_flight > 0, "the kill must come while prompts are in flight"
    (status,) = [s for s in fleet.statuses() if s.gpu == 0]
    assert status.facts is not None and status.facts.is_generation is False  # learned from /model_info
    fleet.start_worker(1)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 240, "every embedding")
    assert fleet.stop_all()[1] == 0
    lines = export(fleet, tmp_path)
    assert len(lines) == len(rows) and len({x["custom_id"] for x in lines}) == len(rows)  # 0 lost, 0 duplicated
    by_id = {x["custom_id"]: x for x in lines}
    for row in rows:
        check_line(row, by_id[row["custom_id"]])
    stats = fleet.stats()
    assert stats["succeeded"] == len(rows) and stats.get("failed", 0) == 0
    assert int(stats.get("recovered", 0)) >= 1
    served = [fleet.sim_record(g)["requests_by_endpoint"] for g in (0, 1)]
    assert all(set(s) <= {EMB} for s in served), served  # the health probe goes to /health_generate


@pytest.mark.parametrize("server", ["embedding", "generation"])
def test_a_run_of_the_other_kind_than_its_fleet_is_refused_once_and_never_sent(
        tmp_path: Path, redis_url: str, server: str) -> None:
    """A chat/completions run on an embedding server (it would die at the first decode), and an
    embedding run on a generation server: the head fails the run's prompts once with the reason, the
    server gets none of them; a file of that kind for the live fleet is refused at enqueue in one line."""
    embedding = server == "embedding"
    fleet = Fleet(tmp_path, redis_url, gpus=1, env=EMBED_ENV if embedding else {})
    if embedding:
        rows = write_prompts(tmp_path / "in.jsonl", 50, max_tokens=16)
        ids, wrong_url = [r["id"] for r in rows], "/v1/"
    else:
        rows = embed_rows(50)
        write_rows(tmp_path / "in.jsonl", rows)
        ids, wrong_url = [r["custom_id"] for r in rows], EMB
    fleet.producer("enqueue", "in.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)
    fleet.start_head()
    fleet.wait_for(lambda: settled(fleet) >= 50, 120, "the run to end")
    lines = export(fleet, tmp_path)
    assert sorted(x["custom_id"] for x in lines) == sorted(ids)
    for x in lines:
        assert x["response"] is None and x["error"]["code"] == "wrong_endpoint_kind", x
        assert ("needs a generation server" if embedding else "needs an embedding server") in x["error"]["message"]
    said = [ln for ln in fleet.head_log().splitlines() if "failed without being sent" in ln]
    worker_said = [ln for ln in fleet.worker_log(0).splitlines() if "not sent" in ln]
    assert len(said) + len(worker_said) >= 1 and len(said) <= 1 and len(worker_said) <= 1, (said, worker_said)
    served = fleet.sim_record(0)["requests_by_endpoint"]
    assert not any(ep.startswith(wrong_url) for ep in served), served

    # the fleet is live and said what it serves: another file of that kind is refused before anything is stored
    again = tmp_path / "more.jsonl"
    if embedding:
        write_prompts(again, 5, max_tokens=16, start=100)
    else:
        write_rows(again, [{**r, "custom_id": "x" + r["custom_id"]} for r in embed_rows(5)])
    done = fleet.producer("enqueue", "more.jsonl", "--queues", fleet.queues, check=False)
    err = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 2 and len(err) == 1 and "more.jsonl:1:" in err[0] and "nothing of" in err[0], done.stderr
    assert "Traceback" not in done.stderr
    assert fleet.stop_all()[0] == 0


def test_a_worker_pauses_when_the_results_stream_holds_about_its_byte_bound_and_resumes_when_collected(
        tmp_path: Path, redis_url: str) -> None:
    """An embedding result carries its vectors (here ~80 KB a line of 16 inputs): with the head stopped, the
    count bound (500,000 entries) let Redis fill its memory. The byte bound pauses the worker once the stream
    holds about BATCHFLEET_MAX_PENDING_RESULT_BYTES (what is in flight then still finishes), and it takes
    work again once the head has collected; every line exactly once."""
    bound, n, in_flight = 2 * 1024 * 1024, 120, 4
    fleet = Fleet(tmp_path, redis_url, gpus=1, env={**EMBED_ENV, "BATCHFLEET_MAX_PENDING_RESULT_BYTES": str(bound),
                                                   "BATCHFLEET_MAX_IN_FLIGHT": str(in_flight)})
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": EMB,
             "body": {"input": [f"document {i} part {j} of many" for j in range(16)]}} for i in range(n)]
    write_rows(tmp_path / "docs.jsonl", rows)
    fleet.producer("enqueue", "docs.jsonl", "--queues", fleet.queues)
    fleet.start_worker(0)  # no head: nothing collects
    fleet.wait_for(lambda: "results stream holds" in fleet.worker_log(0), 120, "the worker to pause")
    lengths = [-1]

    def settled_stream() -> bool:  # the prompts in flight at the pause have finished: the stream stops growing
        lengths.append(fleet.r.xlen(fleet.k.results))
        time.sleep(0.5)
        return lengths[-1] == lengths[-2] and fleet.r.zcard(fleet.k.leases) == 0

    fleet.wait_for(settled_stream, 60, "the paused worker's last prompts to finish")
    entries = fleet.r.xrange(fleet.k.results)
    held = [len(f[b"r"]) for _, f in entries]
    # the vectors travel as the server's JSON text (Result.raw_body): the collector parses no float of them
    first = Result.from_json(entries[0][1][b"r"])
    assert first.body is None and orjson.loads(first.raw_body)["object"] == "list"
    size = sum(held) / len(held)
    assert len(held) < n and fleet.finished() == len(held), (len(held), n)
    # about the bound: past it (the pause), and by no more than what was in flight and being written then
    assert bound * 0.95 < sum(held) <= bound + 2 * in_flight * size, (sum(held), bound, size)
    fleet.start_head()
    fleet.wait_for(lambda: fleet.finished() >= n, 240, "the paused worker to resume and finish")
    assert "taking work again" in fleet.worker_log(0)
    assert fleet.stop_all()[0] == 0
    lines = export(fleet, tmp_path)
    assert len(lines) == n and len({x["custom_id"] for x in lines}) == n  # 0 lost, 0 duplicated
    by_id = {x["custom_id"]: x for x in lines}
    for row in rows:
        check_line(row, by_id[row["custom_id"]])
    assert fleet.stats()["succeeded"] == n
