"""The simulator's embedding mode (`--is-embedding`), over HTTP on a real subprocess: the shapes of
`/v1/embeddings` and `/encode` for each input form, base64, `dimensions`, SGLang 0.5.23's errors,
prefill-only batching, `/server_info` and `/model_info` of an embedding server, and what a request of
the other kind does to a server."""

from __future__ import annotations

import base64
import math
import re
import struct
import time

import httpx
import pytest

from sglang_sim.embedding import expected_embedding
from sglang_sim.memory import plan_memory
from sglang_sim.profiles import get_profile
from tests.simproc import SimProc, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50", "SGLANG_SIM_PROFILE": "tiny-embed"}
DIM = get_profile("tiny-embed").hidden_size  # 256


@pytest.fixture(scope="module")
def sim():
    with start_sim("--is-embedding", "--enable-metrics", env=FAST) as s:
        yield s


def embed(sim: SimProc, status: int = 200, **body: object) -> dict:
    r = httpx.post(sim.url + "/v1/embeddings", json=body, timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def test_each_input_form_of_v1_embeddings_gets_the_vectors_expected_embedding_computes(sim: SimProc) -> None:
    one = embed(sim, input="the quick  brown fox")
    assert set(one) == {"data", "model", "object", "usage"}  # no id, no created
    assert one["object"] == "list" and one["model"] == "sim/model"  # the --model-path, whatever `model` said
    assert one["data"] == [{"embedding": expected_embedding("the quick brown fox", hidden_size=DIM), "index": 0,
                            "object": "embedding"}]
    assert one["usage"] == {"prompt_tokens": 4, "total_tokens": 4, "completion_tokens": 0,
                            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}
    docs = ["alpha beta", "gamma", "delta epsilon zeta"]
    many = embed(sim, input=docs, model="anything-at-all")
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in many["data"]] == [expected_embedding(d, hidden_size=DIM) for d in docs]
    assert many["usage"]["prompt_tokens"] == many["usage"]["total_tokens"] == 6
    ids = embed(sim, input=[7, 42, 9])
    assert ids["data"][0]["embedding"] == expected_embedding([7, 42, 9], hidden_size=DIM)
    assert expected_embedding([7, 42, 9], hidden_size=DIM) == expected_embedding("7 42 9", hidden_size=DIM)
    batch = embed(sim, input=[[1, 2], [3]])
    assert [d["embedding"] for d in batch["data"]] == [expected_embedding([1, 2], hidden_size=DIM),
                                                       expected_embedding([3], hidden_size=DIM)]
    assert batch["usage"]["prompt_tokens"] == 3
    vec = one["data"][0]["embedding"]
    assert len(vec) == DIM and abs(math.fsum(x * x for x in vec) - 1) < 1e-5
    assert vec != many["data"][0]["embedding"]


def test_base64_is_the_same_vector_as_little_endian_float32(sim: SimProc) -> None:
    out = embed(sim, input=["some text", "other text"], encoding_format="base64")
    for item, text in zip(out["data"], ["some text", "other text"], strict=True):
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 4 * DIM
        assert list(struct.unpack(f"<{DIM}f", raw)) == expected_embedding(text, hidden_size=DIM)


@pytest.mark.parametrize(("body", "message"), [
    ({"input": "x", "encoding_format": "xyz"}, "encoding_format must be either 'float' or 'base64', got 'xyz'"),
    ({"input": ""}, "Input cannot be empty"),
    ({"input": []}, "Input cannot be empty"),
    ({"input": "   "}, "Input cannot be empty or whitespace only"),
    ({"input": ["a", " "]}, "Input at index 1 cannot be empty or whitespace only"),
    ({"input": [3, -1]}, "Token ID at index 1 must be non-negative"),
    ({"input": "x", "dimensions": 8}, "Model 'sim/model' does not support matryoshka representation, changing "
                                      "output dimensions will lead to poor results."),
    ({"input": "x", "lora_path": "sql"}, "LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch "
                                         "the server with --enable-lora flag and preload adapters using --lora-paths "
                                         "or /load_lora_adapter endpoint."),
    ({"input": "x", "model": "qwen3:8b"}, "LoRA adapter '8b' was requested, but LoRA is not enabled. Please launch "
                                          "the server with --enable-lora flag and preload adapters using --lora-paths "
                                          "or /load_lora_adapter endpoint."),
])
def test_a_refused_embedding_request_gets_0_5_23_s_message(sim: SimProc, body: dict, message: str) -> None:
    assert embed(sim, 400, **body) == {"object": "error", "message": message, "type": "BadRequestError",
                                       "param": None, "code": 400}


