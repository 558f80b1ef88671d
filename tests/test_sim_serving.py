"""Simulator HTTP API: shapes, errors, limits, determinism, concurrency."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from sglang_sim.textgen import expected_completion, render_chat
from tests.simproc import SimProc, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}


@pytest.fixture(scope="module")
def sim():
    with start_sim("--enable-metrics", "--served-model-name", "sim-model", env=FAST) as s:
        yield s


def test_info_endpoints(sim: SimProc) -> None:
    info = httpx.get(sim.url + "/server_info").json()
    assert info["status"] == "ready" and info["version"] == "0.5.23"
    assert info["max_running_requests"] is None
    assert info["mamba_radix_cache_strategy"] == "extra_buffer"
    assert info["max_req_input_len"] < 4096 and info["max_total_num_tokens"] > 0
    st = info["internal_states"][0]
    assert st["effective_max_running_requests_per_dp"] == 12
    assert st["max_mamba_cache_size"] == 61
    assert {"weight", "kvcache", "token_capacity"} <= set(st["memory_usage"])
    assert "last_gen_throughput" in st
    assert httpx.get(sim.url + "/get_server_info").json()["version"] == "0.5.23"
    mi = httpx.get(sim.url + "/model_info").json()
    assert mi["model_path"] == "sim/model" and mi["is_generation"] is True
    assert httpx.get(sim.url + "/get_model_info").status_code == 200
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["data"][0]["id"] == "sim-model"
    assert httpx.get(sim.url + "/health").status_code == 200
    assert httpx.get(sim.url + "/ready").status_code == 200


def test_generate_single_batch_and_determinism(sim: SimProc) -> None:
    params = {"max_new_tokens": 40, "temperature": 0.7}
    r = httpx.post(sim.url + "/generate", json={"text": "tell me a story", "sampling_params": params}).json()
    text, n, finish = expected_completion("tell me a story", params)
    assert r["text"] == text and r["meta_info"]["completion_tokens"] == n
    assert r["meta_info"]["finish_reason"]["type"] == finish
    assert r["meta_info"]["prompt_tokens"] == 4
    assert len(r["output_ids"]) == n
    assert {"id", "cached_tokens", "e2e_latency", "num_retractions"} <= set(r["meta_info"])
    again = httpx.post(sim.url + "/generate", json={"text": "tell me a story", "sampling_params": params}).json()
    assert again["text"] == r["text"]
    other = httpx.post(sim.url + "/generate", json={"text": "tell me a story",
                                                    "sampling_params": {**params, "temperature": 0.1}}).json()
    assert other["text"] != r["text"]
    batch = httpx.post(sim.url + "/generate", json={"text": ["a b", "c d e"],
                                                    "sampling_params": {"max_new_tokens": 5}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[1]["text"] == expected_completion("c d e", {"max_new_tokens": 5})[0]


def test_finish_reasons_vary() -> None:
    finishes = {expected_completion(f"prompt number {i}", {"max_new_tokens": 64})[2] for i in range(60)}
    assert finishes == {"stop", "length"}
    _t, n, f = expected_completion("x", {"max_new_tokens": 7, "ignore_eos": True})
    assert (n, f) == (7, "length")


def test_generate_stream(sim: SimProc) -> None:
    chunks = []
    with httpx.stream("POST", sim.url + "/generate",
                      json={"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 30}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    import json

    last = json.loads(chunks[-2])
    assert last["text"] == expected_completion("stream me", {"max_new_tokens": 30})[0]
    assert last["meta_info"]["finish_reason"] is not None


def test_openai_completions_and_chat(sim: SimProc) -> None:
    r = httpx.post(sim.url + "/v1/completions", json={"model": "whatever", "prompt": "hello there", "max_tokens": 12})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["model"] == "whatever"
    text, n, finish = expected_completion("hello there", {"max_new_tokens": 12})
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": 2 + n,
                             "prompt_tokens_details": None}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = httpx.post(sim.url + "/v1/chat/completions", json={"model": "m", "messages": msgs,
                                                               "max_tokens": 9}).json()
    text, n, finish = expected_completion(render_chat(msgs), {"max_new_tokens": 9})
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["completion_tokens"] == n
    with httpx.stream("POST", sim.url + "/v1/chat/completions",
                      json={"model": "m", "messages": msgs, "max_tokens": 9, "stream": True}) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_errors(sim: SimProc) -> None:
    r = httpx.post(sim.url + "/generate", json={"text": "x", "sampling_params": {"max_tokens": 5}})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]
    long = " ".join(["w"] * 5000)
    r = httpx.post(sim.url + "/generate", json={"text": long})
    assert r.status_code == 400
    assert "The input (5000 tokens) is longer than the model's context length (4096 tokens)." in r.text
    r = httpx.post(sim.url + "/v1/completions", json={"model": "m", "prompt": long, "max_tokens": 5})
    err = r.json()
    assert r.status_code == 400 and err["object"] == "error" and err["code"] == 400 and "message" in err


def test_metrics(sim: SimProc) -> None:
    text = httpx.get(sim.url + "/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "full_token_usage",
                 "mamba_usage", "num_used_tokens", "cache_hit_rate", "num_retracted_reqs", "max_total_num_tokens",
                 "context_len", "prompt_tokens_total", "generation_tokens_total", "num_requests_total",
                 "num_aborted_requests_total", "num_retracted_requests_total"):
        assert f"sglang:{name}{{" in text, name
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        assert f"sglang:{h}_bucket{{" in text and f"sglang:{h}_count{{" in text
    assert 'model_name="sim-model"' in text and 'engine_type="unified"' in text and 'tp_rank="0"' in text


def test_metrics_absent_without_flag_and_api_key() -> None:
    with start_sim("--api-key", "sekret", env=FAST) as sim:
        assert httpx.get(sim.url + "/metrics").status_code == 404
        assert httpx.post(sim.url + "/generate", json={"text": "x"}).status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(sim.url + "/generate", json={"text": "x"}, headers=auth).status_code == 200
        assert httpx.get(sim.url + "/v1/models", headers={"Authorization": "Bearer no"}).status_code == 401


async def _flood(url: str, n: int, params: dict, prefix: str = "p") -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
        return await asyncio.gather(*[
            c.post(url + "/generate", json={"text": f"{prefix} {i} " + "w " * 20, "sampling_params": params})
            for i in range(n)])


@pytest.mark.parametrize(("flags", "cap"), [
    ([], 12), (["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"], 20)])
def test_peak_running_is_effective_capacity(flags: list[str], cap: int) -> None:
    # Generations that cannot finish while the flood arrives (real time, 3000 tokens): all 40 are in the
    # server at once whatever the machine's load, so the cap is reached by construction, never by luck
    # (with 60-token generations a loaded client sent the last requests after the first had finished).
    n = 40
    with start_sim(*flags, "--max-running-requests", "64", env={**FAST, "SGLANG_SIM_TIME_SCALE": "1"}) as sim:
        async def flood() -> tuple[list[httpx.Response], dict, dict]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as c:
                params = {"max_new_tokens": 3000, "ignore_eos": True}
                sent = [asyncio.create_task(c.post(sim.url + "/generate", json={
                    "text": f"p {i} " + "w " * 20, "rid": f"flood-{i}", "sampling_params": params}))
                    for i in range(n)]
                for _ in range(600):  # up to 30 s for a loaded client to send them all
                    await asyncio.sleep(0.05)
                    obs = (await c.get(sim.url + "/sim/observed")).json()
                    if obs["running"] + obs["queued"] == n:
                        break
                # Ten decode steps (each a scheduler tick that would admit past the cap, if it did), counted
                # by the tokens they generate: at least `cap` a step.
                tokens = obs["generation_tokens_total"]
                for _ in range(600):
                    during = (await c.get(sim.url + "/sim/observed")).json()
                    if during["generation_tokens_total"] >= tokens + 10 * cap:
                        break
                    await asyncio.sleep(0.05)
                ab = (await c.post(sim.url + "/abort_request", json={"rid": "flood-", "abort_all": False})).json()
                return list(await asyncio.gather(*sent)), during, ab

        rs, during, ab = asyncio.run(flood())
        assert (during["running"], during["queued"]) == (cap, n - cap), during
        assert ab["aborted"] == n and all(r.status_code == 200 for r in rs)
        obs = sim.observed()
        assert obs["peak_running"] == cap
        assert obs["effective_max_running_requests"] == cap
        assert obs["peak_queued"] == n - cap
        assert obs["flags"]["max_running_requests"] == 64
    rec = sim.record()
    assert rec["requests_by_endpoint"]["/generate"] == n and rec["peak_running"] == cap


def test_queue_full_abort_and_flush() -> None:
    env = {**FAST, "SGLANG_SIM_TIME_SCALE": "1"}
    with start_sim("--max-queued-requests", "2", "--enable-metrics", env=env) as sim:
        async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response, dict]:
            async with httpx.AsyncClient(timeout=60) as c:
                params = {"max_new_tokens": 3000, "ignore_eos": True}
                long = [asyncio.create_task(c.post(sim.url + "/generate", json={
                    "text": f"q {i}", "rid": f"long-{i}", "sampling_params": params})) for i in range(14)]
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    obs = (await c.get(sim.url + "/sim/observed")).json()
                    if obs["running"] == 12 and obs["queued"] == 2:
                        break
                full = await c.post(sim.url + "/generate", json={"text": "one more"})
                flush = await c.post(sim.url + "/flush_cache")
                ab = (await c.post(sim.url + "/abort_request", json={"rid": "long-", "abort_all": False})).json()
                return list(await asyncio.gather(*long)), full, flush, ab

        done, full, flush, ab = asyncio.run(scenario())
        assert full.status_code == 503 and "The request queue is full." in full.text
        assert flush.status_code == 400
        assert ab["aborted"] == 14
        assert all(r.json()["meta_info"]["finish_reason"]["type"] == "abort" for r in done)
        assert httpx.post(sim.url + "/flush_cache").status_code == 200
        assert "sglang:num_aborted_requests_total{" in httpx.get(sim.url + "/metrics").text


def test_client_disconnect_aborts() -> None:
    env = {**FAST, "SGLANG_SIM_TIME_SCALE": "1"}
    with start_sim(env=env) as sim:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(sim.url + "/generate", json={"text": "slow", "sampling_params": {
                "max_new_tokens": 3000, "ignore_eos": True}}, timeout=0.5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sim.observed()["running"]:
            time.sleep(0.05)
        assert sim.observed()["running"] == 0
        assert sim.observed()["aborted_total"] == 1


def test_prefix_cache_hits_shared_prefixes(sim: SimProc) -> None:
    shared = "system prompt " * 100
    for i in range(3):
        r = httpx.post(sim.url + "/generate", json={"text": shared + f"question {i}",
                                                    "sampling_params": {"max_new_tokens": 2}}).json()
    assert r["meta_info"]["cached_tokens"] >= 192


def test_plain_profile_retracts_and_completes() -> None:
    # time scale 40, not more: the 20 requests must all be in flight at once, also on a loaded machine
    env = {**FAST, "SGLANG_SIM_PROFILE": "tiny-plain", "SGLANG_SIM_TIME_SCALE": "40"}
    with start_sim("--enable-metrics", env=env) as sim:
        params = {"max_new_tokens": 1500, "ignore_eos": True}
        rs = asyncio.run(_flood(sim.url, 20, params, prefix="w " * 1000))
        assert all(r.status_code == 200 for r in rs)
        assert all(r.json()["meta_info"]["completion_tokens"] == 1500 for r in rs)
        first = rs[0].json()
        assert first["text"] == expected_completion(f"{'w ' * 1000} 0 " + "w " * 20, params)[0]
        logs = sim.logs()
        assert "KV cache pool is full. Retract requests. #retracted_reqs:" in logs
        assert re.search(r"Decode batch, #running-req: \d+, #token: \d+, token usage: \d\.\d\d, cuda graph", logs)
        assert any(r.json()["meta_info"]["num_retractions"] > 0 for r in rs)
