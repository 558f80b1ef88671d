"""Issue 8 on real parts: secrets never written in clear, a Redis ACL user per role, and TLS.

Each test starts its own redis-server (with a password, an ACL file, or TLS), a small fleet of real
`rq worker` processes with simulated SGLang servers, the head, and the producer/supervisor CLIs, and
kills everything it started when it ends.
"""

from __future__ import annotations

import secrets
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from .conftest import RedisServer
from .fleet import BIN, Fleet, write_prompts

pytestmark = pytest.mark.slow


@pytest.fixture
def cleanup() -> Iterator[list]:
    """Things to stop when the test ends, pass or fail (fleets and redis-servers)."""
    made: list = []
    yield made
    for thing in reversed(made):
        if isinstance(thing, Fleet):
            thing.kill_all()
        else:
            thing.stop()


def dump_redis(r: redis.Redis) -> bytes:
    """Every key and every value in Redis, whatever its type, as one blob to search."""
    out: list[bytes] = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key)
        out.append(key)
        if kind == b"string":
            out.append(r.get(key) or b"")
        elif kind == b"hash":
            out += [b for kv in r.hgetall(key).items() for b in kv]
        elif kind == b"list":
            out += r.lrange(key, 0, -1)
        elif kind == b"set":
            out += list(r.smembers(key))
        elif kind == b"zset":
            out += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        elif kind == b"stream":
            out += [b for _, fields in r.xrange(key) for kv in fields.items() for b in kv]
        else:
            raise AssertionError(f"unexpected type {kind!r} of {key!r}")
    return b"\n".join(out)


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def run_cli(fleet: Fleet, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], env={**fleet.env, **(env or {})}, capture_output=True,
                          text=True, cwd=fleet.tmp, timeout=120)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fleet_with_an_api_key_and_a_redis_password_writes_neither_anywhere(tmp_path, cleanup):
    api_key = "sk-apikey-" + secrets.token_hex(8)
    password = "pw-redis-" + secrets.token_hex(8)
    server = RedisServer(tmp_path / "redis-data", password=password)
    (tmp_path / "redis-data").mkdir()
    server.start()
    cleanup.append(server)
    host_port = f"127.0.0.1:{server.port}"
    as_query = f"redis://{host_port}/0?password={password}"  # the form that leaked before
    as_userinfo = f"redis://:{password}@{host_port}/0"

    fleet = Fleet(tmp_path, as_query, run="secret", prefix="secret.", gpus=2,
                  env={"BATCHFLEET_SERVER_API_KEY": api_key, "BATCHFLEET_SHUTDOWN_GRACE_S": "5"})
    cleanup.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 24, max_tokens=24)
    outputs: list[str] = []

    def cli(*argv: str, env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)) -> str:
        done = run_cli(fleet, *argv, env=env)
        outputs.append(done.stdout + done.stderr)
        assert done.returncode in ok, f"{argv} exited {done.returncode}: {done.stdout}\n{done.stderr}"
        return done.stdout

    cli("producer", "enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_head()
    for gpu in (0, 1):
        fleet.start_worker(gpu)
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 120, "every prompt")
    fleet.wait_for(lambda: len(fleet.statuses()) == 2 and all(s.state == "serving" for s in fleet.statuses()),
                   30, "both workers serving")

    status = orjson.loads(cli("producer", "status", "--json", env={"REDIS_URL": as_userinfo}))
    assert status["redis"] == f"redis://:***@{host_port}/0"
    cli("producer", "status")
    snap = orjson.loads(cli("supervisor", "status", "--json"))
    flags = [w["server_flags"] for w in snap["workers"]]
    assert len(flags) == 2 and all(f[f.index("--api-key") + 1] == "***" for f in flags)  # set, and hidden
    cli("supervisor", "watch", "--once", "--json", env={"REDIS_URL": as_userinfo})
    cli("supervisor", "status")
    cli("producer", "export", "results.jsonl")
    # Error messages: a Redis that does not answer, named with the real password in both forms.
    for url in (f"redis://:{password}@127.0.0.1:1/0", f"redis://127.0.0.1:1/0?password={password}"):
        cli("producer", "--redis-url", url, "--state-dir", str(tmp_path / "state"), "collect", ok=(2,))
        cli("supervisor", "status", "--json", env={"REDIS_URL": url}, ok=(2,))
    assert fleet.stop_all() == {0: 0, 1: 0}

    exported = [orjson.loads(x) for x in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert sorted(x["custom_id"] for x in exported) == sorted(r["id"] for r in rows)
    assert all(x["response"]["status_code"] == 200 for x in exported)  # the key was sent: the server took it

    # Positive controls: the secrets were where they would leak, and were hidden there.
    state = tmp_path / "state"
    server_log = (state / "logs" / "sglang-gpu0.log").read_text()
    assert "api_key='***'" in server_log  # the server printed its arguments; the worker scrubbed them
    assert "--api-key '***'" in server_log  # the launch line (shell-quoted)
    assert "--api-key '***'" in fleet.worker_log(0)

    # Nothing anywhere holds either secret: every file of the test (state dir, logs, the simulator's
    # records, the export), every Redis value, every command's output.
    r = redis.Redis.from_url(as_userinfo)
    blobs = {str(p): data for p, data in files_under(tmp_path).items()}
    blobs["redis"] = dump_redis(r)
    blobs.update({f"output {i}": text.encode() for i, text in enumerate(outputs)})
    for name, blob in blobs.items():
        for secret in (api_key, password):
            assert secret.encode() not in blob, f"{secret} in clear in {name}"
    assert any(b"sglang-gpu1.log" in n.encode() for n in blobs)  # the search did cover the server logs

    # Modes: what batchfleet creates is private to its user.
    assert mode(state) == 0o700 and mode(state / "logs") == 0o700
    private = [state / "secret.sqlite", *(state / "logs").glob("sglang-gpu*.log"),
               *(state / "logs").glob("sglang-gpu*.pid"), *tmp_path.glob("sim-gpu*.json"),
               *(p for p in state.glob("secret.sqlite-*"))]
    assert len(private) >= 6
    for path in private:
        assert mode(path) == 0o600, f"{path} has mode {oct(mode(path))}"
