"""Line validation: both input formats, and every kind of bad line (pure logic, no Redis)."""

from __future__ import annotations

import orjson
import pytest

from producer.parse import Reject, parse_line, parse_param

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def line(d: object) -> bytes:
    return orjson.dumps(d)


def test_openai_batch_chat_is_sent_as_is_with_defaults_filled() -> None:
    raw = line({"custom_id": "r1", "method": "POST", "url": CHAT,
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}})
    cid, url, body = parse_line(raw, {"max_tokens": 100, "temperature": 0.2}, "default")
    assert (cid, url) == ("r1", CHAT)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "temperature": 0.2}


def test_openai_batch_completions_gets_default_model() -> None:
    cid, url, body = parse_line(line({"custom_id": "r2", "method": "POST", "url": COMP,
                                      "body": {"prompt": "Once"}}), {}, "qwen")
    assert (cid, url, body) == ("r2", COMP, {"prompt": "Once", "model": "qwen"})


def test_simple_prompt_and_messages() -> None:
    cid, url, body = parse_line(line({"id": 7, "prompt": "Once", "temperature": 0.5,
                                      "sampling_params": {"max_new_tokens": 9}}), {}, "default")
    assert (cid, url) == ("7", COMP)
    assert body == {"prompt": "Once", "temperature": 0.5, "max_tokens": 9, "model": "default"}
    cid, url, body = parse_line(line({"custom_id": "c", "messages": [{"role": "user", "content": "x"}]}),
                                {"top_p": 0.9}, "default")
    assert (cid, url) == ("c", CHAT)
    assert body == {"messages": [{"role": "user", "content": "x"}], "top_p": 0.9, "model": "default"}


BAD = [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (line({"prompt": "x"}), "no custom_id or id"),
    (line({"id": "", "prompt": "x"}), "id is empty"),
    (line({"id": 1.5, "prompt": "x"}), "id must be a string or an integer"),
    (line({"id": True, "prompt": "x"}), "id must be a string or an integer"),
    (line({"id": "a"}), "no prompt or messages"),
    (line({"id": "a", "prompt": "x", "messages": []}), "both prompt and messages"),
    (line({"id": "a", "prompt": 3}), "prompt must be a non-empty string"),
    (line({"id": "a", "messages": [{"content": "x"}]}), "messages[0] must be an object"),
    (line({"id": "a", "messages": "hi"}), "messages must be a non-empty list"),
    (line({"id": "a", "prompt": "x", "temprature": 1}), "unknown sampling key 'temprature'"),
    (line({"id": "a", "prompt": "x", "max_tokens": "10"}), "max_tokens must be a positive integer"),
    (line({"id": "a", "prompt": "x", "temperature": None}), "temperature must be a number"),
    (line({"id": "a", "prompt": "x", "sampling_params": []}), "sampling_params must be an object"),
    (line({"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"input": "x"}}), "unknown url"),
    (line({"custom_id": "a", "method": "GET", "url": COMP, "body": {"prompt": "x"}}), "method must be POST"),
    (line({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"prompt": "x"}}), "takes messages"),
    (line({"custom_id": "a", "method": "POST", "url": COMP, "body": {"prompt": "x", "stream": True}}), "stream"),
    (line({"custom_id": "a", "method": "POST", "url": COMP, "body": {"prompt": "x", "top_q": 1}}),
     "unknown sampling key 'top_q'"),
    (line({"custom_id": "a", "method": "POST", "url": COMP, "body": "x"}), "body must be an object"),
]


@pytest.mark.parametrize(("raw", "reason"), BAD, ids=[r for _, r in BAD])
def test_bad_lines_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(Reject, match=reason.replace("[", r"\[").replace("]", r"\]")):
        parse_line(raw, {}, "default")


def test_param_values_are_json_or_strings_and_checked() -> None:
    assert parse_param("top_k=20") == ("top_k", 20)
    assert parse_param("stop=END") == ("stop", "END")
    assert parse_param("max_new_tokens=5") == ("max_tokens", 5)
    with pytest.raises(Reject):
        parse_param("bogus=1")
    with pytest.raises(Reject):
        parse_param("seed=1.5")
