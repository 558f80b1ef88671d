"""A fleet across hosts, for real: each host its own network namespace, hostname, state dir and
simulated GPUs (tests/hosts.py); Redis, the producer, the collector and the supervisor on the head
(the root namespace). Every test asserts exact counts: results == prompts, 0 duplicated, 0 lost."""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from batchfleet.keys import Keys
from batchfleet.rqlayout import execution_job

from .fleet import expected_text, text_of, write_prompts
from .hosts import BIN, ROOT, Lan

pytestmark = pytest.mark.slow


@pytest.fixture
def lan(tmp_path: Path) -> Iterator[Lan]:
    net = Lan(tmp_path, run=f"mh{secrets.token_hex(3)}")
    try:
        yield net
    finally:
        net.close()


def export_lines(lan: Lan, *args: str) -> list[dict]:
    out = lan.tmp / "head" / "results.jsonl"
    lan.producer("export", str(out), *args)
    return [orjson.loads(x) for x in out.read_bytes().splitlines()]


def assert_exact(lan: Lan, rows: list[dict], lines: list[dict]) -> None:
    """One export line per prompt, each the answer the simulator gives that prompt; one result ever
    published per prompt (the workers' counter); nothing left in Redis."""
    ids = [x["custom_id"] for x in lines]
    assert len(ids) == len(set(ids)) == len(rows), "duplicated or lost prompts in the export"
    assert ids == [r["id"] for r in rows]  # input order
    for row, line in zip(rows, lines, strict=True):
        assert line["error"] is None, line
        assert text_of(line["response"]["body"]) == expected_text(row)
    stats = lan.stats()
    assert stats["succeeded"] == len(rows) and stats.get("failed", 0) == 0, stats
    assert lan.r.zcard(lan.k.leases) == 0 and lan.r.xlen(lan.k.results) == 0


def test_run_across_two_hosts(lan):
    hosts = [lan.add_host("hosta"), lan.add_host("hostb")]
    for h in hosts:
        for gpu in (0, 1):
            h.start_worker(gpu)
    queues = ["hosta.gpu0", "hosta.gpu1", "hostb.gpu0", "hostb.gpu1"]
    lan.wait_for(lambda: sorted(lan.serving()) == queues, 90, "4 workers serving on 2 hosts")
    lan.start_collector()
    lan.start_supervisor("--dry-run", "--window", "2", "--sample", "0.5")

    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 400)
    enq = lan.producer("enqueue", "prompts.jsonl", "--queues", "live")
    assert fed_queues(enq.stdout) == set(queues)  # every live queue got its window; the head feeds the rest
    lan.wait_for(lambda: lan.finished() >= 400, 180, "400 prompts")

    # Each host ran its own GPUs 0 and 1 on the same ports, under its own hostname.
    statuses = lan.serving()
    for h in hosts:
        for gpu in (0, 1):
            s = statuses[h.queue(gpu)]
            assert (s.host, s.gpu, s.server_url) == (h.name, gpu, f"http://127.0.0.1:{30000 + gpu}")
            assert s.worker.startswith(f"{h.queue(gpu)}.")  # host.gpuN.pid: the host is not repeated
            rec = h.sim_record(gpu)
            assert rec["flags"]["port"] == 30000 + gpu and rec["gpu_index"] == gpu

    # The supervisor on the head saw every host's GPUs in one view.
    samples = [orjson.loads(f[b"s"]) for _, f in lan.r.xrange(lan.k.history)]
    assert any({w.rsplit(".", 1)[0] for w in s["gpus"]} == set(queues) for s in samples)

    assert lan.stop_head()["collector"] == 0
    codes = {q: c for h in hosts for q, c in h.stop_all().items()}
    assert set(codes.values()) == {0}, codes
    # Read after the servers' clean exit, which rewrites their records (else every 0.5 s).
    assert all(h.served(g) > 0 for h in hosts for g in (0, 1)), "a GPU took no work"
    assert sum(h.served(g) for h in hosts for g in (0, 1)) == 400  # every prompt ran once
    assert_exact(lan, rows, export_lines(lan))


