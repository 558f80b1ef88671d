"""Issue 8 on real parts: secrets never written in clear, a Redis ACL user per role, and TLS.

Each test starts its own redis-server (with a password, an ACL file, or TLS), a small fleet of real
`rq worker` processes with simulated SGLang servers, the head, and the producer/supervisor CLIs, and
kills everything it started when it ends.
"""

from __future__ import annotations

import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis

from batchfleet.records import WorkerState

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


def anonymous(port: int, **kw: object) -> redis.Redis:
    """A client that gives up at once (redis-py retries a refused login with backoff, seconds each)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(port=port, retry=Retry(NoBackoff(), 0), **kw)  # type: ignore[arg-type]


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
    fleet.wait_for(lambda: len(fleet.statuses()) == 2 and all(s.state is WorkerState.SERVING for s in fleet.statuses()),
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
    pid_files = {p.name: mode(p) for p in (tmp_path / "state" / "logs").glob("sglang-gpu*.pid")}
    assert pid_files == {"sglang-gpu0.pid": 0o600, "sglang-gpu1.pid": 0o600}  # while the servers run
    assert fleet.stop_all() == {0: 0, 1: 0}
    assert not list((tmp_path / "state" / "logs").glob("sglang-gpu*.pid"))  # gone with their servers

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
    assert mode(state) == 0o700 and mode(state / "logs") == 0o700 and mode(tmp_path / "gpus") == 0o700
    private = [state / "secret.sqlite", *(state / "logs").glob("sglang-gpu*.log"), *tmp_path.glob("sim-gpu*.json"),
               *(p for p in state.glob("secret.sqlite-*"))]
    assert len(private) >= 5
    for path in private:
        assert mode(path) == 0o600, f"{path} has mode {oct(mode(path))}"


# --- 8.3: one Redis ACL user per role -------------------------------------------------------------------


def start_acl_redis(tmp_path: Path, cleanup: list) -> tuple[RedisServer, dict[str, str]]:
    """A redis-server that knows only the users `python -m batchfleet.acl` generated (default user off)."""
    pw_file, acl = tmp_path / "acl" / "passwords", tmp_path / "acl" / "users.acl"
    acl.parent.mkdir()
    done = subprocess.run([str(BIN / "python"), "-m", "batchfleet.acl", "--passwords", str(pw_file), "--out", str(acl)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert mode(pw_file) == 0o600 and mode(acl) == 0o600
    passwords = dict(line.split("=", 1) for line in pw_file.read_text().splitlines())
    assert not any(pw in acl.read_text() for pw in passwords.values())  # only hashes in the ACL file
    server = RedisServer(tmp_path / "acl", "--aclfile", str(acl), user="admin", password=passwords["admin"])
    server.start()
    cleanup.append(server)
    return server, passwords


def test_a_full_run_where_each_role_is_its_own_acl_user(tmp_path, cleanup):
    server, passwords = start_acl_redis(tmp_path, cleanup)

    def url(role: str) -> str:
        return f"redis://{role}:{passwords[role]}@127.0.0.1:{server.port}/0"

    admin = redis.Redis.from_url(url("admin"))
    with pytest.raises(redis.AuthenticationError):
        anonymous(server.port).ping()  # the default user is off

    fleet = Fleet(tmp_path, url("admin"), run="acl", prefix="acl.", gpus=2, env={"BATCHFLEET_SHUTDOWN_GRACE_S": "5"})
    cleanup.append(fleet)
    as_ = {role: {"REDIS_URL": url(role)} for role in passwords}
    rows = write_prompts(tmp_path / "prompts.jsonl", 30, max_tokens=24)

    def cli(role: str, *argv: str) -> str:
        done = run_cli(fleet, *argv, env=as_[role])
        assert done.returncode == 0, f"{role}: {argv} exited {done.returncode}: {done.stdout}\n{done.stderr}"
        return done.stdout

    cli("producer", "producer", "enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_head(env=as_["head"])
    for gpu in (0, 1):
        fleet.start_worker(gpu, env=as_["worker"])
    autopilot = subprocess.Popen([str(BIN / "supervisor"), "run", "--dry-run", "--window", "1", "--sample", "0.25"],
                                 env={**fleet.env, **as_["supervisor"]}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    fleet.procs.append(autopilot)  # type: ignore[arg-type]
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 120, "every prompt")
    fleet.wait_for(lambda: len(fleet.statuses()) == 2, 30, "both status records")
    fleet.wait_for(lambda: admin.xlen(fleet.k.history) >= 2, 30, "the autopilot's history samples")
    autopilot.terminate()
    said = autopilot.communicate(timeout=30)[0]
    assert autopilot.returncode == 0 and "NOPERM" not in said and "lost Redis" not in said, said

    # The supervisor changes one GPU's spec (its user may write the control hash); the worker follows.
    cli("supervisor", "supervisor", "restart", "--strategy", "default", "--mem-fraction-static", "0.8",
        "--canary", fleet.queue(0))
    fleet.wait_for(lambda: any(s.queue == fleet.queue(0) and s.generation == 1 and s.state is WorkerState.SERVING
                               for s in fleet.statuses()), 60, "gpu0 restarted on generation 1")
    snap = orjson.loads(cli("viewer", "supervisor", "status", "--json"))
    assert {w["queue"] for w in snap["workers"]} == {fleet.queue(0), fleet.queue(1)}
    cli("viewer", "supervisor", "watch", "--once", "--json")
    status = orjson.loads(cli("viewer", "producer", "status", "--json"))
    assert status["redis"].startswith("redis://viewer:***@")
    # `rq info` cleans RQ's registries as it counts (ZREMRANGEBYSCORE): not a viewer's command; the admin's.
    info = subprocess.run([str(BIN / "rq"), "info", "-u", url("admin"), "--raw", "--only-queues"],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0 and f"queue {fleet.queue(0)} 0" in info.stdout, info.stdout + info.stderr
    cli("producer", "producer", "export", "results.jsonl")
    assert fleet.stop_all() == {0: 0, 1: 0}
    exported = [orjson.loads(x) for x in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert sorted(x["custom_id"] for x in exported) == sorted(r["id"] for r in rows)
    assert all(x["error"] is None for x in exported)

    # Nothing the run needed was refused: Redis logged no denial but RQ's CLIENT LIST (it lists every
    # client; RQ then records its address as "unknown").
    denied = {(e[b"username"].decode(), e[b"object"].decode()) for e in
              (dict(zip(entry[::2], entry[1::2], strict=True)) if isinstance(entry, list) else entry
               for entry in admin.execute_command("ACL", "LOG"))}
    print("ACL LOG denials:", denied)
    assert denied <= {("worker", "client|list")}, denied

    # What each user may not do.
    worker = redis.Redis.from_url(url("worker"))
    spec = b'{"generation": 9, "strategy": "no_radix"}'
    for attempt in (lambda: worker.hset(fleet.k.control, "fleet", spec), lambda: worker.delete(fleet.k.control),
                    lambda: worker.hset(fleet.k.meta, "host", "evil"), lambda: worker.flushall(),
                    lambda: worker.keys("*"), lambda: worker.config_get("*"),
                    lambda: worker.publish("rq:pubsub:x", "y")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    viewer = redis.Redis.from_url(url("viewer"))
    assert viewer.hgetall(fleet.k.stats)  # it reads
    for attempt in (lambda: viewer.set("x", 1), lambda: viewer.hset(fleet.k.control, "fleet", spec),
                    lambda: viewer.lpush(fleet.k.queue(fleet.queue(0)), "bf-x"), lambda: viewer.delete(fleet.k.stats),
                    lambda: viewer.xadd(fleet.k.events, {"e": "x"}), lambda: viewer.hincrby(fleet.k.stats, "x", 1),
                    lambda: viewer.publish("rq:pubsub:x", "y"), lambda: viewer.eval("return 1", 0)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    supervisor = redis.Redis.from_url(url("supervisor"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        supervisor.lpush(fleet.k.queue(fleet.queue(0)), "bf-x")  # it steers the fleet; it does not feed it
    assert admin.llen(fleet.k.queue(fleet.queue(0))) == 0 and admin.exists("x") == 0
    assert orjson.loads(admin.hget(fleet.k.control, "queue:" + fleet.queue(0)))["generation"] == 1


def test_the_shipped_acl_file_loads_and_locks_everyone_out_until_edited(tmp_path, cleanup):
    shipped = Path(__file__).resolve().parents[1] / "docs" / "batchfleet.acl"
    acl = tmp_path / "users.acl"
    # The operator's edit the docs describe: one user turned on with a password.
    acl.write_text(shipped.read_text().replace("user viewer reset off nopass", "user viewer reset on >viewer-pw"))
    server = RedisServer(tmp_path, "--aclfile", str(acl), user="viewer", password="viewer-pw")
    server.start()  # it loads (a syntax error aborts redis-server) and the viewer can log in
    cleanup.append(server)
    with pytest.raises(redis.AuthenticationError):
        anonymous(server.port).ping()
    for role in ("producer", "head", "worker", "supervisor", "admin"):
        with pytest.raises(redis.AuthenticationError):
            anonymous(server.port, username=role, password="").ping()
    viewer = redis.Redis.from_url(server.url)
    assert viewer.acl_whoami() == "viewer"
    with pytest.raises(redis.exceptions.NoPermissionError):
        viewer.set("x", 1)


# --- 8.4: TLS for real ------------------------------------------------------------------------------------


def make_ca_and_server_cert(d: Path, name: str = "ca") -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate it signed, for 127.0.0.1/localhost: (ca, cert, key)."""
    ca_key, ca, key, csr, cert, ext = (d / f"{name}.key", d / f"{name}.pem", d / f"{name}-server.key",
                                       d / f"{name}-server.csr", d / f"{name}-server.pem", d / f"{name}-ext.cnf")
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for argv in (["req", "-x509", *ec, "-days", "2", "-subj", f"/CN=batchfleet test {name}", "-keyout", ca_key,
                  "-out", ca],
                 ["req", *ec, "-subj", "/CN=localhost", "-keyout", key, "-out", csr],
                 ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
                  "-extfile", ext, "-out", cert]):
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True, timeout=60)
    return ca, cert, key


