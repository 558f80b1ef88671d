"""A simulated server on a group of GPUs: --tp-size, --pp-size, --dp-size, attention DP, as SGLang 0.5.23
sizes and lays them out; too few visible GPUs; the nvidia-smi shim; the profiles that need TP."""

from __future__ import annotations

import re
import signal

import httpx
import pytest

from tests.simproc import SimProc, gpu_memory_used, run_sim_cli, start_sim

FAST = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "50"}
SEED = {**FAST, "SGLANG_SIM_PROFILE": "seed-27b-96gb"}


def _info(sim: SimProc) -> dict:
    return httpx.get(sim.url + "/server_info", timeout=10).json()


def _logged(logs: str, tag: str, text: str) -> int:
    """How many log lines carry exactly this rank tag (`""` for none, else e.g. `" DP1 TP0"`) and text."""
    return len(re.findall(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d" + re.escape(tag) + r"\] " + re.escape(text), logs,
                          re.MULTILINE))


def test_a_tp2_server_holds_half_the_weights_on_each_of_its_two_gpus_and_shows_both_in_use() -> None:
    with start_sim(env=SEED) as one:
        single = _info(one)
    sim = start_sim("--tp-size", "2", env={**SEED, "CUDA_VISIBLE_DEVICES": "2,3"})
    try:
        info, logs = _info(sim), sim.logs()
        (state,) = info["internal_states"]
        assert info["tp_size"] == 2 and state["world_size"] == 2
        assert state["memory_usage"]["weight"] == pytest.approx(single["internal_states"][0]["memory_usage"]["weight"]
                                                                / 2, abs=0.01)
        # SGLang reserves TP*PP/8 GB more at start-up: its auto fraction drops 1/8 GB of 96
        assert info["mem_fraction_static"] == 0.879 and single["mem_fraction_static"] == 0.88
        assert info["max_total_num_tokens"] > single["max_total_num_tokens"]
        assert state["effective_max_running_requests_per_dp"] > single["internal_states"][0][
            "effective_max_running_requests_per_dp"]
        for tag in (" TP0", " TP1"):
            assert _logged(logs, tag, "Load weight end.") == 1
            assert _logged(logs, tag, "KV Cache is allocated.") == 1
        # the sizing summary comes from TP rank 0 only, with the per-DP-rank capacity
        assert _logged(logs, " TP0", f"max_total_num_tokens={info['max_total_num_tokens']}, ") == 1
        assert logs.count("max_total_num_tokens=") == 1
        assert f"max_running_requests={state['effective_max_running_requests_per_dp']}, context_len" in logs
        used = gpu_memory_used(sim.env)
        assert used[2] == used[3] > 1000
        assert {i: u for i, u in used.items() if i not in (2, 3)} == dict.fromkeys((0, 1, 4, 5, 6, 7), 0)
        sim.kill(signal.SIGKILL)
        sim.wait_exit()
        assert set(gpu_memory_used(sim.env).values()) == {0}  # a dead server's GPUs are free again
    finally:
        sim.stop()


def test_dp_replicas_are_whole_tp_groups_each_with_its_own_state_and_log_prefix() -> None:
    with start_sim("--tp-size", "2", env={**FAST, "CUDA_VISIBLE_DEVICES": "0,1"}) as tp2:
        alone = _info(tp2)["internal_states"][0]["effective_max_running_requests_per_dp"]
    with start_sim("--tp-size", "2", "--dp-size", "2", env={**FAST, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) as sim:
        info, logs, used = _info(sim), sim.logs(), gpu_memory_used(sim.env)
    assert [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]] == [alone, alone]
    assert {s["world_size"] for s in info["internal_states"]} == {4}
    assert [i for i, u in sorted(used.items()) if u] == [4, 5, 6, 7]
    for tag in (" DP0 TP0", " DP0 TP1", " DP1 TP0", " DP1 TP1"):
        assert _logged(logs, tag, "Load weight end.") == 1
    assert _logged(logs, " DP0 TP0", "max_total_num_tokens=") == _logged(logs, " DP1 TP0", "max_total_num_tokens=") == 1
    assert logs.count("max_total_num_tokens=") == 2


