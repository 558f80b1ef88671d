"""`make demo`: `batchfleet run` on simulated GPUs, start to finish.

It runs the command a user runs on a GPU host —

    batchfleet run examples/prompts.jsonl -o var/demo/<run>/results.jsonl --gpus 0-3

— with the simulator as the server (BATCHFLEET_SGLANG_CMD="python -m sglang_sim", model
`sim/<profile>`), then prints a summary of the export. `batchfleet run` uses the Redis at REDIS_URL
when it answers, else starts a private redis-server. Everything goes under var/demo/<run>/: the
run's store, `results.jsonl`, `<run>.rejects.jsonl` (the sample's deliberately bad lines) and
`logs/` (servers, workers, head, supervisor). In a shared Redis (REDIS_URL answers) it purges its run at the end
(`producer purge`), so nothing of it stays there.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
from rich.console import Console

from fleetrun.redisproc import answers

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
console = Console(width=None if sys.stdout.isatty() else 120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4, help="simulated GPUs")
    parser.add_argument("--prompts", type=Path, default=ROOT / "examples" / "prompts.jsonl", help="input file")
    parser.add_argument("--profile", default="seed-27b-96gb", help="simulated model/GPU (SGLANG_SIM_PROFILE)")
    parser.add_argument("--time-scale", type=float, default=20.0, help="simulated seconds per wall second")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    args = parser.parse_args()

    run = time.strftime("demo-%Y%m%d-%H%M%S")
    workdir = ROOT / "var" / "demo" / run
    workdir.parent.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(mode=0o700)  # the run's state dir: private, as `batchfleet run` makes its own
    env = {
        **os.environ,
        "PATH": f"{BIN}:{ROOT / 'sglang_sim' / 'bin'}:{os.environ.get('PATH', '')}",  # nvidia-smi stand-in
        "BATCHFLEET_SGLANG_CMD": f"{sys.executable} -m sglang_sim",
        "BATCHFLEET_MODEL_PATH": f"sim/{args.profile}",
        "BATCHFLEET_SERVER_ARGS": "--context-length 4096",  # so the sample's two oversized prompts fail
        "BATCHFLEET_PORT_BASE": str(free_port_block(args.gpus)),
        "BATCHFLEET_STARTUP_TIMEOUT_S": "120",
        "SGLANG_SIM_PROFILE": args.profile,
        "SGLANG_SIM_TIME_SCALE": str(args.time_scale),
        "SGLANG_SIM_GPU_DIR": str(workdir / "gpus"),
        "SGLANG_SIM_NUM_GPUS": str(args.gpus),
    }
    out = workdir / "results.jsonl"
    cmd = [str(BIN / "batchfleet"), "run", str(args.prompts), "-o", str(out), "--gpus", f"0-{args.gpus - 1}",
           "--run", run, "--state-dir", str(workdir), "--timeout", str(args.timeout)]
    console.rule(f"batchfleet run {args.prompts.name} -o {out.relative_to(ROOT)} --gpus 0-{args.gpus - 1} "
                 f"({args.gpus} simulated GPUs, {args.profile}, x{args.time_scale:g} time)")
    t0 = time.monotonic()
    code = subprocess.run(cmd, env=env, check=False).returncode
    elapsed = time.monotonic() - t0
    if code not in (0, 1) or not out.exists():  # 1: the sample's deliberately bad lines were rejected
        console.print(f"[red]batchfleet run exited {code}; logs in {workdir / 'logs' / run}")
        return code or 1
    summary(out, workdir, run, elapsed)
    shared = os.environ.get("BATCHFLEET_REDIS_URL") or os.environ.get("REDIS_URL")
    if shared and answers(shared):
        # A shared Redis keeps nothing of the demo: its processes are stopped; the store and the export
        # stay under var/demo/.
        console.rule("purge the demo's run from the shared Redis")
        subprocess.run([str(BIN / "producer"), "purge", run, "--yes", "--force"],
                       env=env, check=False)
    return 0


def free_port_block(n: int) -> int:
    """A base port with n free ports after it (each GPU's server listens on base + index)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def summary(out: Path, workdir: Path, run: str, elapsed: float) -> None:
    ok = failed = tokens = 0
    reasons: list[str] = []
    with out.open("rb") as f:
        for line in f:
            rec = orjson.loads(line)
            resp = rec["response"]
            if resp is not None and resp["status_code"] == 200:
                ok += 1
                tokens += resp["body"]["usage"]["completion_tokens"]
            else:  # an HTTP error answer (its status and the server's body), or no answer (`error`)
                failed += 1
                why = rec["error"]["message"] if resp is None else f"HTTP {resp['status_code']}: {resp['body']}"
                reasons.append(f"{rec['custom_id']}: {why[:100]}")
    rejects_path = workdir / f"{run}.rejects.jsonl"
    rejects = sum(1 for _ in rejects_path.open()) if rejects_path.exists() else 0
    console.rule("summary")
    console.print(f"prompts exported : {ok + failed} ({ok} succeeded, {failed} failed), {rejects} input lines rejected")
    # One throughput figure, batchfleet run's own (its `wrote` line: tok/s of the run): none recomputed here.
    console.print(f"wall time        : {elapsed:.1f} s, enqueue to export ({tokens:,} completion tokens; "
                  "tok/s: the `wrote` line above)")
    for reason in reasons[:5]:
        console.print(f"failed           : {reason}")
    console.print(f"results          : {out}")
    console.print(f"rejects          : {rejects_path}")
    console.print(f"logs             : {workdir}/logs/ (servers, workers, head, supervisor)")


if __name__ == "__main__":
    sys.exit(main())
