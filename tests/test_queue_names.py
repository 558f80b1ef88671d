"""Queue names that scale to many hosts: `[<run>.][<host>.]gpuN`, the local part picks the GPU;
`producer enqueue --queues` takes names, `[A-B]` ranges, or the live fleet's queues."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import redis

from batchfleet.config import (
    DEFAULT_QUEUE_PATTERN,
    Config,
    expand_queues,
    gpu_group_for_queue,
    gpu_index_for_queue,
    group_label,
    queue_host,
)
from batchfleet.connection import SOCKET_TIMEOUT_S
from batchfleet.errors import ConfigError
from batchfleet.keys import STATUS_TTL_S, Keys, valid_queue_name
from batchfleet.records import WorkerStatus
from producer.queues import live_queues, resolve_queues

from .test_producer_helpers import RUN, Cli, make_cli, queued_ids, simple, write_jsonl


@pytest.mark.parametrize("queue, gpu, host", [
    ("gpu3", 3, ""), ("hostb.gpu3", 3, "hostb"), ("jobA.hostb.gpu12", 12, "jobA.hostb"),
    ("gpu-node-7.gpu0", 0, "gpu-node-7"),
    ("cpu", None, ""), ("gpu3.hostb", None, "gpu3"), ("hostb.gpu", None, "hostb"), ("node7", None, ""),
])
def test_the_local_part_names_the_gpu(queue, gpu, host):
    assert gpu_index_for_queue(queue) == gpu
    assert queue_host(queue) == host


@pytest.mark.parametrize("queue, group", [
    ("hosta.gpu0-3", (0, 1, 2, 3)), ("gpu4-7", (4, 5, 6, 7)), ("jobA.hostb.gpu0_2", (0, 2)),
    ("h.gpu0-1_4-5", (0, 1, 4, 5)), ("h.gpu3", (3,)), ("h.gpu3-3", (3,)),
    ("h.gpu3-1", None), ("h.gpu0-2_1", None), ("h.gpu0-", None), ("h.gpu-1", None), ("h.gpu0_", None),
    ("gpu0-3.h", None),
])
def test_a_group_of_gpus_is_named_as_a_range(queue, group):
    assert gpu_group_for_queue(queue) == group
    assert gpu_index_for_queue(queue) == (group[0] if group else None)  # the first GPU: port base + it
    if group:
        assert queue_host(queue) == queue.rpartition(".")[0]
        assert valid_queue_name(queue) and expand_queues(queue) == (queue,)


def test_a_groups_label_reads_back_as_the_group():
    for group in ((0,), (3,), (0, 1, 2, 3), (4, 5, 6, 7), (0, 2), (0, 1, 4, 5), (1, 3, 4, 5)):
        assert gpu_group_for_queue(f"hosta.{group_label(group)}") == group
    assert group_label((0, 1, 2, 3)) == "gpu0-3" and group_label((5,)) == "gpu5" and group_label((0, 2)) == "gpu0_2"


def test_the_default_pattern_matches_every_hosts_gpu_queues():
    for q in ("gpu0", "hosta.gpu7", "jobA.hostb.gpu15", "hosta.gpu0-3", "jobA.hostb.gpu4-7", "h.gpu0_2"):
        assert re.fullmatch(DEFAULT_QUEUE_PATTERN, q), q
    for q in ("hosta.cpu0", "gpu0.hosta", "default", "hosta.gpu0:x", "hosta.gpu0-", "hosta.gpu0-3.x"):
        assert not re.fullmatch(DEFAULT_QUEUE_PATTERN, q), q
    assert Config().queue_pattern == DEFAULT_QUEUE_PATTERN
    with pytest.raises(ConfigError, match="not a regular expression"):
        Config.from_env({"BATCHFLEET_QUEUE_PATTERN": "gpu(\\d+"})


def test_ranges_expand_and_bad_names_are_refused():
    assert expand_queues("hosta.gpu[0-2], hostb.gpu[0-1],hosta.gpu1") == (
        "hosta.gpu0", "hosta.gpu1", "hosta.gpu2", "hostb.gpu0", "hostb.gpu1")
    assert len(expand_queues("a.gpu[0-7],b.gpu[0-7]")) == 16
    for bad, why in (("a b.gpu0", "letters"), ("hosta..gpu0", "letters"), ("h.gpu[3-1]", "empty"),
                     ("h[0-1].gpu[0-1]", "one"), ("rq:queue:x", "letters")):
        with pytest.raises(ConfigError, match=why):
            expand_queues(bad)


def put_status(r: redis.Redis, name: str, queue: str, state: str = "serving") -> None:
    ws = WorkerStatus(worker=name, host=queue_host(queue), queue=queue, gpu=gpu_index_for_queue(queue), state=state)
    r.set(Keys(RUN).status(name), ws.to_json(), ex=STATUS_TTL_S)
    r.sadd(Keys(RUN).workers, name)


def test_live_queues_are_what_live_workers_report(r: redis.Redis):
    keys = Keys(RUN)
    put_status(r, "hostb.gpu1.9", "hostb.gpu1")
    put_status(r, "hosta.gpu10.8", "hosta.gpu10")
    put_status(r, "hosta.gpu2.7", "hosta.gpu2", state="starting")
    put_status(r, "hosta.gpu4-7.5", "hosta.gpu4-7")  # one server on a group of GPUs: after gpu2, before gpu10
    put_status(r, "hostc.gpu0.6", "hostc.gpu0", state="down")  # its server cannot start: no work for it
    r.set(keys.status("garbage"), b"{not json", ex=STATUS_TTL_S)
    r.sadd(keys.workers, "garbage", "gone")  # "gone": its record expired
    assert live_queues(r, keys) == ["hosta.gpu2", "hosta.gpu4-7", "hosta.gpu10", "hostb.gpu1"]
    assert resolve_queues("live,spare.gpu[0-1]", r, keys) == (
        "hosta.gpu2", "hosta.gpu4-7", "hosta.gpu10", "hostb.gpu1", "spare.gpu0", "spare.gpu1")
    with pytest.raises(ConfigError, match="no live worker of run 'other'"):
        resolve_queues("live", r, Keys("other"))


@pytest.fixture
def cli(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return make_cli(redis_url, tmp_path / "state", monkeypatch, capsys)


def test_enqueue_to_the_live_fleet_or_a_range(cli: Cli, r: redis.Redis, tmp_path: Path):
    f = write_jsonl(tmp_path / "in.jsonl", simple(8))
    rc, _, err = cli("enqueue", str(f), "--queues", "live", "--no-progress")
    assert rc == 2 and "no live worker" in err and "start the workers first" in err
    put_status(r, "hosta.gpu0.1", "hosta.gpu0")
    put_status(r, "hostb.gpu0.2", "hostb.gpu0")
    rc, out, _ = cli("enqueue", str(f), "--queues", "live", "--no-progress")
    assert rc == 0 and "fed to Redis: hosta.gpu0 4, hostb.gpu0 4" in out
    f2 = write_jsonl(tmp_path / "more.jsonl", simple(4, prefix="q"))
    rc, out, _ = cli("enqueue", str(f2), "--queues", "hosta.gpu[0-1],hostb.gpu[0-1]", "--no-progress")
    assert rc == 0 and "fed to Redis: hosta.gpu0 1, hosta.gpu1 1, hostb.gpu0 1, hostb.gpu1 1" in out
    assert len(queued_ids(r, "hosta.gpu0", "hosta.gpu1", "hostb.gpu0", "hostb.gpu1")) == 12
    rc, _, err = cli("enqueue", str(f2), "--queues", "bad name", "--no-progress")
    assert rc == 2 and "queue name 'bad name'" in err


def test_a_worker_on_a_host_qualified_queue(r: redis.Redis, monkeypatch: pytest.MonkeyPatch):
    """`rq worker hostb.gpu3` on host hostb: named once after its host, Redis waits bounded."""
    from worker import GPUWorker

    monkeypatch.setattr(socket, "gethostname", lambda: "hostb")
    w = GPUWorker(["hostb.gpu3"], connection=r)
    assert re.fullmatch(r"hostb\.gpu3\.\d+", w.name)
    assert re.fullmatch(r"hostb\.hosta\.gpu0\.\d+", GPUWorker(["hosta.gpu0"], connection=r).name)
    # RQ raises the read timeout to ~7 minutes for its blocking dequeue; our worker never dequeues
    # that way, and a partition must not hang it that long.
    assert w.connection.connection_pool.connection_kwargs["socket_timeout"] == SOCKET_TIMEOUT_S


def test_the_procfiles_gpu_lines_are_named_after_the_gpus_their_queue_names():
    """Each `gpuN:` / `gpuA-B:` line of the shipped Procfile runs `rq worker $(hostname -s).<its name>`, and
    the name reads back as the GPU or group the worker serves (the README and docs/multihost.md show them)."""
    text = (Path(__file__).resolve().parents[1] / "Procfile").read_text()
    lines = re.findall(r"^(gpu[^:]*): env RQ_WORKER_CLASS=worker\.GPUWorker rq worker \$\(hostname -s\)\.(\S+)$",
                       text, flags=re.M)
    assert {name for name, _ in lines} >= {f"gpu{i}" for i in range(8)} | {"gpu0-3", "gpu4-7", "gpu0-7"}
    for name, queue in lines:
        assert name == queue and gpu_group_for_queue(f"hosta.{queue}") is not None
    assert gpu_group_for_queue("hosta.gpu4-7") == (4, 5, 6, 7)


def test_batchfleet_run_groups_the_gpus_given_in_order_and_names_each_groups_queue():
    from fleetrun.launch import UsageError, gpu_groups, queues_of

    assert gpu_groups(tuple(range(8)), 4, host_gpus=8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert queues_of("r", gpu_groups(tuple(range(8)), 4, host_gpus=8)) == ("r.gpu0-3", "r.gpu4-7")
    assert queues_of("r", gpu_groups((0, 2, 5, 7), 2, host_gpus=8)) == ("r.gpu0_2", "r.gpu5_7")
    assert queues_of("r", gpu_groups((0, 1), 1, host_gpus=None)) == ("r.gpu0", "r.gpu1")  # as before
    for queue, group in zip(queues_of("r", gpu_groups((3, 4, 6, 7), 2, host_gpus=8)), ((3, 4), (6, 7)), strict=True):
        assert gpu_group_for_queue(queue) == group and re.fullmatch(DEFAULT_QUEUE_PATTERN, queue)
    with pytest.raises(UsageError, match="does not divide the 6 GPU"):
        gpu_groups(tuple(range(6)), 4, host_gpus=8)
    with pytest.raises(UsageError, match="a server on 16 GPUs, but this host has 8"):
        gpu_groups(tuple(range(16)), 16, host_gpus=8)
