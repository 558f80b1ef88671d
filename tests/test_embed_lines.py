"""`/v1/embeddings` lines (issue 30): the parse rules (OpenAI's `input` forms, `dimensions`,
`encoding_format`, no sampling), the worker's check of a job's request, and `producer enqueue`
refusing a file (or a run) that mixes embedding and generation requests, with one line."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from batchfleet.prompts import InvalidPrompt, check_body
from batchfleet.records import ENDPOINTS
from producer.parse import Reject, parse_line

from .test_producer_helpers import RUN, Cli, make_cli, queued_ids, simple, write_jsonl

EMB = "/v1/embeddings"


def batch(body: dict[str, Any], cid: str = "e1") -> bytes:
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": EMB, "body": body})


def test_the_endpoint_is_appended_so_stored_indices_keep_their_meaning() -> None:
    assert ENDPOINTS[:2] == ("/v1/chat/completions", "/v1/completions") and ENDPOINTS[2] == EMB


@pytest.mark.parametrize("value", ["a short document", ["one", "two words"], [7, 42, 0], [[1, 2], [3]]])
def test_every_input_form_openai_takes_is_accepted_and_sent_as_is(value: Any) -> None:
    cid, url, body = parse_line(batch({"input": value, "dimensions": 64, "encoding_format": "base64"}), {}, "m")
    assert (cid, url) == ("e1", EMB)
    assert body == {"input": value, "dimensions": 64, "encoding_format": "base64", "model": "m"}


def test_the_simple_form_with_input_is_an_embedding() -> None:
    cid, url, body = parse_line(orjson.dumps({"id": 3, "input": "x y", "dimensions": 8}), {}, "m")
    assert (cid, url, body) == ("3", EMB, {"input": "x y", "dimensions": 8, "model": "m"})


@pytest.mark.parametrize(("body", "words"), [
    ({}, "has no input"),
    ({"input": ""}, "empty or whitespace"),
    ({"input": "   "}, "empty or whitespace"),
    ({"input": []}, "not empty"),
    ({"input": ["a", ""]}, "input[1] must be a non-empty string"),
    ({"input": ["a", 3]}, "input[1] must be a non-empty string"),
    ({"input": [1, "a"]}, "token ids"),
    ({"input": [1, -2]}, "non-negative"),
    ({"input": [1, True]}, "token ids"),
    ({"input": [[1], []]}, "input[1] must be a non-empty list"),
    ({"input": [[1], 2]}, "input[1] must be a non-empty list"),
    ({"input": {"text": "x"}}, "input must be a string"),
    ({"input": [1.5]}, "input must be a string"),
    ({"input": "x", "dimensions": 0}, "dimensions must be a positive integer"),
    ({"input": "x", "dimensions": "8"}, "dimensions must be a positive integer"),
    ({"input": "x", "dimensions": True}, "dimensions must be a positive integer"),
    ({"input": "x", "encoding_format": "hex"}, 'encoding_format must be "float" or "base64"'),
    ({"input": "x", "max_tokens": 8}, "'max_tokens' is not a /v1/embeddings key"),
    ({"input": "x", "messages": []}, "'messages' is not a /v1/embeddings key"),
    ({"input": "x", "stream": True}, "stream is not used in batch"),
])
def test_a_malformed_embedding_line_is_refused_with_its_reason(body: dict[str, Any], words: str) -> None:
    with pytest.raises(Reject, match=None) as exc:
        parse_line(batch(body), {}, "m")
    assert words in str(exc.value)


def test_the_worker_holds_a_job_to_the_same_rules() -> None:
    check_body(EMB, {"input": ["a"], "model": "m", "user": "u"})
    with pytest.raises(InvalidPrompt, match="not a /v1/embeddings key"):
        check_body(EMB, {"input": ["a"], "temperature": 0})
    with pytest.raises(InvalidPrompt, match="unknown sampling key 'input'"):
        check_body("/v1/completions", {"prompt": "x", "input": "y"})


# --- one kind per run, at enqueue ------------------------------------------------------------------
@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def stored(tmp_path: Path) -> int:
    path = tmp_path / "state" / f"{RUN}.sqlite"
    return sqlite3.connect(path).execute("SELECT COUNT(*) FROM prompts").fetchone()[0] if path.exists() else 0


def embeds(n: int, prefix: str = "e") -> list[object]:
    return [{"id": f"{prefix}{i}", "input": f"document {i}"} for i in range(n)]


@pytest.mark.parametrize("at", [3, 7000])  # in the first store batch, and after one was written
def test_a_file_that_mixes_kinds_is_refused_with_one_line_and_nothing_stored(
        cli: Cli, r: redis.Redis, tmp_path: Path, at: int) -> None:
    rows = embeds(at) + simple(1, "g") + embeds(5, "z")
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    rc, _, err = cli("enqueue", str(f), "--no-progress")
    assert rc == 2
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert f"mixed.jsonl:{at + 1}: a generation request (/v1/completions)" in lines[0]
    assert "embedding requests" in lines[0] and "nothing of" in lines[0] and "Traceback" not in err
    assert stored(tmp_path) == 0 and queued_ids(r, "gpu0") == []


def test_a_file_of_the_other_kind_than_the_run_holds_is_refused(cli: Cli, r: redis.Redis, tmp_path: Path) -> None:
    assert cli("enqueue", str(write_jsonl(tmp_path / "a.jsonl", embeds(4))), "--no-progress")[0] == 0
    rc, _, err = cli("enqueue", str(write_jsonl(tmp_path / "b.jsonl", simple(3))), "--no-progress")
    assert rc == 2 and f"run {RUN} holds embedding requests" in err and len(err.strip().splitlines()) == 1
    assert stored(tmp_path) == 4
    # the same kind again is fine
    assert cli("enqueue", str(write_jsonl(tmp_path / "c.jsonl", embeds(2, "x"))), "--no-progress")[0] == 0
    assert stored(tmp_path) == 6