def test_a_body_outside_the_schema_is_a_400_of_type_bad_request(sim: SimProc) -> None:
    for body in ({"input": ["a", 1]}, {"input": {"text": "a"}}, {"encoding_format": "float"},
                 {"input": "a", "dimensions": "8"}):
        err = embed(sim, 400, **body)
        assert err["type"] == "Bad Request" and err["code"] == 400 and "validation error" in err["message"]
    r = httpx.post(sim.url + "/v1/embeddings", content=b'{"input": "a"}', headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["message"]


def test_dimensions_truncate_and_renormalise_when_the_model_declares_matryoshka() -> None:
    with start_sim("--is-embedding", "--json-model-override-args", '{"is_matryoshka": true}', env=FAST) as sim:
        out = embed(sim, input="a b c", dimensions=64)["data"][0]["embedding"]
        assert out == expected_embedding("a b c", hidden_size=DIM, dimensions=64)
        assert len(out) == 64 and abs(math.fsum(x * x for x in out) - 1) < 1e-5
        odd = embed(sim, input="a b c", dimensions=5)["data"][0]["embedding"]
        assert odd == expected_embedding("a b c", hidden_size=DIM, dimensions=5) and len(odd) == 5
        assert embed(sim, 400, input="a", dimensions=0)["message"] == "Requested dimensions must be greater than 0"
        assert embed(sim, 400, input="a", dimensions=DIM + 1)["message"] == \
            f"Provided dimensions are greater than max embedding dimension: {DIM}"
    listed = '{"matryoshka_dimensions": [64, 128]}'
    with start_sim("--is-embedding", "--json-model-override-args", listed, env=FAST) as sim:
        assert len(embed(sim, input="a", dimensions=128)["data"][0]["embedding"]) == 128
        assert embed(sim, 400, input="a", dimensions=100)["message"] == (
            "Model 'sim/model' only supports [64, 128] matryoshka dimensions, using other output dimensions will "
            "lead to poor results.")
        assert httpx.get(sim.url + "/model_info").json()["embedding"]["matryoshka_dimensions"] == [64, 128]


def test_encode_answers_a_dict_for_one_input_and_a_list_for_a_batch(sim: SimProc) -> None:
    one = httpx.post(sim.url + "/encode", json={"text": "hello there", "rid": "e-1"}).json()
    assert one["embedding"] == expected_embedding("hello there", hidden_size=DIM)
    meta = one["meta_info"]
    assert meta["id"] == "e-1" and meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == 2 and "completion_tokens" not in meta and "cached_tokens" not in meta
    assert {"weight_version", "num_retractions", "e2e_latency"} <= set(meta)
    many = httpx.post(sim.url + "/encode", json={"input_ids": [[5, 6], [7]]}).json()
    assert [m["embedding"] for m in many] == [expected_embedding([5, 6], hidden_size=DIM),
                                              expected_embedding([7], hidden_size=DIM)]
    both = httpx.post(sim.url + "/encode", json={"text": "a", "input_ids": [1]})
    assert both.status_code == 400
    assert both.json() == {"error": {"message": "text and input_ids cannot be provided at the same time"}}


def test_an_embedding_server_reports_itself_in_server_info_and_model_info(sim: SimProc) -> None:
    info = httpx.get(sim.url + "/server_info").json()
    assert info["is_embedding"] is True and "is_generation" not in info
    prof = get_profile("tiny-embed")
    plan = plan_memory(prof, {"is_embedding": True}, ratio=1)
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == plan.effective_max_running
    assert info["max_total_num_tokens"] == plan.max_total_num_tokens
    assert state["last_gen_throughput"] == 0
    mi = httpx.get(sim.url + "/model_info").json()
    assert mi["is_generation"] is False and mi["architectures"] == ["Qwen3ForCausalLM"]
    emb = mi["embedding"]
    assert emb["enabled"] is True and emb["family"] == "explicit_decoder_embedding" and emb["task"] == "embed"
    assert emb["supports_dimensions"] is False and emb["cache"]["radix_cache_disabled"] is False


def test_a_generation_server_refuses_embeddings_with_0_5_23_s_message() -> None:
    env = {**FAST, "SGLANG_SIM_PROFILE": "tiny-plain"}
    with start_sim(env=env) as sim:
        message = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` "
                   "when launching the server or try another model.")
        assert embed(sim, 400, input="x")["message"] == message
        r = httpx.post(sim.url + "/encode", json={"text": "x"})
        assert r.status_code == 400 and r.json() == {"error": {"message": message}}
        mi = httpx.get(sim.url + "/model_info").json()
        assert mi["is_generation"] is True and mi["embedding"]["enabled"] is False
        assert mi["embedding"]["family"] == "none"


def test_embedding_work_is_prefill_only_and_batched_up_to_the_chunked_prefill_budget() -> None:
    docs = [" ".join(f"d{i}w{j}" for j in range(20)) for i in range(300)]  # 6000 tokens, no shared prefix
    with start_sim("--is-embedding", "--enable-metrics", "--disable-overlap-schedule", env=FAST) as sim:
        out = embed(sim, input=docs)
        assert len(out["data"]) == 300 and out["usage"]["prompt_tokens"] == 6000
        logs = sim.logs()
        batches = [(int(n), int(t), int(run)) for n, t, run in re.findall(
            r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), .*?#running-req: (\d+),", logs) if int(n) > 1]
        # tiny-embed's chunked_prefill_size is 2048: 102 documents of 20 tokens a forward
        assert [n for n, _, _ in batches] == [102, 102, 96]
        assert all(t <= 2048 for _, t, _ in batches) and sum(t for _, t, _ in batches) == 6000
        assert all(run == 0 for _, _, run in batches)  # no overlap: nothing is running while one is formed
        assert "Decode batch" not in logs
        metrics = httpx.get(sim.url + "/metrics").text
        assert re.search(r"^sglang:gen_throughput\{[^}]*\} 0\.0$", metrics, re.M)
        assert re.search(r"^sglang:generation_tokens_total\{[^}]*\} 0\.0$", metrics, re.M)
        assert re.search(r"^sglang:prompt_tokens_total\{[^}]*\} 6000\.0$", metrics, re.M)  # probes not counted
        assert httpx.get(sim.url + "/server_info").json()["internal_states"][0]["last_gen_throughput"] == 0
    with start_sim("--is-embedding", env=FAST) as sim:  # the overlap schedule (default)
        embed(sim, input=docs)
        running = [(int(n), int(run)) for n, run in re.findall(
            r"Prefill batch, #new-seq: (\d+), .*?#running-req: (\d+),", sim.logs()) if int(n) > 1]
        # the previous batch is still in its forward when the next one is formed
        assert running == [(102, 0), (102, 102), (96, 102)]
    with start_sim("--is-embedding", "--prefill-max-requests", "40", env=FAST) as sim:
        embed(sim, input=docs[:100])
        sizes = [int(n) for n in re.findall(r"Prefill batch, #new-seq: (\d+),", sim.logs())]
        assert max(sizes) == 40 and sum(s for s in sizes if s > 1) >= 99


def test_identical_documents_reuse_the_radix_cache_as_0_5_23_keeps_it_on() -> None:
    doc = " ".join(f"w{j}" for j in range(30))
    with start_sim("--is-embedding", env=FAST) as sim:
        embed(sim, input=doc)
        again = httpx.post(sim.url + "/encode", json={"text": doc}).json()
        assert again["embedding"] == expected_embedding(doc, hidden_size=DIM)
        assert "#new-token: 1, #cached-token: 29," in sim.logs()  # all but the last token


def test_a_generation_request_on_an_embedding_server_returns_an_embedding_or_kills_the_server() -> None:
    with start_sim("--is-embedding", env=FAST) as sim:
        one = httpx.post(sim.url + "/generate", json={"text": "hi there", "sampling_params": {"max_new_tokens": 1}})
        assert one.status_code == 200 and set(one.json()) == {"embedding", "meta_info"}
        assert one.json()["embedding"] == expected_embedding("hi there", hidden_size=DIM)
        chat = httpx.post(sim.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert chat.status_code == 500
        assert chat.json()["message"] == "Internal server error: 'text'"
        assert chat.json()["type"] == "InternalServerError"
        with pytest.raises(httpx.HTTPError):
            httpx.post(sim.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 16}},
                       timeout=10)
        assert sim.wait_exit() == -9
        logs = sim.logs()
        assert "AttributeError: 'EmbeddingBatchResult' object has no attribute 'auxiliary_host_output'" in logs
        assert "Received sigquit from a child process. It usually means the child failed." in logs


def test_a_qwen3_next_hybrid_with_is_embedding_dies_at_its_first_forward() -> None:
    p = run_sim_cli("--model-path", "sim/model", "--is-embedding",
                    env={"SGLANG_SIM_PROFILE": "tiny-hybrid", "SGLANG_SIM_STARTUP_S": "0.05"})
    assert p.returncode == -9
    assert "AttributeError: 'LogitsProcessorOutput' object has no attribute 'embeddings'" in p.stderr
    moe = run_sim_cli("--model-path", "sim/model", "--is-embedding", "--tp-size", "4",
                      env={"SGLANG_SIM_PROFILE": "moe-235b-96gb", "SGLANG_SIM_STARTUP_S": "0.05"})
    assert moe.returncode == -9
    assert "TypeError: Qwen3MoeForCausalLM.forward() got an unexpected keyword argument 'get_embedding'" in moe.stderr


def test_a_json_model_override_that_is_not_json_fails_in_the_launching_process() -> None:
    p = run_sim_cli("--model-path", "sim/model", "--is-embedding", "--json-model-override-args", "{nope",
                    env={"SGLANG_SIM_PROFILE": "tiny-embed"})
    assert p.returncode == 1 and "json.decoder.JSONDecodeError" in p.stderr.splitlines()[-1]


def test_the_fault_variables_apply_to_embedding_requests_too() -> None:
    env = {**FAST, "SGLANG_SIM_ERROR_MARKER": "poison", "SGLANG_SIM_SICK_AFTER": "3"}
    with start_sim("--is-embedding", env=env) as sim:
        bad = embed(sim, 500, input=["fine", "a poison pill"])
        assert bad["code"] == 500 and bad["type"] == "500"
        assert embed(sim, input="fine")["data"][0]["embedding"] == expected_embedding("fine", hidden_size=DIM)
        assert httpx.post(sim.url + "/encode", json={"text": "fine"}).status_code == 200
        sick = httpx.post(sim.url + "/encode", json={"text": "fine"})
        assert sick.status_code == 500 and sick.json()["code"] == 500
        obs = sim.observed()
        assert obs["error_marker_hits"] == 1 and obs["sick"] is True and obs["sick_answers"] == 1
        assert httpx.get(sim.url + "/health_generate").status_code == 500


def test_an_embedding_is_answered_no_sooner_than_its_forwards_take_at_the_time_scale() -> None:
    """The model clock binds embeddings as it binds decode: a forward starts only when the clock has reached
    the previous one's end, and its requests are answered at its end (before, a prefill-only request was
    answered at once, and a server's inputs/s had no bound but the CPU)."""
    prof = get_profile("tiny-embed")
    scale = 0.05
    env = {**FAST, "SGLANG_SIM_TIME_SCALE": str(scale)}
    with start_sim("--is-embedding", env=env, timeout_s=60) as sim, httpx.Client(timeout=60) as client:
        for i in range(3):  # one document a request: one forward of 3 tokens each (4.03 model ms: 81 ms wall)
            t0 = time.monotonic()
            r = client.post(sim.url + "/v1/embeddings", json={"input": f"doc number {i}"})
            wall = time.monotonic() - t0
            assert r.status_code == 200
            assert wall >= prof.prefill_s(3) / scale * 0.99, wall
        docs = [" ".join(f"d{i}w{j}" for j in range(20)) for i in range(300)]  # 3 forwards (102, 102, 96)
        t0 = time.monotonic()
        r = client.post(sim.url + "/v1/embeddings", json={"input": docs})
        wall = time.monotonic() - t0
        assert r.status_code == 200 and len(r.json()["data"]) == 300
        forwards = sum(prof.prefill_s(n * 20) for n in (102, 102, 96))
        # the server's inputs/s is bounded by its forwards: 300 / wall <= 300 / (forwards / scale)
        assert wall >= forwards / scale * 0.99, (wall, forwards / scale)
