"""The simulator's LoRA adapters, over HTTP on a real subprocess: naming an adapter in a request, each
adapter's own deterministic output, SGLang 0.5.23's errors and start-up checks, at most
`--max-loras-per-batch` adapters a batch (the base model counting), the time a load into the GPU pool
costs, the pool's memory taken from the KV cache, `/server_info`, `/v1/models`, loading and unloading
adapters, the prefix cache kept apart per adapter, and the observation record."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import httpx
import pytest

from sglang_sim.embedding import expected_embedding
from sglang_sim.lora import adapter_load_s, lora_pool_gb, normalize_modules
from sglang_sim.memory import plan_memory
from sglang_sim.parallel import Layout
from sglang_sim.profiles import get_profile
from sglang_sim.textgen import expected_completion, render_chat
from tests.simproc import SimProc, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50", "SGLANG_SIM_PROFILE": "tiny-plain",
        "SGLANG_SIM_RECORD_REQUESTS": "1"}
QV = ["q_proj", "v_proj"]
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(root: Path, name: str, rank: int = 8, modules: list[str] | None = None) -> str:
    """A PEFT adapter directory; returns its path."""
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank,
                                                       "target_modules": modules or QV}))
    return str(d)


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    return {"sql": adapter(tmp_path, "sql"), "chat": adapter(tmp_path, "chat", 16, ALL7),
            "poem": adapter(tmp_path, "poem")}


def gen(sim: SimProc, text: str, max_new: int = 12, status: int = 200, **body: object) -> dict:
    r = httpx.post(sim.url + "/generate", timeout=60, json={
        "text": text, "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}, **body})
    assert r.status_code == status, r.text
    return r.json()


def test_each_adapter_answers_with_its_own_deterministic_output_named_as_0_5_23_accepts_it(
        adapters: dict[str, str]) -> None:
    paths = [f"sql={adapters['sql']}", f"chat={adapters['chat']}"]
    with start_sim("--lora-paths", *paths, "--served-model-name", "base", env=FAST) as sim:
        params = {"max_new_tokens": 12, "ignore_eos": True}
        base, sql = gen(sim, "tell me a story"), gen(sim, "tell me a story", lora_path="sql")
        assert base["text"] == expected_completion("tell me a story", params)[0]
        assert sql["text"] == expected_completion("tell me a story", params, adapter="sql")[0]
        assert sql["text"] != base["text"]

        def completion(**body: object) -> str:
            r = httpx.post(sim.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 12, "ignore_eos": True,
                                                              **body})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        want = {a: expected_completion("hello", params, adapter=a)[0] for a in ("sql", "chat", None)}
        assert completion(model="base:chat") == want["chat"]
        assert completion(model="base:chat", lora_path="sql") == want["chat"]  # the model suffix wins
        assert completion(model="whatever:sql") == want["sql"]  # the base part is not checked
        assert completion(lora_path="sql") == want["sql"]
        assert completion(model="chat") == want[None]  # a bare adapter name runs the base model
        assert completion(model="base:") == want[None]
        chat = httpx.post(sim.url + "/v1/chat/completions", json={
            "model": "base:sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}).json()
        assert chat["choices"][0]["message"]["content"] == expected_completion(
            render_chat([{"role": "user", "content": "hi"}]), {"max_new_tokens": 5}, adapter="sql")[0]
        two = httpx.post(sim.url + "/generate", json={"text": ["a b", "a b"], "lora_path": ["sql", None],
                                                      "sampling_params": params}).json()
        assert [t["text"] for t in two] == [expected_completion("a b", params, adapter="sql")[0],
                                            expected_completion("a b", params)[0]]
        # the record names each request's adapter (a fifth entry on a LoRA server)
        assert [row[4] for row in sim.observed()["requests"]] == [
            None, "sql", "chat", "chat", "sql", "sql", None, None, "sql", "sql", None]


def test_an_unknown_adapter_or_lora_turned_off_is_a_400_with_0_5_23_s_message(adapters: dict[str, str]) -> None:
    with start_sim("--lora-paths", f"sql={adapters['sql']}", f"chat={adapters['chat']}", env=FAST) as sim:
        never = "Got LoRA adapter that has never been loaded: nope\nAll loaded adapters: dict_keys(['sql', 'chat'])."
        assert gen(sim, "x", status=400, lora_path="nope") == {"error": {"message": never}}
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "model": "sim/model:nope"})
        assert r.status_code == 400
        assert r.json() == {"object": "error", "message": never, "type": "BadRequestError", "param": None, "code": 400}
        mismatch = httpx.post(sim.url + "/generate", json={"text": ["a", "b"], "lora_path": ["sql"]})
        assert mismatch.status_code == 400
        assert mismatch.json()["error"]["message"] == "lora_path list length (1) must match batch size (2)"
    with start_sim(env=FAST) as sim:
        off = gen(sim, "x", status=400, lora_path="sql")["error"]["message"]
        assert off == ("LoRA adapter 'sql' was requested, but LoRA is not enabled. Please launch the server with "
                       "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        load = httpx.post(sim.url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["sql"]})
        assert load.status_code == 400 and load.json()["error_message"] == \
            "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def test_a_batch_holds_at_most_max_loras_per_batch_adapters_and_a_waiting_adapter_is_passed(
        adapters: dict[str, str]) -> None:
    env = {**FAST, "SGLANG_SIM_TIME_SCALE": "10"}
    paths = [f"a={adapters['sql']}", f"b={adapters['poem']}"]
    with start_sim("--lora-paths", *paths, "--max-loras-per-batch", "2", env=env) as sim:

        async def scenario() -> dict[str, dict]:
            async with httpx.AsyncClient(base_url=sim.url, timeout=60) as client:
                async def post(text: str, max_new: int, lora: str | None) -> dict:
                    r = await client.post("/generate", json={"text": text, "lora_path": lora, "sampling_params": {
                        "max_new_tokens": max_new, "ignore_eos": True}})
                    assert r.status_code == 200, r.text
                    return r.json()

                async def until(key: str, value: int) -> None:
                    while (await client.get("/sim/observed")).json()[key] != value:
                        await asyncio.sleep(0.01)

                # the base model's runs longest: b (a third adapter) waits for long a's end, never for the
                # base's. With equal lengths, a machine slow to send long a's request lets the base end
                # first; b then fits beside long a, evicts a (its prefill forward does not need it, as
                # SGLang's pool chooses) and the next decode loads a again.
                long_base = asyncio.create_task(post("long base", 4000, None))
                long_a = asyncio.create_task(post("long a", 2500, "a"))
                await until("running", 2)  # the batch runs the base model and adapter a: both slots
                short_b = asyncio.create_task(post("short b", 4, "b"))
                await until("queued", 1)  # b would be a third adapter: it waits
                short_a = asyncio.create_task(post("short a", 4, "a"))
                done_a = await short_a  # a runs already: it passes b
                assert not short_b.done()
                return {"a": done_a, "b": await short_b, "long": await long_a, "base": await long_base}

        out = asyncio.run(scenario())
        assert out["b"]["meta_info"]["queue_time"] > out["a"]["meta_info"]["e2e_latency"]
        lora = sim.observed()["lora"]
        assert lora["peak_adapters_in_batch"] == 2 and lora["max_loras_per_batch"] == 2
        assert lora["loads"] == {"a": 1, "b": 1}
        # b's load into the pool evicted a, once a's requests had finished
        assert [s[2:] for s in lora["switches"]] == [["a", None], ["b", "a"]]


def test_loading_an_adapter_into_the_gpu_pool_costs_the_time_adapter_load_s_says(adapters: dict[str, str]) -> None:
    prof = get_profile("tiny-plain")
    paths = [f"sql={adapters['sql']}", f"chat={adapters['chat']}"]
    with start_sim("--lora-paths", *paths, "--max-loras-per-batch", "2", env=FAST) as sim:
        def latency(prompt: str, lora: str) -> float:
            return gen(sim, prompt, 8, lora_path=lora)["meta_info"]["e2e_latency"]

        cold, warm = latency("one two three", "sql"), latency("four five six", "sql")
        load_sql = adapter_load_s(prof, Layout(), rank=8, modules=normalize_modules(QV))
        assert abs((cold - warm) - load_sql) < 2e-6
        switch, warm_chat = latency("seven eight nine", "chat"), latency("ten eleven twelve", "chat")
        load_chat = adapter_load_s(prof, Layout(), rank=16, modules=normalize_modules(ALL7))
        assert abs((switch - warm_chat) - load_chat) < 2e-6 and load_chat > load_sql
        assert abs(warm - warm_chat) < 2e-6  # once loaded, an adapter costs nothing more per step
        lora = sim.observed()["lora"]
        assert lora["loads"] == {"sql": 1, "chat": 1} and lora["loads_total"] == 2
        assert [s[2:] for s in lora["switches"]] == [["sql", None], ["chat", "sql"]]


def test_the_adapter_buffers_come_out_of_the_kv_cache(adapters: dict[str, str]) -> None:
    prof = get_profile("tiny-plain")
    flags = ["--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all"]
    with start_sim(*flags, env=FAST) as sim:
        info = httpx.get(sim.url + "/server_info").json()
    pool_gb = lora_pool_gb(prof, Layout(), slots=8, rank=64, modules=frozenset({"all"}))
    plain = plan_memory(prof, {}, ratio=1)
    with_lora = plan_memory(prof, {}, ratio=1, lora_gb=pool_gb)
    assert info["max_total_num_tokens"] == with_lora.max_total_num_tokens < plain.max_total_num_tokens
    state = info["internal_states"][0]
    assert state["effective_max_running_requests_per_dp"] == with_lora.effective_max_running
    assert with_lora.effective_max_running < plain.effective_max_running  # the token estimate drops with it
    assert pool_gb > 0.5  # 8 slots x rank 64 x every linear module of 32 layers
    assert info["enable_lora"] is True and info["max_lora_rank"] == 64
    assert info["lora_target_modules"] == ["all"] and info["lora_paths"] == []


def test_server_info_and_v1_models_show_the_startup_adapters(adapters: dict[str, str]) -> None:
    pinned = json.dumps({"lora_name": "poem", "lora_path": adapters["poem"], "pinned": True})
    with start_sim("--lora-paths", f"sql={adapters['sql']}", adapters["chat"], pinned, "--enable-metrics",
                   "--max-loras-per-batch", "4", env=FAST) as sim:
        info = httpx.get(sim.url + "/server_info").json()
        chat = adapters["chat"]
        assert info["lora_paths"] == [
            {"lora_id": uuid.uuid5(uuid.NAMESPACE_URL, f"sql\0{adapters['sql']}").hex, "lora_name": "sql",
             "lora_path": adapters["sql"], "pinned": False},
            {"lora_id": uuid.uuid5(uuid.NAMESPACE_URL, f"{chat}\0{chat}").hex, "lora_name": chat, "lora_path": chat,
             "pinned": False},
            {"lora_id": uuid.uuid5(uuid.NAMESPACE_URL, f"poem\0{adapters['poem']}").hex, "lora_name": "poem",
             "lora_path": adapters["poem"], "pinned": True}]
        assert info["enable_lora"] is True and info["max_loras_per_batch"] == 4
        assert info["max_lora_rank"] is None and info["lora_target_modules"] is None  # inferred, not declared back
        assert info["lora_eviction_policy"] == "lru" and info["lora_backend"] == "csgmv"
        models = httpx.get(sim.url + "/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["parent"]) for m in models] == [
            ("sim/model", "sim/model", None), ("sql", adapters["sql"], "sim/model"), (chat, chat, "sim/model"),
            ("poem", adapters["poem"], "sim/model")]
        assert all(m["max_model_len"] is None for m in models[1:])
        metrics = httpx.get(sim.url + "/metrics").text
        assert re.search(r"^sglang:lora_pool_slots_total\{[^}]*\} 4\.0$", metrics, re.M)
        assert re.search(r"^sglang:lora_pool_slots_used\{[^}]*\} 0\.0$", metrics, re.M)
        assert "--enable-lora is set to True because --lora-paths is provided." in sim.logs()


def test_adapters_load_and_unload_at_run_time_with_0_5_23_s_shapes(tmp_path: Path, adapters: dict[str, str]) -> None:
    big = adapter(tmp_path, "big", rank=32)
    with start_sim("--lora-paths", f"sql={adapters['sql']}", "--max-loaded-loras", "2", "--max-loras-per-batch", "2",
                   env=FAST) as sim:
        def post(path: str, **body: object) -> httpx.Response:
            return httpx.post(sim.url + path, json=body)

        ok = post("/load_lora_adapter", lora_name="poem", lora_path=adapters["poem"])
        assert ok.status_code == 200
        assert ok.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                             "loaded_adapters": {"sql": adapters["sql"], "poem": adapters["poem"]}}
        again = post("/load_lora_adapter", lora_name="poem", lora_path=adapters["poem"])
        assert again.status_code == 400
        assert again.json()["error_message"] == "Failed to load LoRA adapter poem because it is already loaded"
        wide = post("/load_lora_adapter", lora_name="big", lora_path=big).json()["error_message"]
        assert wide.startswith("LoRA adapter big with rank 32 is incompatible with the current LoRA memory pool "
                               "configuration.")
        gone = post("/unload_lora_adapter", lora_name="nope")
        assert gone.status_code == 400 and gone.json()["error_message"] == \
            "LoRA with name nope does not exist. Loaded LoRAs: odict_keys(['sql', 'poem'])"
        # a third adapter past --max-loaded-loras 2 unloads the least recently used one (sql)
        third = post("/load_lora_adapter", lora_name="more", lora_path=adapters["sql"])
        assert third.json()["loaded_adapters"] == {"poem": adapters["poem"], "more": adapters["sql"]}
        assert "Unloading least recently used LoRA adapter 'sql'" in sim.logs()
        # a name loaded once and since unloaded is reloaded implicitly by a request naming it
        text = gen(sim, "hi there", lora_path="sql")["text"]
        assert text == expected_completion("hi there", {"max_new_tokens": 12, "ignore_eos": True}, adapter="sql")[0]
        assert "Reloading evicted adapter: sql" in sim.logs() and sim.observed()["lora"]["reloads"] == 1
        assert "Unloading least recently used LoRA adapter 'poem'" in sim.logs()  # the reload made room too
        assert post("/unload_lora_adapter", lora_name="more").json()["success"] is True
        assert [m["id"] for m in httpx.get(sim.url + "/v1/models").json()["data"]] == ["sim/model", "sql"]


def test_the_prefix_cache_is_kept_apart_per_adapter(adapters: dict[str, str]) -> None:
    prompt = " ".join(f"w{i}" for i in range(200))
    with start_sim("--lora-paths", f"sql={adapters['sql']}", env=FAST) as sim:
        gen(sim, prompt, 2)
        assert gen(sim, prompt, 2)["meta_info"]["cached_tokens"] == 199
        assert gen(sim, prompt, 2, lora_path="sql")["meta_info"]["cached_tokens"] == 0
        assert gen(sim, prompt, 2, lora_path="sql")["meta_info"]["cached_tokens"] == 199


def test_an_embedding_server_s_vectors_depend_on_the_adapter(adapters: dict[str, str]) -> None:
    env = {**FAST, "SGLANG_SIM_PROFILE": "tiny-embed"}
    with start_sim("--is-embedding", "--lora-paths", f"sql={adapters['sql']}", env=env) as sim:
        dim = get_profile("tiny-embed").hidden_size
        out = httpx.post(sim.url + "/v1/embeddings", json={"input": ["a b", "c"], "model": "sim/model:sql"}).json()
        assert [d["embedding"] for d in out["data"]] == [expected_embedding(t, hidden_size=dim, adapter="sql")
                                                         for t in ("a b", "c")]
        base = httpx.post(sim.url + "/v1/embeddings", json={"input": "a b"}).json()["data"][0]["embedding"]
        assert base == expected_embedding("a b", hidden_size=dim) != out["data"][0]["embedding"]
        enc = httpx.post(sim.url + "/encode", json={"text": "c", "lora_path": "sql"}).json()
        assert enc["embedding"] == expected_embedding("c", hidden_size=dim, adapter="sql")


@pytest.mark.parametrize(("flags", "last_line"), [
    (("--enable-lora",), "AssertionError: When no initial --lora-paths is provided, you need to specify both "
                         "--max-lora-rank and --lora-target-modules for LoRA initialization."),
    (("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"),
     "AssertionError: If 'all' is specified in --lora-target-modules, it should be the only module specified."),
    (("--lora-paths", "a=/x", "--max-loaded-loras", "4"),
     "AssertionError: max_loaded_loras should be greater than or equal to max_loras_per_batch. "
     "max_loaded_loras=4, max_loras_per_batch=8"),
    (("--lora-paths", "a=/x", "--max-loras-per-batch", "0"), "AssertionError: max_loras_per_batch must be positive"),
    (("--lora-paths", '{"lora_name": "a"}'),
     "AssertionError: '{\"lora_name\": \"a\"}' looks like a JSON str, but it does not contain 'lora_name' and "
     "'lora_path' keys."),
])
def test_lora_flags_0_5_23_refuses_end_in_a_traceback_and_exit_1(flags: tuple[str, ...], last_line: str) -> None:
    p = run_sim_cli("--model-path", "sim/model", *flags, env={"SGLANG_SIM_PROFILE": "tiny-plain"})
    assert p.returncode == 1 and p.stderr.rstrip().splitlines()[-1] == last_line


def test_a_startup_adapter_that_cannot_be_read_kills_the_scheduler(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"SGLANG_SIM_PROFILE": "tiny-plain", "SGLANG_SIM_STARTUP_S": "0.05"}
    p = run_sim_cli("--model-path", "sim/model", "--lora-paths", f"e={empty}", env=env)
    assert p.returncode == -9
    assert (f"RuntimeError: Failed to load LoRA adapter e: [Errno 2] No such file or directory: "
            f"'{empty}/adapter_config.json'") in p.stderr
    bad = run_sim_cli("--model-path", "sim/model", "--lora-paths", "x=/no/such/dir", env=env)
    assert bad.returncode == -9 and ("Failed to load LoRA adapter x: Repo id must be in the form 'repo_name' or "
                                     "'namespace/repo_name': '/no/such/dir'.") in bad.stderr
    narrow = tmp_path / "wide"
    narrow.mkdir()
    (narrow / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ALL7}))
    outside = run_sim_cli("--model-path", "sim/model", "--lora-paths", f"w={narrow}", "--lora-target-modules",
                          "q_proj", "v_proj", env=env)
    assert outside.returncode == -9
    assert "ValueError: LoRA adapter 'w' contains target modules ['down_proj', 'gate_up_proj', 'o_proj']" in \
        outside.stderr