def test_one_tp2_server_per_host(lan):
    """Each host runs one server on its GPUs 0 and 1 (`rq worker <host>.gpu0-1`): tensor parallel 2, on
    port base + 0 of its own host; the run ends exact."""
    hosts = [lan.add_host("hosta"), lan.add_host("hostb")]
    for h in hosts:
        h.start_worker("gpu0-1")
    queues = ["hosta.gpu0-1", "hostb.gpu0-1"]
    lan.wait_for(lambda: sorted(lan.serving()) == queues, 90, "2 TP2 workers serving on 2 hosts")
    lan.start_collector()
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 200)
    enq = lan.producer("enqueue", "prompts.jsonl", "--queues", "live")
    assert fed_queues(enq.stdout) == set(queues)
    lan.wait_for(lambda: lan.finished() >= 200, 180, "200 prompts")
    statuses = lan.serving()
    for h in hosts:
        s = statuses[h.queue("gpu0-1")]
        assert (s.host, s.gpu, s.server_url) == (h.name, 0, "http://127.0.0.1:30000")
        assert s.worker.startswith(f"{h.name}.gpu0-1.")
        assert s.server_flags[s.server_flags.index("--tp-size"):][:2] == ["--tp-size", "2"]
        rec = h.sim_record("gpu0-1")
        assert rec["flags"]["tp_size"] == 2 and rec["gpu_indices"] == [0, 1]
    assert lan.stop_head()["collector"] == 0
    codes = {q: c for h in hosts for q, c in h.stop_all().items()}
    assert set(codes.values()) == {0}, codes
    assert all(h.served("gpu0-1") > 0 for h in hosts), "a host took no work"
    assert sum(h.served("gpu0-1") for h in hosts) == 200  # every prompt ran once
    assert_exact(lan, rows, export_lines(lan))


def fed_queues(out: str) -> set[str]:
    """The queues `producer enqueue` says it fed ("fed to Redis: q n, q n")."""
    line = next(x for x in out.splitlines() if x.startswith("fed to Redis: "))
    return {part.strip().split(" ")[0] for part in line.removeprefix("fed to Redis: ").split(",")}


def held_by(lan: Lan, host: str) -> set[str]:
    """Job ids whose lease a worker of `host` holds now (RQ's job hash names the worker)."""
    jids = {execution_job(m) for m in lan.r.zrange(lan.k.leases, 0, -1)}
    return {j for j in jids if (lan.r.hget(Keys.job(j), "worker_name") or b"").decode().startswith(host + ".")}


def dropped_late(logs: str) -> int:
    """Finished prompts a worker says Redis refused because their lease had lapsed (its own log line)."""
    return sum(int(m) for m in re.findall(r"(\d+) finished prompt\(s\) were already recovered by another worker", logs))


def test_partitioned_host_loses_its_prompts_to_the_others_and_rejoins(lan):
    slow = {"SGLANG_SIM_TIME_SCALE": "5"}  # the run must outlast the checks, on a loaded box too
    a, b = lan.add_host("hosta", env=slow), lan.add_host("hostb", env=slow)
    hosts = (a, b)
    for h in hosts:
        for gpu in (0, 1):
            h.start_worker(gpu)
    lan.wait_for(lambda: len(lan.serving()) == 4, 90, "4 workers serving")
    lan.start_collector()
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 300, max_tokens=200)
    lan.producer("enqueue", "prompts.jsonl", "--queues", "live")
    lan.wait_for(lambda: all(lan.serving()[a.queue(g)].in_flight >= 5 for g in (0, 1)), 60, "hosta busy")

    # 60 s of silence: hosta's packets vanish (no "no route to host" to tell its workers).
    a.link_down(silent=True)
    down_at = time.monotonic()
    time.sleep(0.5)  # what was on the wire has landed; nothing of hosta's reaches Redis after this
    held = held_by(lan, "hosta")
    assert len(held) >= 10
    # The other host puts hosta's prompts back within the lease (15 s, checked every 5 s) and runs them.
    recovered_s = lan.wait_for(lambda: lan.stats().get("recovered", 0) >= len(held), 30,
                               "hostb to recover hosta's prompts")
    lan.wait_for(lambda: lan.finished() >= 300, 120, "hostb to finish the run alone")
    assert lan.stats()["recovered"] == len(held)  # only the partitioned host's leases lapsed
    time.sleep(max(0.0, 60 - (time.monotonic() - down_at)))
    a.link_up()
    served_at_up = a.served(0) + a.served(1)

    # It rejoins: reports again within its Redis timeouts (10 s + 5 s to connect), not TCP's minutes.
    rejoin_s = lan.wait_for(lambda: {a.queue(0), a.queue(1)} <= set(lan.serving()), 30, "hosta to report again")
    more = write_prompts(lan.tmp / "head" / "more.jsonl", 200, max_tokens=200, start=300)
    lan.producer("enqueue", "more.jsonl", "--queues", "live")
    lan.wait_for(lambda: lan.finished() >= 500, 120, "the second batch")
    lan.stop_head()
    for h in hosts:
        h.stop_all()
    print(f"partition: {len(held)} prompts recovered {recovered_s:.1f} s after the link went down; "
          f"hosta reported again {rejoin_s:.1f} s after it came back")

    # Its late results (prompts it finished while cut off) were refused, each one: the prompts it
    # ran twice are exactly the ones it says Redis refused, and the export holds each prompt once.
    dropped = dropped_late(a.worker_log(a.queue(0)) + a.worker_log(a.queue(1)))
    assert 1 <= dropped <= len(held)
    assert sum(h.served(g) for h in hosts for g in (0, 1)) == len(rows) + len(more) + dropped
    # It rejoined cleanly: it took a fair share of the second batch from its own queues.
    assert a.served(0) + a.served(1) - served_at_up >= len(more) // 4
    assert_exact(lan, rows + more, export_lines(lan))


