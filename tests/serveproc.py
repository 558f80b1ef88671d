"""Test helper: `batchfleet serve` as a real subprocess, and the official `openai` client pointed at it.

    sv = Serve(tmp, redis_url, "--gpus", "0-1", env={...}).start()
    client = sv.client("key")           # openai.OpenAI(base_url=sv.url, api_key="key")
    sv.stop()                           # SIGINT, then kill; Serve.made are all killed after each test
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import orjson

from .conftest import free_port
from .fleet import ROOT

BIN = Path(sys.executable).parent


def serve_env(tmp: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """The environment of a serve under test: no settings of the caller's, the simulator for servers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHFLEET_", "REDIS_URL", "RQ_", "SGLANG_SIM"))}
    env.update({
        "PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{env.get('PATH', '')}",
        "REDIS_URL": redis_url,
        "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
        "BATCHFLEET_MODEL_PATH": "sim/tiny-hybrid",
        "BATCHFLEET_STARTUP_TIMEOUT_S": "60",
        "BATCHFLEET_STATUS_INTERVAL_S": "0.5",
        "SGLANG_SIM_GPU_DIR": str(tmp / "gpus"),
        "SGLANG_SIM_STARTUP_S": "0.2",
        "SGLANG_SIM_RECORD": str(tmp / "sim-gpu{gpu}.json"),
        **extra,
    })
    return env


class Serve:
    made: ClassVar[list[Serve]] = []
    _seq: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self, tmp: Path, redis_url: str, *args: str, env: dict[str, str] | None = None,
                 run: str | None = None, state: Path | None = None) -> None:
        Serve.made.append(self)
        self.tmp = tmp
        self.run = run or f"sv{next(Serve._seq)}"
        self.state = state or tmp / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.args = list(args)
        self.env = env if env is not None else serve_env(tmp, redis_url)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.tmp / f"serve-{self.run}-{self.starts}.log"

    def start(self, *, wait: bool = True, timeout_s: float = 60) -> Serve:
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(BIN / "batchfleet"), "serve", "--run", self.run, "--state-dir", str(self.state),
                 "--port", str(self.port), *self.args], env=self.env, cwd=self.tmp, stdout=log,
                stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url[:-3] + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"serve not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=30)

    def http(self, method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def stop(self, timeout_s: float = 90) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9: its workers, head and supervisor die with it (PR_SET_PDEATHSIG)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def batch_lines(n: int, *, prefix: str = "req-", url: str = "/v1/chat/completions", max_tokens: int = 16,
                start: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(start, start + n):
        body: dict[str, Any] = {"model": "sim/tiny-hybrid", "max_tokens": max_tokens}
        if url == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"Tell me about item {i}"}]
        else:
            body["prompt"] = f"Describe the number {i} in detail"
        out.append({"custom_id": f"{prefix}{i}", "method": "POST", "url": url, "body": body})
    return out


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def expected(line: dict[str, Any]) -> str:
    """What the simulator answers to a batch line (its documented rule)."""
    from sglang_sim.textgen import expected_completion, render_chat

    body = line["body"]
    prompt = render_chat(body["messages"]) if "messages" in body else body["prompt"]
    return expected_completion(prompt, {"max_new_tokens": body["max_tokens"]})[0]
