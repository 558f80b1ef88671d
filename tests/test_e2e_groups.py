"""One server on a group of GPUs (issue 22 §1), on real parts: `batchfleet run --gpus 0-3 --tp 2` as 2
TP2 servers with an exact export; what each simulated server saw (its --tp-size, the GPUs
CUDA_VISIBLE_DEVICES gave it); a worker whose group overlaps a live worker's exits 3; capacity summed
over data-parallel ranks with and without attention DP; a restart waits for every GPU of the group."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from batchfleet.keys import Keys
from batchfleet.records import ServerSpec, WorkerState, WorkerStatus
from batchfleet.rqlayout import WORKERS
from sglang_sim.gpus import release, write_usage
from worker.gpu import wait_gpu_free

from .fleet import ROOT, Fleet, free_port_block, write_prompts
from .simproc import gpu_memory_used
from .test_fleetrun import ENDPOINTS, check_export, output, procs, run_env, start  # noqa: F401  (procs: a fixture)


def _serving(fleet: Fleet, queue: str) -> WorkerStatus | None:
    return next((s for s in fleet.statuses() if s.queue == queue and s.state is WorkerState.SERVING), None)


@pytest.mark.slow
def test_batchfleet_run_serves_four_simulated_gpus_as_two_tp2_servers(tmp_path: Path,
                                                                     procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    rows = write_prompts(tmp_path / "prompts.jsonl", 240, max_tokens=48)
    env = run_env(tmp_path, SGLANG_SIM_TIME_SCALE="4", SGLANG_SIM_NUM_GPUS="4",
                  BATCHFLEET_PORT_BASE=str(free_port_block(4)))
    p = start(tmp_path, env, procs, "--gpus", "0-3", "--tp", "2", "--dry-run")
    assert p.wait(240) == 0, output(tmp_path, 0)
    out = output(tmp_path, 0)
    assert "started 2 worker(s) (prompts.gpu0-1 ...)" in out, out
    assert "wrote 240 lines to results.jsonl (240 succeeded, 0 failed)" in out, out
    check_export(tmp_path, rows)  # results == prompts, 0 duplicated, 0 lost, each the simulator's answer
    # What each simulated server saw: `{gpu}` in SGLANG_SIM_RECORD is its first GPU, so 0 and 2.
    records = {g: orjson.loads((tmp_path / f"sim-gpu{g}.json").read_bytes()) for g in (0, 2)}
    assert not (tmp_path / "sim-gpu1.json").exists() and not (tmp_path / "sim-gpu3.json").exists()
    for first, rec in records.items():
        assert rec["gpu_indices"] == [first, first + 1]  # CUDA_VISIBLE_DEVICES = its group
        assert rec["flags"]["tp_size"] == 2 and rec["argv"].count("--tp-size") == 1
        assert rec["argv"][rec["argv"].index("--tp-size") + 1] == "2"
    served = [sum(rec["requests_by_endpoint"].get(ep, 0) for ep in ENDPOINTS) for rec in records.values()]
    assert sum(served) == 240 and min(served) > 0, served  # every prompt once, both servers took work
    logs = {f.name for f in (tmp_path / ".batchfleet" / "logs" / "prompts").iterdir()}
    assert {"worker-gpu0-1.log", "worker-gpu2-3.log", "sglang-gpu0-1.log", "sglang-gpu2-3.log"} <= logs, logs


@pytest.mark.slow
def test_a_worker_whose_group_overlaps_a_live_workers_exits_3_and_leaves_no_trace(
        fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    fleet = fleets(gpus=4, env={"SGLANG_SIM_NUM_GPUS": "4"})
    fleet.start_worker("gpu0-1")
    fleet.wait_for(lambda: _serving(fleet, fleet.queue("gpu0-1")) is not None, 60, "the gpu0-1 worker serving")
    # the nvidia-smi stand-in shows both GPUs of the group in use, the others free
    used = gpu_memory_used(fleet.env)
    assert used[0] > 1000 and used[1] > 1000 and used[2] == used[3] == 0, used
    registered = r.smembers(WORKERS)
    for other in (1, "gpu1-2", "gpu0-3"):
        proc = fleet.start_worker(other)
        assert proc.wait(60) == 3, fleet.worker_log(other)
        log = fleet.worker_log(other)
        assert "another batchfleet worker (pid" in log and "refusing to start a second worker" in log, log
        assert "Traceback" not in log
        del fleet.workers[other]  # its exit 3 was the point; the fleet's own waits check the others
    assert r.smembers(WORKERS) == registered  # refused before registering with RQ
    # a group beside it, on GPUs it does not hold, starts
    fleet.start_worker("gpu2-3")
    fleet.wait_for(lambda: _serving(fleet, fleet.queue("gpu2-3")) is not None, 60, "the gpu2-3 worker serving")
    codes = fleet.stop_all()
    assert codes["gpu0-1"] == 0 and codes["gpu2-3"] == 0, codes


@pytest.mark.slow
def test_capacity_is_summed_over_dp_ranks_with_and_without_attention_dp(fleets: Callable[..., Fleet]) -> None:
    """Two groups of 4 GPUs: `--dp-size 2` (2 replicas, so the worker passes --tp-size 2) and `--dp-size 2
    --enable-dp-attention` (attention DP inside one TP4 group: --tp-size 4). Each server's capacity is
    the sum of its 2 DP ranks' effective limits, as its /server_info gives them."""
    fleet = fleets(gpus=8, env={"SGLANG_SIM_NUM_GPUS": "8"})
    fleet.start_worker("gpu0-3", env={"BATCHFLEET_SERVER_ARGS": "--dp-size 2"})
    fleet.start_worker("gpu4-7", env={"BATCHFLEET_SERVER_ARGS": "--dp-size 2 --enable-dp-attention"})
    for q in ("gpu0-3", "gpu4-7"):
        fleet.wait_for(lambda q=q: _serving(fleet, fleet.queue(q)) is not None, 90, f"the {q} worker serving")
    for q, tp, dp_attention in (("gpu0-3", 2, False), ("gpu4-7", 4, True)):
        status = _serving(fleet, fleet.queue(q))
        assert status is not None
        info = httpx.get(status.server_url + "/server_info", timeout=10).json()
        ranks = [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]]
        assert len(ranks) == 2 and all(n > 0 for n in ranks)
        assert status.effective_max == sum(ranks), (q, status.effective_max, ranks)
        rec = fleet.sim_record(q)
        assert rec["flags"]["tp_size"] == tp and rec["flags"]["dp_size"] == 2
        assert bool(rec["flags"].get("enable_dp_attention")) is dp_attention
        assert rec["gpu_indices"] == list(range(int(q[3]), int(q[3]) + 4))
        assert ["--tp-size", str(tp)] == status.server_flags[status.server_flags.index("--tp-size"):][:2]
    codes = fleet.stop_all()
    assert set(codes.values()) == {0}, codes