def test_a_whole_host_lost_the_rest_finish_the_run(lan):
    slow = {"SGLANG_SIM_TIME_SCALE": "5"}  # the run must outlast the checks, on a loaded box too
    a, b = lan.add_host("hosta", env=slow), lan.add_host("hostb", env=slow)
    for h in (a, b):
        for gpu in (0, 1):
            h.start_worker(gpu)
    lan.wait_for(lambda: len(lan.serving()) == 4, 90, "4 workers serving")
    lan.start_collector()
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 300, max_tokens=200)
    lan.producer("enqueue", "prompts.jsonl", "--queues", "live")
    lan.wait_for(lambda: all(lan.serving()[a.queue(g)].in_flight >= 5 for g in (0, 1)), 60, "hosta busy")

    assert a.kill_all() >= 4  # 2 workers and their 2 servers, at least
    lost_at = time.monotonic()
    assert a.pids() == []
    held = held_by(lan, "hosta")
    assert len(held) >= 10
    recovered_s = lan.wait_for(lambda: lan.stats().get("recovered", 0) >= len(held), 30,
                               "hostb to recover the lost host's prompts")
    # hostb takes what hosta's queues still held too: the default pattern matches host-qualified names.
    lan.wait_for(lambda: lan.finished() >= 300, 120, "hostb to finish the run")
    finished_s = time.monotonic() - lost_at
    assert lan.r.llen("rq:queue:hosta.gpu0") == lan.r.llen("rq:queue:hosta.gpu1") == 0
    lan.stop_head()
    assert set(b.stop_all().values()) == {0}
    print(f"host lost: {len(held)} prompts recovered {recovered_s:.1f} s after the kill; run finished "
          f"{finished_s:.1f} s after it")
    assert lan.stats()["recovered"] == len(held)
    assert_exact(lan, rows, export_lines(lan))


def test_a_host_joining_mid_run_takes_work_at_once(lan):
    slow = {"SGLANG_SIM_TIME_SCALE": "2"}  # hosta alone would need about a minute: time for hostb to come up
    a = lan.add_host("hosta", env=slow)
    for gpu in (0, 1):
        a.start_worker(gpu)
    lan.wait_for(lambda: len(lan.serving()) == 2, 90, "hosta serving")
    lan.start_collector()
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 400, max_tokens=200)
    lan.producer("enqueue", "prompts.jsonl", "--queues", "live")  # hosta's two queues: nothing for hostb
    lan.wait_for(lambda: lan.finished() >= 20, 60, "the run under way")

    b = lan.add_host("hostb", env=slow)  # a new machine comes up mid-run: namespace, link, workers
    for gpu in (0, 1):
        b.start_worker(gpu)
    serving_s = lan.wait_for(lambda: {b.queue(0), b.queue(1)} <= set(lan.serving()), 90, "hostb serving")
    # What was still to run when hostb came (in hosta's queues, or in the store for the head to feed).
    backlog = 400 - lan.finished() - sum(s.in_flight for s in lan.serving().values())
    assert backlog > 60, "the run ended before hostb joined: the test proves nothing"
    first_s = lan.wait_for(lambda: b.served(0) > 0 and b.served(1) > 0, 30, "hostb's GPUs to take work")
    lan.wait_for(lambda: lan.finished() >= 400, 180, "the run")
    lan.stop_head()
    for h in (a, b):
        assert set(h.stop_all().values()) == {0}
    print(f"join: hostb serving {serving_s:.1f} s after its workers started, both GPUs busy "
          f"{first_s:.1f} s later ({backlog} prompts were waiting on hosta's queues)")
    served_b = b.served(0) + b.served(1)
    assert served_b + a.served(0) + a.served(1) == 400  # every prompt ran once
    # hostb stole from hosta's queues from then on: about half of what was left (a quarter is plenty).
    assert served_b >= backlog // 4, (served_b, backlog)
    assert lan.stats().get("recovered", 0) == 0
    assert_exact(lan, rows, export_lines(lan))


