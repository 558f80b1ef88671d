"""Test harness: real hosts on one machine, each its own Linux network namespace.

    ┌──────────── root namespace = the head host ─────────────┐
    │ redis-server on 127.0.0.1 and 10.X.Y.1 (bridge bfb<tag>) │   producer, collector, supervisor
    └───────┬───────────────────────────────┬──────────────────┘
        veth bfv<tag>1                  veth bfv<tag>2             (root ends: link down = partition)
    ┌───────┴────────────┐          ┌───────┴────────────┐
    │ netns "hosta"      │          │ netns "hostb"      │   eth0 10.X.Y.11 / .12, lo up,
    │ hostname hosta     │          │ hostname hostb     │   own UTS namespace (hostname),
    │ rq worker hosta.gpu0 ...      │ rq worker hostb.gpu0 ...  own state dir and simulator GPU dir,
    │ sim on 127.0.0.1:30000 + N    │ sim on 127.0.0.1:30000 + N  the same GPU indexes and ports
    └────────────────────┘          └────────────────────┘

`Lan(tmp, run=...)` makes the bridge and the Redis, `lan.add_host("hosta")` a host; every process a
host starts runs in its namespace (`ip netns exec`) under its own hostname (`unshare --uts`). The
producer, collector and supervisor run on the head (the root namespace) and reach Redis on the
bridge address like every other host. Names carry a random tag, so a leftover of a crashed run
cannot collide; a registry in /tmp records what each test process made, and the next `Lan` deletes
what a dead test process left behind. `lan.close()` (the fixture's finalizer) stops every process,
then deletes the namespaces, veths and the bridge, even when the test failed.

Tests skip with the reason (`require_namespaces()`) where namespaces cannot be made: not root, no
`ip`/`unshare`, or the kernel refuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchfleet.keys import Keys
from batchfleet.procs import pid_alive
from batchfleet.records import Event, RecordError, WorkerState, WorkerStatus

from .conftest import RedisServer
from .fleet import label

__all__ = ["BIN", "Host", "Lan", "namespaces_unavailable", "require_namespaces"]

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
SIM_BIN = ROOT / "sglang_sim" / "bin"
CLOCK_SKEW_DIR = Path(__file__).resolve().parent / "clockskew"  # a sitecustomize that offsets time.time()
REGISTRY = Path(tempfile.gettempdir()) / "batchfleet-hosts"
NS_PREFIX = "bfh-"

_probe: list[str | None] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can). Probed once per session."""
    if _probe:
        return _probe[0]
    reason = None
    if os.geteuid() != 0:
        reason = "needs root to create network namespaces (ip netns add)"
    elif not shutil.which("ip") or not shutil.which("unshare"):
        reason = "needs `ip` (iproute2) and `unshare` (util-linux)"
    else:
        name = f"{NS_PREFIX}probe-{os.getpid()}"
        made = _ip("netns", "add", name, check=False)
        if made.returncode:
            reason = f"the kernel refuses a network namespace: {made.stderr.strip()}"
        else:
            bridge = f"bfq{secrets.token_hex(3)}"
            br = _ip("link", "add", bridge, "type", "bridge", check=False)
            if br.returncode:
                reason = f"cannot make a bridge: {br.stderr.strip()}"
            _ip("link", "del", bridge, check=False)
            _ip("netns", "del", name, check=False)
    _probe.append(reason)
    return reason


def require_namespaces() -> None:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"multi-host harness unavailable: {reason}")


def _ns_pids(ns: str) -> list[int]:
    done = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _remove(record: dict[str, Any]) -> None:
    """Delete what one Lan made: processes in its namespaces first, then links, namespaces, bridge."""
    for ns in record.get("namespaces", []):
        for pid in _ns_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for link in record.get("links", []):
        _ip("link", "del", link, check=False)
    for ns in record.get("namespaces", []):
        _ip("netns", "del", ns, check=False)
    if record.get("bridge"):
        _ip("link", "del", record["bridge"], check=False)