class TLSRedisServer(RedisServer):
    """redis-server listening on TLS only (`--port 0 --tls-port N`), a password required."""

    def __init__(self, workdir: Path, *, ca: Path, cert: Path, key: Path, password: str) -> None:
        super().__init__(workdir, "--port", "0", password=password)
        self.extra_args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                           "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                           "--requirepass", password]
        self.ca = ca

    @property
    def url(self) -> str:
        return f"rediss://:{self.password}@127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca}"


def tls_support() -> str | None:
    """Why TLS cannot be tested here, or None."""
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("openssl") is None:
        return "redis-server or openssl is not installed"
    # A build with TLS fails on the missing certificate; one without fails on the directive itself.
    probe = subprocess.run([exe, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent", "--save", ""],
                           capture_output=True, text=True, timeout=60)
    out = probe.stdout + probe.stderr
    if "Failed to configure TLS" not in out:
        return f"this redis-server does not support TLS (--tls-port): {out.strip().splitlines()[-1:]}"
    return None


def test_a_fleet_over_tls_with_a_throwaway_ca(tmp_path, cleanup):
    reason = tls_support()
    if reason:
        pytest.skip(reason)
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, cert, key = make_ca_and_server_cert(certs)
    password = "pw-tls-" + secrets.token_hex(6)
    server = TLSRedisServer(tmp_path / "certs", ca=ca, cert=cert, key=key, password=password)
    server.start()  # pings over TLS, verifying the server's certificate against the CA
    cleanup.append(server)

    # TLS only, and verified: plain TCP gets no answer, another CA's client refuses the server.
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        anonymous(server.port, password=password, socket_timeout=5).ping()
    other_ca, _, _ = make_ca_and_server_cert(certs, "other")
    with pytest.raises(redis.ConnectionError, match=r"(?i)certificate verify failed"):
        redis.Redis.from_url(server.url.replace(str(ca), str(other_ca)), retry=None).ping()

    fleet = Fleet(tmp_path, server.url, run="tls", prefix="tls.", gpus=2, env={"BATCHFLEET_SHUTDOWN_GRACE_S": "5"})
    cleanup.append(fleet)
    rows = write_prompts(tmp_path / "prompts.jsonl", 30, max_tokens=24)
    fleet.producer("enqueue", "prompts.jsonl", "--queues", fleet.queues)
    fleet.start_head()
    for gpu in (0, 1):
        fleet.start_worker(gpu)
    fleet.wait_for(lambda: fleet.finished() >= len(rows), 120, "every prompt over TLS")
    status = orjson.loads(fleet.producer("status", "--json").stdout)
    assert status["redis"] == f"rediss://:***@127.0.0.1:{server.port}/0?ssl_ca_certs={ca}"
    fleet.producer("export", "results.jsonl")
    assert fleet.stop_all() == {0: 0, 1: 0}
    exported = [orjson.loads(x) for x in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert sorted(x["custom_id"] for x in exported) == sorted(r["id"] for r in rows)
    assert all(x["error"] is None for x in exported)
    clients = redis.Redis.from_url(server.url).info("stats")
    assert clients["total_connections_received"] >= 5  # the workers, the head and the CLIs all came over TLS