def test_a_host_whose_clock_is_five_minutes_behind(lan):
    slow = {"SGLANG_SIM_TIME_SCALE": "2"}  # a run of ~15 s: several lease checks (every 5 s) happen in it
    a = lan.add_host("hosta", env=slow)
    b = lan.add_host("hostb", env=slow, clock_skew_s=-300)  # its Python processes see time.time() - 300
    seen = float(b.run(str(BIN / "python"), "-c", "import time; print(time.time())").stdout)
    assert abs(seen - (time.time() - 300)) < 30
    for h in (a, b):
        h.start_worker(0)
    lan.wait_for(lambda: len(lan.serving()) == 2, 90, "both hosts serving")
    lan.start_collector()
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 120, max_tokens=200)
    lan.producer("enqueue", "prompts.jsonl", "--queues", "live")
    # The head counts hostb's worker as alive: its record is live by Redis's clock (its TTL), whatever its `ts`.
    lan.wait_for(lambda: lan.finished() >= 10, 60, "the run under way")
    st = orjson.loads(lan.producer("status", "--json").stdout)
    assert st["workers"] == {"live": 2, "known": 2, "silent": 0, "unreadable": 0, "not_serving": []}
    lan.wait_for(lambda: lan.finished() >= 120, 180, "the run")
    for h in (a, b):
        assert set(h.stop_all().values()) == {0}
    assert_exact(lan, rows, export_lines(lan))

    # Leases: nobody may take hostb's prompts for lapsed while it renews them, 5 minutes or not.
    recovered = lan.stats().get("recovered", 0)
    served = a.served(0) + b.served(0)
    assert recovered == 0 and served == len(rows)
    assert b.served(0) > 0


