"""`batchfleet serve`'s tenants without GPUs, driven by the official `openai` client: the tenants file
(hashed keys, its mistakes one line, never shown, read again on SIGHUP), `metadata.priority`, quotas
refused at creation with their figures, `GET /v1/fleet`, `/metrics`, and a batch's deadline estimate
and expiry under fair share. The serve runs the API and the head; prompts are answered, where a test
needs it, by the worker's own Ledger (tests/test_producer_helpers.py). Weights, priority and crashes on
simulated GPUs: tests/test_serve_share.py."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import redis
from openai.types import Batch

from batchapi.auth import ApiKeys
from batchapi.fleet import FleetBook
from batchapi.objects import BatchRecord, BatchStatus, new_batch_id
from batchapi.registry import Registry
from batchapi.tenants import PRIORITY_NAMES, TenantsError, load_tenants
from batchfleet.keys import Keys
from producer.api import priority_level

from .serveproc import BIN, Serve, batch_lines, serve_env, write_lines
from .test_producer_helpers import work

KEYS = {"alpha": "sk-alpha-3f9a1c77d2", "beta": "sk-beta-81e0b44c6a", "gamma": "sk-gamma-5d2e90aa13"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tenants_file(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def two_tenants(path: Path, *, alpha: str = "", beta: str = "") -> Path:
    return tenants_file(path, f"""
[tenants.alpha]
keys = ["{sha(KEYS['alpha'])}"]
weight = 1
{alpha}