def sweep_leftovers() -> None:
    """Remove what test processes that died without their finalizers left behind."""
    if not REGISTRY.is_dir():
        return
    for path in REGISTRY.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not pid_alive(int(record.get("pid", 0))):
            _remove(record)
            path.unlink(missing_ok=True)


def _free_subnet() -> str:
    """A 10.X.Y.0/24 no interface of this machine uses, nor another live test LAN has picked."""
    used = _ip("-o", "-4", "addr").stdout
    for path in REGISTRY.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            used += f" {json.loads(path.read_text()).get('subnet', '')}."
    for _ in range(200):
        prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 for the test LAN")


class Lan:
    """The head host (root namespace): a bridge, a redis-server bound to it, and the hosts on it."""

    def __init__(self, tmp: Path, *, run: str = "t", env: dict[str, str] | None = None) -> None:
        require_namespaces()
        sweep_leftovers()
        self.tmp = tmp
        self.run = run
        self.k = Keys(run)
        self.tag = secrets.token_hex(3)
        self.bridge = f"bfb{self.tag}"
        REGISTRY.mkdir(exist_ok=True)
        self.prefix = _free_subnet()
        self.address = f"{self.prefix}.1"
        self.hosts: dict[str, Host] = {}
        self.head: dict[str, subprocess.Popen[bytes]] = {}
        self._record: dict[str, Any] = {"pid": os.getpid(), "bridge": self.bridge, "subnet": self.prefix,
                                        "namespaces": [], "links": []}
        self._registry = REGISTRY / f"{self.tag}.json"
        self._save()
        self.redis_server: RedisServer | None = None
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            (tmp / "redis").mkdir(parents=True, exist_ok=True)
            # A Redis other hosts reach needs a password (Redis refuses them without one: protected mode).
            self.redis_server = RedisServer(tmp / "redis", bind=(self.address, "127.0.0.1"),
                                            password=secrets.token_hex(12))
            self.redis_server.start()
        except BaseException:
            self.close()
            raise
        self.redis_url = self.redis_server.url  # redis://:pw@10.X.Y.1:PORT/0: what every host is given
        self.r = redis.Redis.from_url(self.redis_url)
        inherited = {k: v for k, v in os.environ.items()  # the tester's own fleet settings stay out
                     if not k.startswith(("BATCHFLEET_", "SGLANG_SIM_")) and k != "REDIS_URL"}
        self.env = {  # what every process of the fleet gets (hosts add their own dirs); default ports
            **inherited,
            "PATH": f"{BIN}:{SIM_BIN}:{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": self.redis_url,
            "RQ_WORKER_CLASS": "worker.GPUWorker",
            "BATCHFLEET_RUN": run,
            "BATCHFLEET_STATE_DIR": str(tmp / "head" / "state"),
            "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
            "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid",
            "BATCHFLEET_STARTUP_TIMEOUT_S": "60",
            "BATCHFLEET_STATUS_INTERVAL_S": "0.5",
            "SGLANG_SIM_TIME_SCALE": "20",
            "SGLANG_SIM_STARTUP_S": "0.2",
            **(env or {}),
        }
        (tmp / "head").mkdir(exist_ok=True)

    def _save(self) -> None:
        self._registry.write_text(json.dumps(self._record))

    # --- hosts -------------------------------------------------------------------------------------
    def add_host(self, name: str, *, env: dict[str, str] | None = None, clock_skew_s: float = 0.0) -> Host:
        """A new host on the LAN (its namespace, veth, address, hostname, dirs); it starts nothing."""
        if name in self.hosts:
            raise ValueError(f"host {name} exists")
        host = Host(self, name, index=len(self.hosts) + 1, env=env, clock_skew_s=clock_skew_s)
        self.hosts[name] = host
        return host

    def _track(self, *, namespace: str = "", link: str = "") -> None:
        if namespace:
            self._record["namespaces"].append(namespace)
        if link:
            self._record["links"].append(link)
        self._save()

    # --- the head's processes (root namespace) -----------------------------------------------------
    def producer(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(BIN / "producer"), *args], env=self.env, capture_output=True, text=True,
                              cwd=self.tmp / "head", timeout=timeout_s)
        if check and done.returncode:
            raise AssertionError(f"producer {args} exited {done.returncode}: {done.stdout}\n{done.stderr}")
        return done

    def start_head(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A long-running head process (`producer collect --follow`, `supervisor run`), logged to head/<name>.log."""
        log = (self.tmp / "head" / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                                cwd=self.tmp / "head")
        log.close()
        self.head[name] = proc
        return proc

    def start_collector(self) -> subprocess.Popen[bytes]:
        return self.start_head("collector", [str(BIN / "producer"), "head", "--interval", "0.5"])

    def start_supervisor(self, *args: str) -> subprocess.Popen[bytes]:
        return self.start_head("supervisor", [str(BIN / "supervisor"), "run", *args])

    def head_log(self, name: str) -> str:
        path = self.tmp / "head" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # --- observations (from the head, through Redis) -------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {k.decode(): int(float(v)) for k, v in self.r.hgetall(self.k.stats).items()}

    def finished(self) -> int:
        s = self.stats()
        return s.get("succeeded", 0) + s.get("failed", 0)

    def statuses(self) -> list[WorkerStatus]:
        out = []
        for name in self.r.smembers(self.k.workers):
            raw = self.r.get(self.k.status(name.decode()))
            if raw:
                try:
                    out.append(WorkerStatus.from_json(raw))
                except RecordError:
                    continue
        return out

    def serving(self) -> dict[str, WorkerStatus]:
        """queue -> status of the workers serving now."""
        return {s.queue: s for s in self.statuses() if s.state is WorkerState.SERVING}

    def events(self) -> list[Event]:
        return [Event.from_json(f[b"e"]) for _, f in self.r.xrange(self.k.events)]

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Poll `cond` until true; returns the seconds it took. On timeout, fails with every log's tail."""
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; stats={self.stats()}\n"
                                     + self.logs_tail())
            for host in self.hosts.values():
                host.check_workers()
            time.sleep(0.2)
        return time.monotonic() - start

    def logs_tail(self, n: int = 2500) -> str:
        parts = [f"--- head {name}\n{self.head_log(name)[-n:]}" for name in self.head]
        for host in self.hosts.values():
            parts += [f"--- {host.name} {q}\n{host.worker_log(q)[-n:]}" for q in host.workers]
        return "\n".join(parts)

    # --- teardown ------------------------------------------------------------------------------------
    def stop_head(self, timeout_s: float = 20) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for p in self.head.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.head.items():
            try:
                codes[name] = p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[name] = None
        return codes

    def close(self) -> None:
        """Stop every process (head and hosts), delete namespaces, veths, bridge; stop Redis."""
        try:
            self.stop_head()
            for host in self.hosts.values():
                host.stop_all(timeout_s=10)
        finally:
            _remove(self._record)
            if self.redis_server is not None:
                self.redis_server.stop()
            self._registry.unlink(missing_ok=True)


