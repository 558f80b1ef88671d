"""Run the SGLang simulator as a real subprocess for tests (reusable by worker/supervisor tests).

    with start_sim("--enable-metrics", env={"SGLANG_SIM_TIME_SCALE": "50"}) as sim:
        httpx.post(sim.url + "/generate", json={...})
        sim.observed()          # GET /sim/observed (what the simulator saw)
    sim.record()                # the SGLANG_SIM_RECORD file, also after exit

`sim_env()` gives an env with sglang_sim/bin (the nvidia-smi shim) first on PATH and a private
SGLANG_SIM_GPU_DIR, so GPU-memory checks do not collide between tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .conftest import free_port

__all__ = ["BIN_DIR", "REPO", "SimProc", "free_port", "gpu_memory_used", "run_sim_cli", "sim_env", "start_sim"]

REPO = Path(__file__).resolve().parents[1]
BIN_DIR = REPO / "sglang_sim" / "bin"
SIM_CMD = [sys.executable, "-m", "sglang_sim"]




def sim_env(extra: dict[str, str] | None = None, *, gpu_dir: str | Path | None = None) -> dict[str, str]:
    """os.environ + shim on PATH + a private GPU dir (unless given) + `extra`."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN_DIR}{os.pathsep}{env.get('PATH', '')}"
    env["SGLANG_SIM_GPU_DIR"] = str(gpu_dir or tempfile.mkdtemp(prefix="sim-gpus-"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def run_sim_cli(*flags: str, env: dict[str, str] | None = None, timeout_s: float = 20) -> subprocess.CompletedProcess:
    """Run the simulator to completion (for start-up failures and --help); returns the finished process."""
    return subprocess.run([*SIM_CMD, *flags], env=sim_env(env), capture_output=True, text=True, timeout=timeout_s)


class SimProc:
    """One simulator subprocess: start, wait for /health_generate 200, stop (terminate -> wait -> kill)."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, port: int | None = None,
                 model_path: str = "sim/model", record: bool = True) -> None:
        self.port = port or free_port()
        self.tmp = Path(tempfile.mkdtemp(prefix="sim-"))
        self.record_path = self.tmp / "record.json"
        self.log_path = self.tmp / "stderr.log"
        extra = dict(env or {})
        if record:
            extra.setdefault("SGLANG_SIM_RECORD", str(self.record_path))
        self.env = sim_env(extra)
        argv = list(flags)
        if "--model-path" not in argv and "--model" not in argv:
            argv = ["--model-path", model_path, *argv]
        if "--port" not in argv:
            argv += ["--port", str(self.port)]
        self.argv = argv
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, *, wait: bool = True, timeout_s: float = 20) -> SimProc:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*SIM_CMD, *self.argv], env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready(timeout_s=timeout_s)
        return self

    def wait_ready(self, *, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"simulator exited with {self.proc.returncode}:\n{self.logs()[-3000:]}")
            try:
                if httpx.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"simulator not ready after {timeout_s}s:\n{self.logs()[-3000:]}")

    def wait_exit(self, timeout_s: float = 30) -> int:
        """The exit status of a server that is to die on its own (negative: killed by that signal)."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def record(self) -> dict[str, Any]:
        return json.loads(self.record_path.read_text())

    def observed(self) -> dict[str, Any]:
        return httpx.get(self.url + "/sim/observed", timeout=5).json()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 10) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> SimProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gpu_memory_used(env: dict[str, str]) -> dict[int, int]:
    """MiB used per GPU index, as the nvidia-smi shim on `env`'s PATH reports it."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], env=env,
                         capture_output=True, text=True, check=True)
    return {int(i): int(used) for i, used in (line.split(", ") for line in out.stdout.splitlines())}


def start_sim(*flags: str, env: dict[str, str] | None = None, port: int | None = None,
              wait: bool = True, timeout_s: float = 20) -> SimProc:
    """Start a simulator (default profile tiny-hybrid) and wait until it generates."""
    return SimProc(*flags, env=env, port=port).start(wait=wait, timeout_s=timeout_s)