def readme_recipe() -> dict[str, list[str]]:
    """The README's multi-host recipe, by where each line runs: env (the .env), gpu (every GPU host),
    head (the head host, in order)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- multihost-recipe")[1].split("```sh\n", 1)[1].split("```", 1)[0]
    where = {"# On every host": "env", "# On every GPU host": "gpu", "# On the head host": "head"}
    out: dict[str, list[str]] = {"env": [], "gpu": [], "head": []}
    current = None
    for line in block.splitlines():
        if line.startswith("#"):
            current = next(v for k, v in where.items() if line.startswith(k))
        elif line.strip():
            out[current].append(line)
    return out


def test_the_readme_multihost_recipe_as_written(tmp_path):
    recipe = readme_recipe()
    assert [line.split("=")[0] for line in recipe["env"]] == ["REDIS_URL", "BATCHFLEET_MODEL_PATH"]
    lan = Lan(tmp_path, run="default")  # the recipe names no run
    try:
        head, hosts = lan.add_host("head"), [lan.add_host("hosta"), lan.add_host("hostb")]
        base = {"PATH": lan.env["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}  # the package installed
        for h in (head, *hosts):
            # The recipe's .env with this test's values, plus what simulated GPUs need instead of real ones.
            values = {"REDIS_URL": lan.redis_url, "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid"}
            dotenv = [f"{line.split('=')[0]}={values[line.split('=')[0]]}" for line in recipe["env"]]
            dotenv += [f'BATCHFLEET_SGLANG_CMD="{sys.executable} -m sglang_sim"', "BATCHFLEET_STARTUP_TIMEOUT_S=60",
                       "BATCHFLEET_STATUS_INTERVAL_S=0.5", f"SGLANG_SIM_GPU_DIR={h.dir / 'gpus'}",
                       "SGLANG_SIM_TIME_SCALE=20", "SGLANG_SIM_STARTUP_S=0.2"]
            (h.dir / ".env").write_text("\n".join(dotenv) + "\n")
            shutil.copy(ROOT / "Procfile", h.dir / "Procfile")
        for h in hosts:  # each has 2 GPUs: the recipe's line with the lines of the GPUs it has
            for line in recipe["gpu"]:
                words = [w for w in shlex.split(line) if not re.fullmatch(r"gpu\d+", w) or w in ("gpu0", "gpu1")]
                h.popen(*words, log=h.dir / "honcho.log", env=base, inherit=False)
        rows = write_prompts(head.dir / "prompts.jsonl", 200)
        for line in recipe["head"]:
            words = shlex.split(line)
            if words[:2] == ["honcho", "start"]:
                head.popen(*words, log=head.dir / "honcho.log", env=base, inherit=False)
                continue
            if "live" in words:  # "once the workers run"
                lan.wait_for(lambda: len(lan.serving()) == 4, 90, "the GPU hosts' workers")
            done = head.run(*words, env=base, timeout_s=180)
            assert done.returncode == 0, (line, done.stdout, done.stderr)
            if "enqueue" in words:
                assert fed_queues(done.stdout) == {f"{h}.gpu{g}" for h in ("hosta", "hostb") for g in (0, 1)}
        # Status records come every 0.5 s: wait until the workers' counts hold still, then their sum must
        # be the prompts exactly (a prompt run twice would make it more, one lost less). Not "each did
        # some": a worker whose queue is dry polls at most every 0.5 s and its busy peers take from every
        # queue once theirs runs dry (work stealing, README), so one may find its share taken. That all
        # four were fed is asserted above, at the enqueue.
        counts: dict[str, int] = {}

        def settled() -> bool:
            before = {w: s.done for w, s in lan.serving().items()}
            time.sleep(1.5)
            counts.clear()
            counts.update({w: s.done for w, s in lan.serving().items()})
            return counts == before and len(counts) == 4 and sum(counts.values()) > 0

        lan.wait_for(settled, 60, "the workers' counts to hold still")
        statuses = lan.serving()
        assert {(s.host, s.gpu) for s in statuses.values()} == {(h, g) for h in ("hosta", "hostb") for g in (0, 1)}
        assert sum(counts.values()) == len(rows)
        lines = [orjson.loads(x) for x in (head.dir / "results.jsonl").read_bytes().splitlines()]
        assert_exact(lan, rows, lines)
        # The head ran the collector and the supervisor (its metrics on the Procfile's port, inside the head).
        metrics = head.run(str(BIN / "python"), "-c", "import httpx; print(httpx.get('http://127.0.0.1:9464').text)")
        capacities = re.findall(r'^batchfleet_gpu_max_running_requests\{[^}]*\} (\S+)$', metrics.stdout, re.M)
        assert len(capacities) == 4 and all(float(c) > 0 for c in capacities), metrics.stdout[-2000:]
    finally:
        lan.close()


def test_the_autopilot_canaries_and_rolls_out_across_hosts(lan):
    """Issue 12: one supervisor on the head, GPUs on two hosts (the same GPU index and port on each).
    The canary is one host's GPU, the rollout reaches the other host's, by queue (`<host>.gpuN`)."""
    env = {"SGLANG_SIM_TIME_SCALE": "5", "BATCHFLEET_SHUTDOWN_GRACE_S": "1"}  # tiny-hybrid: 12 -> 22 slots
    hosts = [lan.add_host("hosta", env=env), lan.add_host("hostb", env=env)]
    for h in hosts:
        h.start_worker(0)
    queues = ["hosta.gpu0", "hostb.gpu0"]
    lan.wait_for(lambda: sorted(lan.serving()) == queues, 90, "a worker serving on each host")
    lan.start_collector()
    lan.start_supervisor("--window", "2", "--windows", "3", "--sample", "0.5", "--restart-cost", "1",
                         "--verify-windows", "2", "--rollout-batch", "1", "--keep-prefix-cache")
    rows = write_prompts(lan.tmp / "head" / "prompts.jsonl", 900, max_tokens=500)  # enough that a restart pays
    lan.producer("enqueue", "prompts.jsonl", "--queues", "live")

    def kinds() -> list[str]:
        return [e.kind for e in lan.events()]

    lan.wait_for(lambda: "rolled_out" in kinds() or "rollback" in kinds(), 180, "the rollout across hosts")
    lan.wait_for(lambda: lan.finished() >= len(rows), 360, "the run")
    events = lan.events()
    canary = next(e for e in events if e.kind == "canary")
    restarted = {e.data.get("queue") for e in events if e.kind == "restarted"}
    statuses = lan.serving()
    lan.stop_head()
    for h in hosts:
        h.stop_all()
    assert "rollback" not in kinds(), lan.head_log("supervisor")[-3000:]
    assert canary.data["canary"] in queues, canary  # one host's GPU, named by its queue
    assert restarted == set(queues)  # each host's GPU restarted once on the new spec, by its queue
    assert {(s.host, s.strategy, s.effective_max) for s in statuses.values()} == \
        {("hosta", "no_buffer", 22), ("hostb", "no_buffer", 22)}
    assert lan.r.hkeys(lan.k.control) == [b"fleet"], "a stale override stayed behind"
    assert_exact(lan, rows, export_lines(lan))