class Host:
    """One simulated machine: network namespace + veth to the LAN + hostname + state and GPU dirs."""

    def __init__(self, lan: Lan, name: str, *, index: int, env: dict[str, str] | None, clock_skew_s: float) -> None:
        self.lan = lan
        self.name = name
        self.ns = f"{NS_PREFIX}{lan.tag}-{name}"
        self.link = f"bfv{lan.tag}{index}"  # root end, a port of the bridge
        peer = f"bfp{lan.tag}{index}"  # host end, renamed eth0 inside the namespace
        self.address = f"{lan.prefix}.{10 + index}"
        self.dir = lan.tmp / name
        self.dir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.ns)
        lan._track(namespace=self.ns)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", peer)
        lan._track(link=self.link)
        _ip("link", "set", peer, "netns", self.ns)
        _ip("link", "set", self.link, "master", lan.bridge)
        _ip("link", "set", self.link, "up")
        _ip("-n", self.ns, "link", "set", peer, "name", "eth0")
        _ip("-n", self.ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")  # servers bind 127.0.0.1 inside the host
        self.env = {
            **lan.env,
            "BATCHFLEET_STATE_DIR": str(self.dir / "state"),
            "SGLANG_SIM_GPU_DIR": str(self.dir / "gpus"),
            **(env or {}),
        }
        if clock_skew_s:
            self.env["BF_TEST_CLOCK_SKEW_S"] = str(clock_skew_s)
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLOCK_SKEW_DIR), self.env.get("PYTHONPATH")]))
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.procs: list[subprocess.Popen[bytes]] = []

    # --- processes -----------------------------------------------------------------------------------
    def argv(self, *cmd: str) -> list[str]:
        """`cmd` run inside this host: its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *cmd]

    def popen(self, *cmd: str, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
              inherit: bool = True, **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start `cmd` in this host; its environment is the host's plus `env` (only `env` without `inherit`)."""
        with log.open("ab") as fh:
            proc = subprocess.Popen(self.argv(*cmd), env={**(self.env if inherit else {}), **(env or {})},
                                    stdout=fh, stderr=subprocess.STDOUT, cwd=cwd or self.dir, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, *cmd: str, timeout_s: float = 60, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run `cmd` in this host to completion (with `env` as its whole environment, when given)."""
        return subprocess.run(self.argv(*cmd), env=self.env if env is None else env, capture_output=True, text=True,
                              cwd=cwd or self.dir, timeout=timeout_s)

    def queue(self, gpu: int | str) -> str:
        """`<host>.gpuN` for GPU N, `<host>.gpu0-1` for the group "gpu0-1" (one server on GPUs 0 and 1)."""
        return f"{self.name}.{label(gpu)}"

    def record_path(self, gpu: int | str) -> Path:
        return self.dir / f"sim-{label(gpu)}.json"

    def start_worker(self, gpu: int | str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`rq worker <host>.gpuN` (or `<host>.gpu0-1`) as a host's Procfile runs it (our worker class, its own
        simulator)."""
        q = self.queue(gpu)
        proc = self.popen(str(BIN / "rq"), "worker", q, *extra, log=self.dir / f"worker-{q}.log",
                          env={"SGLANG_SIM_RECORD": str(self.record_path(gpu)), **(env or {})})
        self.workers[q] = proc
        return proc

    def worker_log(self, queue: str) -> str:
        path = self.dir / f"worker-{queue}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def sim_record(self, gpu: int | str) -> dict[str, Any]:
        return json.loads(self.record_path(gpu).read_text())

    def served(self, gpu: int | str) -> int:
        """Generation requests the host's simulator for `gpu` received (0 before it started)."""
        if not self.record_path(gpu).exists():
            return 0
        return sum(self.sim_record(gpu)["requests_by_endpoint"].values())

    def check_workers(self) -> None:
        for q, p in self.workers.items():
            if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                raise AssertionError(f"{self.name} worker {q} exited {p.returncode}:\n{self.worker_log(q)[-3000:]}")

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        return _ns_pids(self.ns)

    # --- faults --------------------------------------------------------------------------------------
    def link_down(self, *, silent: bool = False) -> None:
        """Partition: the LAN drops this host's packets (the root end of its veth goes down). Both ends
        first learn each other's address (ARP); `silent` pins those entries, so nothing says "no route
        to host" and packets just vanish, as behind a failed switch further away."""
        if silent:
            mac_root = Path(f"/sys/class/net/{self.lan.bridge}/address").read_text().strip()
            mac_host = self.run("cat", "/sys/class/net/eth0/address").stdout.strip()
            pin = ("nud", "permanent")
            _ip("-n", self.ns, "neigh", "replace", self.lan.address, "lladdr", mac_root, "dev", "eth0", *pin)
            _ip("neigh", "replace", self.address, "lladdr", mac_host, "dev", self.lan.bridge, *pin)
        _ip("link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up")

    def kill_all(self) -> int:
        """The host is lost: SIGKILL every process in its namespace. Returns how many were killed."""
        killed = 0
        for _ in range(5):  # a process may fork while we kill
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        return killed

    def stop_all(self, timeout_s: float = 30) -> dict[str, int | None]:
        """SIGTERM every process this host started, wait, then SIGKILL what is left in the namespace."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.kill_all()
        return {q: p.returncode for q, p in self.workers.items()}
