"""`batchfleet serve` refuses, at creation, a batch its fleet cannot serve (issue 30: "a chat line sent to
an embedding fleet, and an embedding line sent to a chat fleet, are each refused up front with one
line, not per prompt at run time"), driven by the official `openai` client. The serve runs the API and
the head, no GPU; a stand-in worker's status record says what its server is, as a real worker writes it
(`/model_info` is_generation in its facts: tests/test_e2e_embed.py checks a real one does)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import redis

from batchfleet.keys import STATUS_TTL_S, Keys
from batchfleet.records import ServerFacts, WorkerStatus

from .serveproc import Serve, batch_lines, write_lines

EMB = "/v1/embeddings"
CHAT = "/v1/chat/completions"


def stand_in(redis_url: str, run: str, *, generates: bool | None) -> None:
    """A live worker of the run whose server said it generates (True), embeds (False), or nothing yet."""
    name = f"h.{run}.gpu0.1"
    ws = WorkerStatus(worker=name, host="h", queue=f"{run}.gpu0", gpu=0, state="serving", effective_max=8,
                      facts=ServerFacts(effective_max_running=8, is_generation=generates))
    r = redis.Redis.from_url(redis_url)
    r.set(Keys(run).status(name), ws.to_json(), ex=STATUS_TTL_S)
    r.sadd(Keys(run).workers, name)


def embed_lines(n: int) -> list[dict]:
    return [{"custom_id": f"e-{i}", "method": "POST", "url": EMB, "body": {"model": "m", "input": f"doc {i}"}}
            for i in range(n)]


def test_a_batch_of_the_other_kind_than_the_live_workers_serve_is_refused_at_creation_in_openais_shape(
        tmp_path: Path, redis_url: str) -> None:
    sv = Serve(tmp_path, redis_url).start()
    client = sv.client()
    chat = client.files.create(file=write_lines(tmp_path / "chat.jsonl", batch_lines(3)).open("rb"), purpose="batch")
    docs = client.files.create(file=write_lines(tmp_path / "docs.jsonl", embed_lines(3)).open("rb"), purpose="batch")

    # no worker has said what it serves: accepted, as before (the head fails the other kind once)
    stand_in(redis_url, sv.run, generates=None)
    before = [client.batches.create(input_file_id=f.id, endpoint=ep, completion_window="24h").id  # type: ignore[arg-type]
              for f, ep in ((chat, CHAT), (docs, EMB))]

    for generates, refused, fits, words in (
            (False, (chat, CHAT), (docs, EMB), f"{CHAT} needs a generation server, and the fleet's servers embed"),
            (True, (docs, EMB), (chat, CHAT), f"{EMB} needs an embedding server, and the fleet's servers generate")):
        stand_in(redis_url, sv.run, generates=generates)
        with pytest.raises(openai.BadRequestError) as exc:
            client.batches.create(input_file_id=refused[0].id, endpoint=refused[1],  # type: ignore[arg-type]
                                  completion_window="24h")
        err = exc.value  # OpenAI's error shape: message, type, param, code
        assert (err.status_code, err.type, err.param, err.code) == (400, "invalid_request_error", "endpoint",
                                                                    "invalid_value"), err.body
        assert words in err.message and "live workers" in err.message, err.message
        ok = client.batches.create(input_file_id=fits[0].id, endpoint=fits[1],  # type: ignore[arg-type]
                                   completion_window="24h")
        assert ok.endpoint == fits[1]
        before.append(ok.id)
    assert sorted(b.id for b in client.batches.list()) == sorted(before)  # the refused ones were never made
    assert sv.stop() == 0, sv.log()