def test_attention_dp_splits_one_tp_group_and_its_requested_cap_into_ranks_on_the_same_gpus() -> None:
    flags = ("--tp-size", "2", "--dp-size", "2", "--disable-radix-cache", "--max-running-requests", "40")
    with start_sim(*flags, env={**FAST, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) as replicas:
        rep_info, rep_used = _info(replicas), gpu_memory_used(replicas.env)
    with start_sim(*flags, "--enable-dp-attention", env={**FAST, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) as sim:
        info, logs, used = _info(sim), sim.logs(), gpu_memory_used(sim.env)
        reply = httpx.post(sim.url + "/generate", json={"text": ["a b", "c d"], "sampling_params": {
            "max_new_tokens": 4}}, timeout=10)
    # two replicas of TP2: 4 GPUs, each replica may run the 40 asked for
    assert [i for i, u in sorted(rep_used.items()) if u] == [0, 1, 2, 3]
    assert [s["effective_max_running_requests_per_dp"] for s in rep_info["internal_states"]] == [40, 40]
    # one TP2 group whose attention runs as 2 DP ranks: 2 GPUs, the 40 shared between the ranks
    assert [i for i, u in sorted(used.items()) if u] == [0, 1]
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
    assert [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]] == [20, 20]
    assert info["chunked_prefill_size"] == rep_info["chunked_prefill_size"] // 2
    assert _logged(logs, " DP0 TP0", "Load weight end.") == _logged(logs, " DP1 TP1", "Load weight end.") == 1
    assert logs.count("max_total_num_tokens=") == 1  # global TP rank 0 only
    assert reply.status_code == 200 and len(reply.json()) == 2


@pytest.mark.parametrize(("flags", "visible", "rank"), [
    (("--tp-size", "4"), "0,1", " TP2"),
    (("--tp-size", "2", "--dp-size", "2"), "5,6,7", " DP1 TP1"),
    (("--tp-size", "2", "--pp-size", "2"), "1,2,3", " PP1 TP1"),
])
def test_a_server_with_more_ranks_than_visible_gpus_dies_as_sglang_does(flags: tuple[str, ...], visible: str,
                                                                        rank: str) -> None:
    p = run_sim_cli("--model-path", "sim/m", *flags, env={**FAST, "CUDA_VISIBLE_DEVICES": visible})
    assert p.returncode == -signal.SIGKILL  # the launcher's SIGQUIT handler kills its own process tree
    assert _logged(p.stderr, rank, "Scheduler hit an exception: Traceback (most recent call last):") == 1
    assert ("torch.AcceleratorError: CUDA error: invalid device ordinal\n"
            "GPU device may be out of range, do you have enough GPUs?\n") in p.stderr
    assert _logged(p.stderr, "", "Received sigquit from a child process. It usually means the child failed.") == 1
    assert "fired up" not in p.stderr


def test_cuda_stops_at_the_first_listed_gpu_the_host_does_not_have() -> None:
    p = run_sim_cli("--model-path", "sim/m", "--tp-size", "2",
                    env={**FAST, "CUDA_VISIBLE_DEVICES": "1,9,2", "SGLANG_SIM_NUM_GPUS": "8"})
    assert p.returncode == -signal.SIGKILL and "invalid device ordinal" in p.stderr


def test_the_70b_profile_does_not_fit_one_gpu_and_serves_on_four() -> None:
    env = {**FAST, "SGLANG_SIM_PROFILE": "dense-70b-96gb"}
    p = run_sim_cli("--model-path", "meta-llama/Llama-3.3-70B-Instruct", env=env)
    assert p.returncode == -signal.SIGKILL
    assert re.search(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate [\d.]+ GiB\. GPU 0 has a "
                     r"total capacity of 96\.00 GiB", p.stderr)
    with start_sim("--tp-size", "4", env={**env, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) as sim:
        info = _info(sim)
        used = gpu_memory_used(sim.env)
        ok = httpx.post(sim.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 8}, timeout=20)
    (state,) = info["internal_states"]
    assert state["memory_usage"]["weight"] == pytest.approx(131.4 / 4, abs=0.01)
    assert state["effective_max_running_requests_per_dp"] >= 2048  # KV-bound: SGLang's token estimate
    assert [i for i, u in sorted(used.items()) if u] == [4, 5, 6, 7]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0


def test_the_moe_profile_needs_four_gpus_and_attention_dp_gives_it_more_kv() -> None:
    env = {**FAST, "SGLANG_SIM_PROFILE": "moe-235b-96gb"}
    p = run_sim_cli("--model-path", "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8", "--tp-size", "2", env=env)
    assert p.returncode == -signal.SIGKILL and "torch.OutOfMemoryError: CUDA out of memory." in p.stderr
    with start_sim("--tp-size", "8", env=env) as tp8:
        plain = _info(tp8)
    with start_sim("--tp-size", "8", "--attn-dp-size", "8", env=env) as sim:
        adp = _info(sim)
    assert len(plain["internal_states"]) == 1 and len(adp["internal_states"]) == 8
    # 4 KV heads over 8 TP ranks: each KV head is held twice; attention DP keeps each rank's KV once
    kv = [sum(s["memory_usage"]["token_capacity"] for s in i["internal_states"]) for i in (plain, adp)]
    assert kv[1] > kv[0]


def _steady_throughput(logs: str) -> float:
    rates = re.findall(r"Decode batch, #running-req: 1, .*gen throughput \(token/s\): (\d+\.\d\d)", logs)
    assert len(rates) >= 3, logs[-2000:]
    return float(rates[-1])  # the first window holds the prefill too; later ones are pure decode


def test_a_tp_group_decodes_faster_than_one_gpu_but_not_in_proportion() -> None:
    """In model time, from the server's own decode log lines (one request: one step per token)."""
    rates = {}
    for tp, visible in ((1, "0"), (2, "0,1"), (4, "0,1,2,3")):
        with start_sim("--tp-size", str(tp), "--decode-log-interval", "20",
                       env={**SEED, "CUDA_VISIBLE_DEVICES": visible}) as sim:
            r = httpx.post(sim.url + "/generate", json={"text": "count", "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True}}, timeout=60)
            assert r.status_code == 200
            rates[tp] = _steady_throughput(sim.logs())
    assert 1.6 < rates[2] / rates[1] < 1.9
    assert 2.5 < rates[4] / rates[1] < 3.0


def test_faults_follow_a_group_that_holds_a_listed_gpu() -> None:
    env = {**FAST, "SGLANG_SIM_ERROR_RATE": "1.0", "SGLANG_SIM_FAULT_GPUS": "3"}
    with start_sim("--tp-size", "2", env={**env, "CUDA_VISIBLE_DEVICES": "2,3"}) as sim:
        assert httpx.post(sim.url + "/generate", json={"text": "x"}, timeout=10).status_code == 500
    with start_sim("--tp-size", "2", env={**env, "CUDA_VISIBLE_DEVICES": "0,1"}) as sim:
        assert httpx.post(sim.url + "/generate", json={"text": "x"}, timeout=10).status_code == 200