def test_a_restart_waits_until_every_gpu_of_the_group_is_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker asks nvidia-smi (here the simulator's stand-in) about each GPU of its group."""
    monkeypatch.setenv("PATH", f"{ROOT / 'sglang_sim' / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SGLANG_SIM_GPU_DIR", str(tmp_path / "gpus"))
    monkeypatch.setenv("SGLANG_SIM_NUM_GPUS", "4")
    for g in (2, 3):  # a server (this process: alive) still holds GPUs 2 and 3
        write_usage(g, used_mib=40000, total_mib=97887)
    t0 = time.monotonic()
    said = asyncio.run(wait_gpu_free((2, 3), timeout_s=1.0))
    assert said == "GPUs 2,3 still in use after 1 s (GPU 2 40000 MiB, GPU 3 40000 MiB)" and time.monotonic() - t0 >= 1
    release(2)
    assert asyncio.run(wait_gpu_free((2, 3), timeout_s=0.5)).endswith("(GPU 3 40000 MiB)")  # one is not enough
    release(3)
    assert asyncio.run(wait_gpu_free((2, 3), timeout_s=5)) == "GPUs 2,3 memory free again (0 of 195774 MiB used)"
    assert asyncio.run(wait_gpu_free(2, timeout_s=5)) == "GPU 2 memory free again (0 of 97887 MiB used)"


@pytest.mark.slow
def test_a_group_restarts_on_a_new_spec_once_every_gpu_is_free_and_keeps_its_tp_size(
        fleets: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = fleets(gpus=2, env={"SGLANG_SIM_NUM_GPUS": "2", "SGLANG_SIM_TIME_SCALE": "10",
                                "BATCHFLEET_SHUTDOWN_GRACE_S": "1"})
    rows = write_prompts(tmp_path / "prompts.jsonl", 200, max_tokens=64)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queue("gpu0-1"))
    fleet.start_worker("gpu0-1")
    fleet.wait_for(lambda: any(s.state is WorkerState.SERVING and s.in_flight > 0 for s in fleet.statuses()), 60,
                   "serving")
    fleet.r.hset(fleet.k.control, Keys.CONTROL_FLEET,
                 ServerSpec(generation=1, strategy="no_buffer", max_running_requests=64).to_json())
    fleet.wait_for(lambda: any(s.generation == 1 and s.state is WorkerState.SERVING for s in fleet.statuses()), 60,
                   "the new generation to serve")
    (restarted,) = fleet.events("restarted")
    # both GPUs of the group were asked about (the simulator's nvidia-smi: 2 x 97,887 MiB)
    assert restarted.data["gpu"] == "GPUs 0,1 memory free again (0 of 195774 MiB used)", restarted.data
    rec = fleet.sim_record("gpu0-1")  # the new server process
    assert rec["gpu_indices"] == [0, 1] and rec["flags"]["tp_size"] == 2 and rec["argv"].count("--tp-size") == 1
    assert rec["argv"][rec["argv"].index("--mamba-radix-cache-strategy") + 1] == "no_buffer"
    fleet.wait_for(lambda: fleet.finished() >= 200, 120, "all prompts")
    assert fleet.stop_all() == {"gpu0-1": 0}
    out = tmp_path / "out.jsonl"
    fleet.producer("export", str(out))
    ids = [orjson.loads(x)["custom_id"] for x in out.read_bytes().splitlines()]
    assert ids == [r["id"] for r in rows] and fleet.stats()["succeeded"] == 200  # 0 lost, 0 duplicated


def test_a_worker_on_gpus_the_host_does_not_have_or_with_a_disagreeing_tp_size_is_one_line_and_exit_2(
        fleets: Callable[..., Fleet], r: redis.Redis) -> None:
    fleet = fleets(gpus=4, env={"SGLANG_SIM_NUM_GPUS": "2"})
    before = r.smembers(WORKERS)
    for queue, args, words in (
            ("gpu2-3", "", "names GPU(s) 2,3, which this host does not have (nvidia-smi lists 0,1)"),
            ("gpu1-2", "", "names GPU(s) 2, which this host does not have"),
            ("gpu0-1", "--tp-size 4", "BATCHFLEET_SERVER_ARGS has --tp-size 4 = 4 GPU(s), but this worker's server "
                                      "runs on a group of 2 GPUs (0,1)"),
            ("gpu0", "--tp-size=2", "runs on GPU 0: make them agree")):
        proc = fleet.start_worker(queue, env={"BATCHFLEET_SERVER_ARGS": args})
        assert proc.wait(60) == 2, fleet.worker_log(queue)
        lines = [x for x in fleet.worker_log(queue).splitlines() if x.strip()]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in lines[0], lines
        del fleet.workers[queue]
    assert r.smembers(WORKERS) == before and not (fleet.tmp / "gpus").exists()  # no server was started


@pytest.mark.slow
def test_a_release_without_the_effective_key_has_its_capacity_summed_from_each_dp_ranks_log_line(
        fleets: Callable[..., Fleet]) -> None:
    """SGLang before 0.5.22 has no `effective_max_running_requests_per_dp`: the worker reads each DP rank's
    start-up line (` DP0 TP0`, ` DP1 TP0` prefixes) and sums them."""
    fleet = fleets(gpus=4, env={"SGLANG_SIM_NUM_GPUS": "4", "SGLANG_SIM_VERSION": "0.5.9"})
    fleet.start_worker("gpu0-3", env={"BATCHFLEET_SERVER_ARGS": "--dp-size 2"})
    fleet.wait_for(lambda: _serving(fleet, fleet.queue("gpu0-3")) is not None, 90, "the gpu0-3 worker serving")
    status = _serving(fleet, fleet.queue("gpu0-3"))
    assert status is not None
    info = httpx.get(status.server_url + "/get_server_info", timeout=10).json()  # old releases' only form
    assert len(info["internal_states"]) == 2
    assert all("effective_max_running_requests_per_dp" not in s for s in info["internal_states"])
    log = (fleet.tmp / "state" / "logs" / "sglang-gpu0-3.log").read_text()
    per_rank = [int(n) for n in re.findall(r" DP\d TP0\] max_total_num_tokens=.*max_running_requests=(\d+)", log)]
    assert len(per_rank) == 2 and status.effective_max == sum(per_rank) > 0, (per_rank, status.effective_max)
    assert fleet.stop_all() == {"gpu0-3": 0}
