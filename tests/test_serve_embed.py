"""`batchfleet serve` runs `/v1/embeddings` batches (issue 30), driven by the official `openai` client
against two simulated `--is-embedding` GPUs: OpenAI's batch output shape, every vector exactly
`sglang_sim.embedding.expected_embedding`, the batch's usage, each request served once."""

from __future__ import annotations

import base64
import struct
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from sglang_sim.embedding import expected_embedding

from .conftest import free_port_block
from .serveproc import Serve, serve_env, write_lines

pytestmark = pytest.mark.slow
EMB = "/v1/embeddings"


def test_the_openai_client_runs_an_embedding_batch_and_gets_every_vector_exactly(
        tmp_path: Path, redis_url: str) -> None:
    env = serve_env(tmp_path, redis_url, BATCHFLEET_PORT_BASE=str(free_port_block(2)),
                    SGLANG_SIM_PROFILE="embed-0.6b-96gb", BATCHFLEET_MODEL_PATH="sim/embed-0.6b",
                    BATCHFLEET_SERVER_ARGS="--is-embedding", SGLANG_SIM_TIME_SCALE="5")
    sv = Serve(tmp_path, redis_url, "--gpus", "0-1", "--dry-run", env=env).start()
    client = sv.client()
    sent: list[dict[str, Any]] = []
    for i in range(60):
        value: Any = [f"doc {i} a", f"doc {i} b"] if i % 3 == 0 else ([i, 5, 9] if i % 3 == 1 else f"text {i} here")
        body: dict[str, Any] = {"model": "sim/embed-0.6b", "input": value}
        if i % 4 == 0:
            body["encoding_format"] = "base64"
        sent.append({"custom_id": f"req-{i}", "method": "POST", "url": EMB, "body": body})
    f = client.files.create(file=write_lines(tmp_path / "docs.jsonl", sent).open("rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=EMB, completion_window="24h")
    assert b.endpoint == EMB
    deadline = time.monotonic() + 240
    while (b := client.batches.retrieve(b.id)).status != "completed":
        assert b.status not in ("failed", "cancelled", "expired") and time.monotonic() < deadline, b
        time.sleep(0.2)
    assert b.request_counts is not None and (b.request_counts.completed, b.request_counts.failed) == (60, 0)
    assert b.output_file_id is not None and b.error_file_id is None
    lines = [orjson.loads(x) for x in client.files.content(b.output_file_id).content.splitlines()]
    assert [x["custom_id"] for x in lines] == [s["custom_id"] for s in sent]
    tokens = 0
    for line, req in zip(lines, sent, strict=True):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "list" and isinstance(body["model"], str)
        value = req["body"]["input"]
        inputs = [value] if isinstance(value, str) or isinstance(value[0], int) else value
        assert [d["index"] for d in body["data"]] == list(range(len(inputs)))
        for item, one in zip(body["data"], inputs, strict=True):
            got = item["embedding"]
            if req["body"].get("encoding_format") == "base64":
                raw = base64.b64decode(got)
                got = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            assert item["object"] == "embedding" and got == expected_embedding(one, hidden_size=1024)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        tokens += body["usage"]["prompt_tokens"]
    assert b.usage is not None and (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (
        tokens, 0, tokens)
    served = 0
    for g in (0, 1):
        path = tmp_path / f"sim-gpu{g}.json"
        if path.exists():
            rec = orjson.loads(path.read_bytes())
            assert set(rec["requests_by_endpoint"]) <= {EMB}, rec["requests_by_endpoint"]
            served += rec["requests_by_endpoint"].get(EMB, 0)
    assert served == 60  # every request reached a server exactly once
    assert sv.stop() == 0, sv.log()