[tenants.beta]
keys = ["{sha(KEYS['beta'])}"]
weight = 3
priorities = ["high", "normal", "low"]
{beta}
""")


def wait_status(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 60) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.2)


def wait_log(sv: Serve, pattern: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, log := sv.log()):
        assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{log}"
        time.sleep(0.1)
    return log


def store_rows(sv: Serve, sql: str) -> list[tuple]:
    db = sqlite3.connect(sv.state / f"{sv.run}.sqlite")
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def upload(client: openai.OpenAI, path: Path, lines: list[dict]) -> str:
    return client.files.create(file=write_lines(path, lines).open("rb"), purpose="batch").id


def create(client: openai.OpenAI, fid: str, **metadata: str) -> Batch:
    return client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata=metadata or None)  # type: ignore[arg-type]


def test_the_priority_names_are_the_heads() -> None:
    assert [priority_level(p) for p in PRIORITY_NAMES] == [0, 1, 2]


@pytest.mark.parametrize(("text", "words"), [
    ("[tenants.a]\nkeys = [\"sk-plain-key-0123\"]\n", "not a SHA-256 hex digest"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\nwieght = 2\n", "a field 'wieght' is not known"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\nsk-live-0123 = 2\n", "a field is not known"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\nweight = 0\n", "`weight` must be a number above 0"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\nmax_queued_requests = -3\n", "`max_queued_requests` must be"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\npriorities = [\"urgent\"]\n", "must list some of high, normal, low"),
    (f"[tenants.a]\nkeys = [\"{sha('x')}\"]\n[tenants.b]\nkeys = [\"{sha('x')}\"]\n", "'a' and 'b' share a key"),
    (f"[tenants.default]\nkeys = [\"{sha('x')}\"]\n", "the name 'default' is taken"),
    (f"[tenants.\"{sha('x')} x\"]\nkeys = [\"{sha('y')}\"]\n", "tenant 1's name must be"),
    ("[tenants]\n", "holds no tenant"),
    ("tenants = 3 x\n", "is not TOML"),
])
def test_a_bad_tenants_file_is_named_with_its_first_mistake_and_nothing_of_its_content(
        tmp_path: Path, text: str, words: str) -> None:
    path = tenants_file(tmp_path / "tenants.toml", text)
    with pytest.raises(TenantsError) as exc:
        load_tenants(path)
    message = str(exc.value)
    assert words in message and str(path) in message, message
    secrets = re.findall(r"[0-9a-f]{64}|sk-[a-z0-9-]+", text)
    assert [s for s in secrets if s in message] == [], message


def test_serve_refuses_a_bad_tenants_file_in_one_line_and_hash_key_prints_what_the_file_keeps(
        tmp_path: Path, redis_url: str) -> None:
    env = serve_env(tmp_path, redis_url)
    good = two_tenants(tmp_path / "tenants.toml")
    loose = tenants_file(tmp_path / "loose.toml", good.read_text())
    loose.chmod(0o644)
    bad = tenants_file(tmp_path / "bad.toml", f"[tenants.a]\nkeys = [\"{KEYS['alpha']}\"]\n")
    for argv, extra, words in (
            (["--tenants", str(bad)], {}, "not a SHA-256 hex digest"),
            (["--tenants", str(loose)], {}, "may be read by others (mode 644): chmod 600 it"),
            ([], {"BATCHFLEET_TENANTS_FILE": str(tmp_path / "none.toml")}, "No such file or directory"),
            (["--tenants", str(tmp_path / "t.json")], {}, "the tenants file is TOML and its name ends in .toml"),
            (["--tenants", str(good)], {"BATCHFLEET_API_KEYS": KEYS["alpha"]},
             "also a key of tenant 'alpha' in the tenants file"),
    ):
        done = subprocess.run([str(BIN / "batchfleet"), "serve", "--state-dir", str(tmp_path / "st"), *argv],
                              env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert KEYS["alpha"] not in done.stderr and sha(KEYS["alpha"]) not in done.stderr
    assert not (tmp_path / "st").exists()  # refused before anything was made
    hashed = subprocess.run([str(BIN / "batchfleet"), "serve", "hash-key"], input=KEYS["beta"] + "\n", env=env,
                            capture_output=True, text=True, timeout=60)
    assert (hashed.returncode, hashed.stdout) == (0, sha(KEYS["beta"]) + "\n"), hashed.stderr
    assert hashed.stdout.strip() == subprocess.run(["sha256sum"], input=KEYS["beta"], capture_output=True,
                                                   text=True).stdout.split()[0]  # as docs/api.md says: the same
    empty = subprocess.run([str(BIN / "batchfleet"), "serve", "hash-key"], input="", env=env, capture_output=True,
                           text=True, timeout=60)
    assert empty.returncode == 2 and "give one API key on stdin" in empty.stderr and "Traceback" not in empty.stderr


def test_a_batch_asks_a_priority_its_tenant_may_use_and_get_shows_it_as_sent_in_openais_shape(
        tmp_path: Path, redis_url: str) -> None:
    env = serve_env(tmp_path, redis_url, BATCHFLEET_API_KEYS=KEYS["gamma"])  # a plain key: a tenant of its own
    sv = Serve(tmp_path, redis_url, "--tenants", str(two_tenants(tmp_path / "tenants.toml")), env=env).start()
    alpha, beta, gamma = (sv.client(KEYS[n]) for n in ("alpha", "beta", "gamma"))
    fa = upload(alpha, tmp_path / "a.jsonl", batch_lines(3))
    for value in ("urgent", "HIGH", ""):
        with pytest.raises(openai.BadRequestError) as exc:
            create(alpha, fa, priority=value)
        assert "one of high, normal, low" in exc.value.message and exc.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError) as exc:
        create(alpha, fa, priority="high")
    assert "tenant alpha may submit normal and low batches only" in exc.value.message, exc.value.message
    with pytest.raises(openai.BadRequestError):
        create(gamma, upload(gamma, tmp_path / "g.jsonl", batch_lines(2)), priority="high")
    assert list(alpha.batches.list()) == [] and list(gamma.batches.list()) == []  # nothing was made
    low = create(alpha, fa, priority="low", job="nightly")
    high = create(beta, upload(beta, tmp_path / "b.jsonl", batch_lines(2)), priority="high")
    plain = create(gamma, upload(gamma, tmp_path / "g2.jsonl", batch_lines(2)))
    for client, b in ((alpha, low), (beta, high), (gamma, plain)):
        wait_status(client, b.id, {"in_progress"})
        raw = sv.http("GET", f"/batches/{b.id}", key=client.api_key).json()
        assert set(raw) == set(Batch.model_fields)  # OpenAI's shape exactly: no tenant, no eta
        assert raw["metadata"] == b.metadata
    assert low.metadata == {"priority": "low", "job": "nightly"} and high.metadata == {"priority": "high"}
    owners = store_rows(sv, "SELECT f.name, o.tenant, o.priority FROM owners o JOIN files f ON f.id = o.file")
    assert sorted(owners) == sorted([(low.id, "alpha", 2), (high.id, "beta", 0), (plain.id, sha(KEYS["gamma"])[:8], 1)])
    assert store_rows(sv, "SELECT name, weight FROM tenants") == [("beta", 3.0)]


def test_a_batch_over_its_tenants_quota_is_refused_at_creation_with_the_figures_and_nothing_is_stored(
        tmp_path: Path, redis_url: str) -> None:
    lines = batch_lines(40)
    raw = [orjson.dumps(x) for x in lines]
    size = sum(len(r) - r.find(b'"messages"') for r in raw)  # its lines from their conversations on
    tokens = round(size / 4)  # nothing measured yet: 4 bytes per token
    path = two_tenants(tmp_path / "tenants.toml", alpha=f"max_queued_prompt_tokens = {tokens * 2 - 1}",
                       beta="max_queued_requests = 50")
    env = serve_env(tmp_path, redis_url, BATCHFLEET_QUEUES="quota.gpu0")
    sv = Serve(tmp_path, redis_url, "--tenants", str(path), env=env, run="quota").start()
    alpha, beta = sv.client(KEYS["alpha"]), sv.client(KEYS["beta"])
    fa = upload(alpha, tmp_path / "a.jsonl", lines)
    first = create(alpha, fa)
    with pytest.raises(openai.BadRequestError) as exc:
        create(alpha, fa)
    assert exc.value.code == "token_limit_exceeded" and exc.value.status_code == 400
    assert (f"tenant alpha has {tokens:,} prompt tokens queued, this batch adds {tokens:,}, its quota is "
            f"{tokens * 2 - 1:,}") in exc.value.message, exc.value.message
    fb = upload(beta, tmp_path / "b.jsonl", lines)
    second = create(beta, fb)
    with pytest.raises(openai.BadRequestError) as exc:
        create(beta, fb)
    assert exc.value.code == "request_limit_exceeded"
    assert "tenant beta has 40 requests queued, this batch adds 40, its quota is 50" in exc.value.message
    assert [b.id for b in alpha.batches.list()] == [first.id] and len(list(beta.batches.list())) == 1
    wait_status(alpha, first.id, {"in_progress"})
    wait_status(beta, second.id, {"in_progress"})
    assert store_rows(sv, "SELECT COUNT(*) FROM files") == [(2,)]  # the two batches accepted, no more
    assert store_rows(sv, "SELECT COUNT(*) FROM prompts") == [(80,)]
    # what finishes no longer counts: once 30 of alpha's are answered, its 10 left plus 40 fit again
    deadline = time.monotonic() + 60
    while (b := alpha.batches.retrieve(first.id)).request_counts.completed < 30:  # type: ignore[union-attr]
        work(sv.env["REDIS_URL"], ["quota.gpu0"], 10, run=sv.run)
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
    create(alpha, fa)


def test_sighup_reads_the_tenants_file_again_and_a_bad_one_keeps_the_tenants_before(tmp_path: Path,
                                                                                   redis_url: str) -> None:
    path = two_tenants(tmp_path / "tenants.toml", alpha="max_queued_requests = 5")
    sv = Serve(tmp_path, redis_url, "--tenants", str(path)).start(wait=False)
    assert sv.proc is not None
    wait_log(sv, r"serve: run \S+: ")  # starting: a SIGHUP now is kept for when the API serves
    sv.proc.send_signal(signal.SIGHUP)
    sv.wait_ready()
    wait_log(sv, r"SIGHUP: tenants file \S+ read again: 2 tenant\(s\), 2 key\(s\)")
    alpha = sv.client(KEYS["alpha"])
    fa = upload(alpha, tmp_path / "a.jsonl", batch_lines(8))
    with pytest.raises(openai.BadRequestError):
        create(alpha, fa)
    with pytest.raises(openai.AuthenticationError):
        sv.client(KEYS["gamma"]).files.list()
    # a new weight and quota, and a third tenant
    tenants_file(path, path.read_text().replace("max_queued_requests = 5", "max_queued_requests = 10")
                 .replace("weight = 3", "weight = 5") + f"\n[tenants.gamma]\nkeys = [\"{sha(KEYS['gamma'])}\"]\n")
    sv.proc.send_signal(signal.SIGHUP)
    wait_log(sv, r"SIGHUP: tenants file \S+ read again: 3 tenant\(s\), 3 key\(s\)")
    ok = create(alpha, fa)
    assert list(sv.client(KEYS["gamma"]).files.list()) == []
    deadline = time.monotonic() + 20
    while store_rows(sv, "SELECT name, weight FROM tenants") != [("beta", 5.0)]:
        assert time.monotonic() < deadline, store_rows(sv, "SELECT name, weight FROM tenants")
        time.sleep(0.2)
    # a bad file: one line, the tenants before kept (gamma still in, the quota still 10)
    good = path.read_text()
    tenants_file(path, good.replace(sha(KEYS["gamma"]), KEYS["gamma"]))
    sv.proc.send_signal(signal.SIGHUP)
    log = wait_log(sv, r"SIGHUP: .*keeping the 3 tenant\(s\) loaded before")
    assert "not a SHA-256 hex digest" in log
    assert list(sv.client(KEYS["gamma"]).files.list()) == []
    with pytest.raises(openai.BadRequestError) as exc:
        create(alpha, fa)  # 8 queued + 8 > 10
    assert "its quota is 10" in exc.value.message
    assert sv.proc.poll() is None and alpha.batches.retrieve(ok.id).status in ("validating", "in_progress")
    sv.stop()
    for p in [sv.log_path, *(sv.state / "logs").rglob("*")]:
        if p.is_file():
            text = p.read_text(errors="replace")
            assert all(k not in text and sha(k) not in text for k in KEYS.values()), p  # never the file's content


def test_fleet_shows_every_tenants_share_and_only_the_keys_own_batches_and_metrics_have_one_series_per_tenant(
        tmp_path: Path, redis_url: str) -> None:
    env = serve_env(tmp_path, redis_url, BATCHFLEET_API_KEYS=KEYS["gamma"])
    sv = Serve(tmp_path, redis_url, "--tenants", str(two_tenants(tmp_path / "tenants.toml")), env=env).start()
    alpha, beta = sv.client(KEYS["alpha"]), sv.client(KEYS["beta"])
    fa = upload(alpha, tmp_path / "a.jsonl", batch_lines(6))
    a1, a2 = create(alpha, fa), create(alpha, fa, priority="low")
    a3 = create(alpha, fa)
    b1 = create(beta, upload(beta, tmp_path / "b.jsonl", batch_lines(4)), priority="high")
    for client, b in ((alpha, a3), (beta, b1)):
        wait_status(client, b.id, {"in_progress"})
    gamma_name = sha(KEYS["gamma"])[:8]
    deadline = time.monotonic() + 10
    while True:
        fleet = sv.http("GET", "/fleet", key=KEYS["alpha"]).json()
        rows = {t["name"]: t for t in fleet["tenants"]}
        if (rows.get("alpha", {}).get("queued"), rows.get("beta", {}).get("queued")) == (18, 4):
            break  # the book is at most a second old
        assert time.monotonic() < deadline, fleet
        time.sleep(0.2)
    assert fleet["object"] == "fleet" and sorted(rows) == sorted(["alpha", "beta", gamma_name])
    assert all(set(t) == {"name", "weight", "share", "tokens_per_s", "queued", "done"} for t in rows.values())
    assert (rows["alpha"]["weight"], rows["beta"]["weight"], rows["beta"]["queued"]) == (1.0, 3.0, 4)
    assert sv.http("GET", "/fleet").status_code == 401
    text = orjson.dumps(fleet).decode()
    assert all(k not in text and sha(k) not in text for k in KEYS.values())  # names only, never keys
    mine = {b["id"]: b for b in fleet["batches"]}
    assert sorted(mine) == sorted([a1.id, a2.id, a3.id])  # alpha's own batches only
    assert all(set(b) == {"id", "tenant", "priority", "queue_position", "eta", "expires_at", "late"}
               for b in mine.values())
    assert [(mine[b.id]["priority"], mine[b.id]["queue_position"]) for b in (a1, a2, a3)] == [
        ("normal", 0), ("low", 0), ("normal", 1)]
    assert all(b["eta"] is None and b["late"] is False for b in mine.values())  # nothing measured yet
    assert [b["id"] for b in sv.http("GET", "/fleet", key=KEYS["beta"]).json()["batches"]] == [b1.id]
    metrics = sv.url.removesuffix("/v1") + "/metrics"
    r = httpx.get(metrics, headers={"Authorization": f"Bearer {KEYS['beta']}"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    series = re.findall(r'^batchfleet_serve_tenant_queued_requests\{tenant="([^"]+)"\} (\S+)$', r.text, flags=re.M)
    assert dict(series) == {"alpha": "18.0", "beta": "4.0", gamma_name: "0.0"}
    assert httpx.get(metrics, timeout=30).status_code == 401
    promtool = shutil.which("promtool")
    if promtool:  # Debian: apt-get install prometheus
        lint = subprocess.run([promtool, "check", "metrics"], input=r.text, capture_output=True, text=True, timeout=60)
        assert lint.returncode == 0 and lint.stdout.strip() == "", lint.stdout + lint.stderr


@pytest.mark.slow
def test_a_batch_estimated_past_its_deadline_is_said_once_and_expires_under_fair_share(
        tmp_path: Path, redis_url: str) -> None:
    """Two tenants; the test plays a worker that answers about 4 requests a second: alpha's 80 requests
    cannot finish in its 20 s window. One warning line says so once its rate is measured; the batch
    expires with every request in one of its files; beta's small high batch, created later, completes
    first. (~25 s: the window must pass.)"""
    run = "late"
    queue = f"{run}.gpu0"
    env = serve_env(tmp_path, redis_url, BATCHFLEET_QUEUES=queue)
    sv = Serve(tmp_path, redis_url, "--tenants", str(two_tenants(tmp_path / "tenants.toml")), "--completion-window-s",
               "20", env=env, run=run).start()
    alpha, beta = sv.client(KEYS["alpha"]), sv.client(KEYS["beta"])
    slow = create(alpha, upload(alpha, tmp_path / "a.jsonl", batch_lines(80)))
    wait_status(alpha, slow.id, {"in_progress"})
    small = create(beta, upload(beta, tmp_path / "b.jsonl", batch_lines(4)), priority="high")
    wait_status(beta, small.id, {"in_progress"})
    answered: list[str] = []
    pattern = (rf"batch {slow.id}: estimated to finish at [\d-]+ [\d:]+, after its deadline [\d-]+ [\d:]+ "
               rf"\((\d+) requests left, tenant alpha at ([\d.]+) req/s\)")
    while alpha.batches.retrieve(slow.id).status == "in_progress":
        answered += [x.cid for x in work(redis_url, [queue], 1, run=run)]
        time.sleep(0.25)
        assert len(answered) < 200
    b = wait_status(alpha, slow.id, {"expired"})
    log = sv.log()
    warned = re.findall(pattern, log)
    assert len(warned) == 1, log  # once, as soon as it was known
    left, rate = int(warned[0][0]), float(warned[0][1])
    assert 0 < left <= 80 and 1.0 < rate < 8.0, warned
    assert b.request_counts is not None and b.request_counts.total == 80
    out = [orjson.loads(x) for x in alpha.files.content(b.output_file_id).content.splitlines()]  # type: ignore[arg-type]
    err = [orjson.loads(x) for x in alpha.files.content(b.error_file_id).content.splitlines()]  # type: ignore[arg-type]
    assert sorted(x["custom_id"] for x in out + err) == sorted(f"req-{i}" for i in range(80))
    assert {x["error"]["code"] for x in err} == {"batch_expired"} and len(out) == b.request_counts.completed > 0
    # beta's high batch went to the front as room opened, ahead of alpha's prompts fed before it (the
    # queue held 16 of them): done in time
    done = wait_status(beta, small.id, {"completed"})
    assert done.request_counts is not None and done.request_counts.completed == 4
    assert done.completed_at is not None and done.completed_at < b.expires_at
    assert max(i for i, c in enumerate(answered) if c.startswith(small.id)) < 12, answered
    assert os.path.exists(sv.state / f"{run}.sqlite")


def test_the_fleet_counts_each_batchs_done_requests_once_however_fast_it_ends(tmp_path: Path, r: redis.Redis) -> None:
    """A batch that ends between two passes, or is made and ended between them, is counted once."""
    registry = Registry(tmp_path / "state", "book")
    book = FleetBook(r, Keys("book"), registry)
    keys = ApiKeys([])

    def batch(status: BatchStatus, done: int, tenant: str = "t1") -> BatchRecord:
        b = BatchRecord(id=new_batch_id(), owner="", input_file_id="file-x", endpoint="/v1/completions",
                        completion_window="24h", created_at=1, expires_at=2, status=status, total=10, completed=done,
                        tenant=tenant)
        registry.put_batch(b)
        return b

    def done() -> dict[str, int]:
        assert book.update(keys, force=True)
        return {t.name: t.done for t in book.tenants}

    running = batch(BatchStatus.IN_PROGRESS, 3)
    batch(BatchStatus.COMPLETED, 10, tenant="t2")
    assert done() == {"default": 0, "t1": 3, "t2": 10}
    registry.put_batch(replace(running, status=BatchStatus.COMPLETED, completed=10))  # ends between passes
    batch(BatchStatus.CANCELLED, 4)  # made and ended between passes
    assert done() == {"default": 0, "t1": 14, "t2": 10}
    assert done() == {"default": 0, "t1": 14, "t2": 10}  # and never again
    registry.close()
