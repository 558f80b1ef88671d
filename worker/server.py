"""One SGLang server subprocess, owned for its whole life: argv, start, readiness, log, capacity,
health, and an idempotent stop (terminate -> wait -> kill)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

import orjson

from batchfleet import sglang
from batchfleet.config import Config, group_label
from batchfleet.errors import ServerDied, ServerStartError
from batchfleet.procs import pid_alive
from batchfleet.records import ServerFacts, ServerSpec
from batchfleet.redact import Scrubber, private_dir, private_file, redact_argv

from .facts import read_facts
from .flags import ServerCLI, build_argv, read_server_cli
from .startfail import fatal_line, port_holder, port_in_use_reason, start_failure_reason

__all__ = ["LogPump", "SGLangServer", "leftover_server", "process_identity", "write_pid_record"]

log = logging.getLogger("batchfleet.worker.server")

# Lines after which waiting longer cannot help: startfail.FATAL_MARKERS (matched case-insensitively).


class SGLangServer:
    """The SGLang server of one GPU, or of a group of GPUs (`gpus`: one tensor-parallel server on all of
    them; `gpu` is the first, which names it in log lines and gives its port)."""

    def __init__(self, config: Config, *, gpu: int, port: int, gpus: tuple[int, ...] = ()) -> None:
        self.config = config
        self.gpu = gpu
        self.gpus = tuple(gpus) or (gpu,)
        self.port = port
        self.url = f"http://{config.server_host}:{port}"
        label = group_label(self.gpus)
        self.log_path = config.logs / f"sglang-{label}.log"
        self.pid_path = config.logs / f"sglang-{label}.pid"
        self.proc: subprocess.Popen[bytes] | None = None
        self.argv: list[str] = []
        self.flags: list[str] = []  # argv without the command itself, for status records
        self.spec = ServerSpec()
        self.capacity = 0
        self.facts: ServerFacts | None = None  # what the running server said about itself at start-up
        self._cli: ServerCLI | None = None
        self._scrub = Scrubber.for_config(config)
        self._pump: LogPump | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self, spec: ServerSpec) -> int:
        """Start, wait for a real generation, discover the effective capacity, return it."""
        await self.stop()
        self.facts = None
        if self._cli is None:
            self._cli = await asyncio.to_thread(read_server_cli, shlex.split(self.config.sglang_cmd))
        self.spec = spec
        self.argv = build_argv(self.config, self._cli, port=self.port, strategy=spec.strategy,
                               mem_fraction_static=spec.mem_fraction_static,
                               max_running_requests=spec.max_running_requests, gpus=self.gpus)
        # The command line may hold the API key: everything written about it is redacted.
        self.flags = redact_argv(self.argv[len(shlex.split(self.config.sglang_cmd)):])
        shown = shlex.join(redact_argv(self.argv))
        private_dir(self.config.state_dir)
        private_dir(self.log_path.parent)
        await self.clear_leftover()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, self.gpus)))
        logf = private_file(self.log_path, "ab")
        try:
            with contextlib.suppress(OSError):  # a full disk: the server starts all the same (its log pump says so)
                logf.write(f"\n===== batchfleet: starting {shown} =====\n".encode())
                logf.flush()
            self._log_offset = os.lseek(logf.fileno(), 0, os.SEEK_END)
            # Own session: a stop signals the whole group (SGLang forks scheduler/detokenizer processes).
            # Its output comes through a pipe and is written with every secret scrubbed: SGLang prints
            # its own arguments (`server_args=ServerArgs(... api_key=...)`) at start-up.
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except BaseException:
            logf.close()
            raise
        self._pump = LogPump(self.proc, logf, self._scrub, name=f"gpu{self.gpu}-server-log")
        try:
            write_pid_record(self.pid_path, self.proc.pid)
        except OSError as exc:  # a full disk: serve all the same; a leftover of this server is then not recognised
            log.warning("gpu%d: cannot write the server's pid file %s: %s", self.gpu, self.pid_path, exc)
        log.info("gpu%d: started server pid %d: %s", self.gpu, self.proc.pid, shown)
        await self._wait_ready()
        self.capacity = await self._discover_capacity()
        log.info("gpu%d: server ready at %s, effective max running requests = %d", self.gpu, self.url, self.capacity)
        return self.capacity

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        async with self._client(timeout_s=30.0) as client:
            while True:
                self.check_alive(starting=True)
                if self._fatal_line():
                    await self.stop()
                    raise ServerStartError(self.start_failure(), log_tail=self.log_tail())
                try:
                    # Ready means a real generation went through, not merely an open port, and through
                    # OUR server: SGLang binds its port last, so whatever else holds it answers meanwhile.
                    status, _ = await client.get("/health_generate", timeout_s=30.0)
                    if status == 200 and self._port_is_ours():
                        return
                except (ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    await self.stop()
                    raise ServerStartError(f"server not ready after {self.config.startup_timeout_s:.0f} s",
                                           log_tail=self.log_tail())
                await asyncio.sleep(0.25)

    async def _discover_capacity(self) -> int:
        """The EFFECTIVE max running requests (never the requested top-level value)."""
        info: dict = {}
        async with self._client(timeout_s=30.0) as client:
            try:
                info = await sglang.get_server_info(client)
            except Exception as exc:  # the pool's errors, a status, a body: the log still says it
                log.warning("gpu%d: server_info unavailable (%s); reading the start-up log", self.gpu, exc)
            generates = await sglang.is_generation(client)
        log_text = self._log_since_start()
        capacity = sglang.effective_capacity(info) or sglang.capacity_from_log(log_text)
        if not capacity:
            await self.stop()
            raise ServerStartError("could not discover the effective max running requests "
                                   "(no internal_states[].effective_max_running_requests_per_dp, no start-up "
                                   "log line)", log_tail=self.log_tail())
        # Static facts for the supervisor (what caps the server and by how much memory); best effort.
        try:
            self.facts = replace(read_facts(info, log_text, effective=capacity), is_generation=generates)
        except Exception as exc:  # data from the server: a surprise here must not stop the start
            log.warning("gpu%d: could not read the server's start-up facts: %s", self.gpu, exc)
        return capacity

    async def stop(self, *, grace_s: float = 30.0) -> None:
        """Idempotent: SIGTERM the process group, wait, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            await asyncio.to_thread(self._drain_log, 1.0)
            return
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, grace_s)
            except subprocess.TimeoutExpired:
                log.warning("gpu%d: server did not stop in %.0f s; killing it", self.gpu, grace_s)
                _signal_group(proc, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 10)
        _signal_group(proc, signal.SIGKILL)  # leftovers of the group, if any
        _forget_pid_record(self.pid_path, proc.pid)
        await asyncio.to_thread(self._drain_log)
        log.info("gpu%d: server stopped (exit %s)", self.gpu, proc.returncode)

    async def clear_leftover(self) -> None:
        """A server left by an earlier worker on this GPU (one killed with -9 where the death signal
        could not be armed) holds the GPU and the port: stop it, but only when it is verifiably that
        server (same pid, same start time, same command line, same boot): a pid the kernel gave to
        another process since is never signalled. A port held by anything else is an error to report,
        not to wait out. (The host lock, `worker.lock`, already ensures no live worker owns it.) `start`
        calls it before each launch."""
        pid = leftover_server(self.pid_path)
        if pid is not None:
            log.warning("gpu%d: stopping server pid %d left by an earlier worker (verified: same start time "
                        "and command line)", self.gpu, pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            for _ in range(100):
                if not pid_alive(pid):
                    break
                await asyncio.sleep(0.1)
        with socket.socket() as sock:
            sock.settimeout(1.0)
            if sock.connect_ex((self.config.server_host, self.port)) == 0:
                reason = await asyncio.to_thread(port_in_use_reason, self.port)
                raise ServerStartError(f"{reason} (set BATCHFLEET_PORT_BASE to a free range)")

    def kill(self) -> None:
        """Hard stop, for a hung server."""
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGKILL)

    # --- health ----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self, *, starting: bool = False) -> None:
        if self.proc is None:
            raise ServerDied("no server process")
        code = self.proc.poll()
        if code is not None:
            cls = ServerStartError if starting else ServerDied
            _forget_pid_record(self.pid_path, self.proc.pid)  # reaped: its pid names nothing of ours now
            self.proc = None
            self._drain_log(timeout_s=2.0)  # its last lines (the reason it died) into the log first
            message = self.start_failure(code) if starting else f"server exited with status {code}"
            raise cls(message, log_tail=self.log_tail())

    async def check_health(self, client: sglang.SGLangClient, *, timeout_s: float = 30.0) -> None:
        """Raise ServerDied if the process is gone or cannot generate (a hung server keeps its port
        open and answers /ready, so health is judged by generation)."""
        self.check_alive()
        try:
            status, _ = await client.get("/health_generate", timeout_s=timeout_s)
        except (ConnectionError, TimeoutError) as exc:
            self.check_alive()
            raise ServerDied(f"/health_generate failed: {type(exc).__name__}") from exc
        if status != 200:
            raise ServerDied(f"/health_generate answered {status}")

    # --- logs ------------------------------------------------------------------------------------
    def _drain_log(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until the server's output is all in the log file, then close it."""
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.finish(timeout_s)

    def _log_since_start(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _fatal_line(self) -> str | None:
        return fatal_line(self._log_since_start())

    def start_failure(self, exit_status: int | None = None) -> str:
        """Why this start failed, in one line, from the server's log (see `startfail`)."""
        return start_failure_reason(self._log_since_start(), port=self.port, exit_status=exit_status)

    def _port_is_ours(self) -> bool:
        """Whoever listens on the port is our server's process group (or cannot be told: not ours to
        doubt). A foreign holder answers /health_generate while our server fails to bind."""
        proc = self.proc
        if proc is None:
            return False
        holder = port_holder(self.port)
        if holder is None or holder == proc.pid:
            return True
        try:
            return os.getpgid(holder) == proc.pid  # the server runs in a session (and group) of its own
        except OSError:
            return False

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self._log_since_start().splitlines()[-lines:])

    def _client(self, *, timeout_s: float) -> sglang.SGLangClient:
        return sglang.make_client(self.url, api_key=self.config.server_api_key, timeout_s=timeout_s,
                                  max_connections=4)


def process_identity(pid: int) -> dict[str, object] | None:
    """What identifies a process beyond its (reusable) pid: its start time in clock ticks since boot,
    the boot it belongs to, and its command line. None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = redact_argv([a.decode(errors="replace") for a in f.read().split(b"\0") if a])
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":
        return None
    return {"start_ticks": int(fields[19]), "boot_id": boot_id, "cmdline": cmdline}


def write_pid_record(path: Path, pid: int) -> None:
    """The pid and identity of a server, its command line redacted (the file must not hold the API key).
    Right after the launch the new process may still be inside exec (its command line reads empty, seen
    about once in 30 launches): an identity recorded then would never match it again, and the server,
    left behind by a killed worker, would later be taken for a stranger holding the port. So an empty
    command line is read again, for up to a second."""
    identity = process_identity(pid)
    for _ in range(50):
        if identity is None or identity["cmdline"]:
            break
        time.sleep(0.02)
        identity = process_identity(pid)
    record = {"pid": pid, **(identity or {})}
    tmp = path.with_suffix(".tmp")
    with private_file(tmp, "wb") as f:
        f.write(orjson.dumps(record))
    tmp.replace(path)


def _forget_pid_record(path: Path, pid: int) -> None:
    """Remove the pid file of a server that is gone (stopped and reaped), if it records that server."""
    try:
        record = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return
    if isinstance(record, dict) and record.get("pid") == pid:
        with contextlib.suppress(OSError):
            path.unlink()


def leftover_server(path: Path) -> int | None:
    """The pid in `path` if that process is alive AND is the very process recorded there; else None
    (with a warning when a live process holds the pid but is not ours)."""
    try:
        record = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int) or record["pid"] <= 1:
        return None  # an old bare-number pid file, or garbage: nothing can be verified, nothing is killed
    pid = record["pid"]
    now = process_identity(pid)
    if now is None:
        return None
    if any(record.get(k) != now[k] for k in ("start_ticks", "boot_id", "cmdline")):
        log.warning("pid %d from %s is alive but is not the server recorded there (pid reused): left alone", pid, path)
        return None
    return pid


class LogPump:
    """Copies a server's output into its log file line by line, every known secret scrubbed, on a
    thread of its own (the server never blocks on a full pipe while the event loop is busy)."""

    def __init__(self, proc: subprocess.Popen[bytes], out: IO[bytes], scrub: Scrubber, *, name: str) -> None:
        self.proc = proc
        self.out = out
        self.scrub = scrub
        self.name = name
        self.dropped = 0  # lines that could not be written (disk full)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pipe = self.proc.stdout
        assert pipe is not None
        try:
            with contextlib.suppress(OSError):
                self.out.flush()  # from here on, unbuffered writes: nothing is held back to fail again later
            fd = self.out.fileno()
            for line in iter(pipe.readline, b""):
                # The pipe is drained whatever becomes of the file: a server whose pipe fills blocks on
                # its next log line and stops serving. A line that cannot be written (a full disk) is
                # dropped and counted, with one warning.
                try:
                    _write_all(fd, self.scrub.bytes(line))
                except OSError as exc:
                    self.dropped += 1
                    if self.dropped == 1:
                        log.warning("%s: cannot write the server's log (%s): dropping its lines, still reading "
                                    "them (counted; the count is logged when the server stops)", self.name, exc)
        except (OSError, ValueError) as exc:  # the pipe went away
            log.warning("server log copy stopped: %s", exc)
        finally:
            if self.dropped:
                log.warning("%s: %d line(s) of the server's log could not be written and were dropped",
                            self.name, self.dropped)
            with contextlib.suppress(OSError, ValueError):
                pipe.close()
            with contextlib.suppress(OSError, ValueError):
                self.out.close()

    def finish(self, timeout_s: float) -> None:
        """Wait for the end of the output (bounded: a leftover child may hold the pipe open)."""
        self.thread.join(timeout_s)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _die_with_parent() -> None:
    """In the child before exec: on Linux, die when the worker dies, even by kill -9, instead of
    holding the GPU and the port (SGLang's own subprocesses follow their parent the same way)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
