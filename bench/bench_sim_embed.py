"""The simulator's CPU per embedding request and per LoRA request (issue 30): what one simulated server
spends, in CPU seconds of its own process, per document it embeds and per generation it serves on an
adapter, beside the same work without the feature, in the same run.

A plain asyncio HTTP client (aiohttp, `--concurrency` requests in flight) sends:
- `health`: N `GET /health` (the HTTP floor: aiohttp's cost of a request that does nothing);
- `embed-1`: N `/v1/embeddings` requests of one short document each (`--words` words);
- `embed-32`: the same N documents as lists of 32 per request; with `--base64` too;
- `generate`, `lora`: N/4 short `/generate` requests (8 output tokens) on the base model of a LoRA
  server, and the same spread round-robin over 4 adapters with `--max-loras-per-batch 2` (switches).
The simulators run at `--time-scale` (model seconds per wall second) so that model time never binds.
The embedding server's KV pool is cut to `--max-total-tokens` (default 100,000) so that the radix
cache is full and evicting after the first few thousand documents, as it is for most of a long run.

    .venv/bin/python bench/bench_sim_embed.py [--n 20000] [--words 20] [--concurrency 64] [--time-scale 200]
        [--max-total-tokens 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.simproc import SimProc  # noqa: E402

VOCAB = [f"w{i}" for i in range(50000)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks of 10 ms


async def drive(url: str, bodies: list[tuple[str, dict | None]], concurrency: int) -> float:
    queue = list(reversed(bodies))
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one() -> None:
            while queue:
                path, body = queue.pop()
                call = session.get(url + path) if body is None else session.post(url + path, json=body)
                async with call as res:
                    await res.read()
                    assert res.status == 200, await res.text()

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return time.monotonic() - t0


def run(sim: SimProc, bodies: list[tuple[str, dict | None]], concurrency: int) -> tuple[float, float]:
    """(CPU seconds of the simulator, wall seconds) for sending `bodies`."""
    assert sim.proc is not None
    before = cpu_s(sim.proc.pid)
    wall = asyncio.run(drive(sim.url, bodies, concurrency))
    return cpu_s(sim.proc.pid) - before, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--words", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--time-scale", type=float, default=200)
    ap.add_argument("--max-total-tokens", type=int, default=100000)
    args = ap.parse_args()
    rng = random.Random(1)
    docs = [" ".join(rng.choices(VOCAB, k=args.words)) for _ in range(args.n)]
    env = {"SGLANG_SIM_STARTUP_S": "0.1", "SGLANG_SIM_TIME_SCALE": str(args.time_scale),
           "SGLANG_SIM_PROFILE": "embed-0.6b-96gb"}
    rows = []
    with SimProc("--is-embedding", "--enable-metrics", "--max-total-tokens", str(args.max_total_tokens), env=env,
                 model_path="Qwen/Qwen3-Embedding-0.6B") as sim:
        sim.start()
        cpu, wall = run(sim, [("/health", None)] * args.n, args.concurrency)
        rows.append(("health", args.n, args.n, cpu, wall))
        for name, size, fmt in (("embed-1", 1, "float"), ("embed-32", 32, "float"), ("embed-32 base64", 32, "base64")):
            bodies = [("/v1/embeddings", {"input": docs[i] if size == 1 else docs[i:i + size], "encoding_format": fmt})
                      for i in range(0, args.n, size)]
            cpu, wall = run(sim, bodies, args.concurrency)
            rows.append((name, len(bodies), args.n, cpu, wall))
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = []
    for i in range(4):
        (tmp / f"a{i}").mkdir()
        (tmp / f"a{i}" / "adapter_config.json").write_text(json.dumps(
            {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
        paths.append(f"a{i}={tmp / f'a{i}'}")
    env = {**env, "SGLANG_SIM_PROFILE": "llama-8b-a100"}
    n_gen = args.n // 4
    with SimProc("--lora-paths", *paths, "--max-loras-per-batch", "2", "--enable-metrics", env=env) as sim:
        sim.start()
        for name, adapters in (("generate", [None]), ("lora", [f"a{i}" for i in range(4)])):
            bodies = [("/generate", {"text": docs[i], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                                     **({"lora_path": adapters[i % len(adapters)]} if adapters[0] else {})})
                      for i in range(n_gen)]
            cpu, wall = run(sim, bodies, args.concurrency)
            rows.append((name, n_gen, n_gen, cpu, wall))
        loads = sim.observed()["lora"]["loads_total"]
    print(f"{'mode':<18} {'requests':>8} {'docs':>7} {'cpu s':>7} {'us/request':>10} {'us/doc':>8} {'docs/s wall':>11}")
    for name, reqs, n, cpu, wall in rows:
        per_req, per_doc = cpu / reqs * 1e6, cpu / n * 1e6
        print(f"{name:<18} {reqs:>8} {n:>7} {cpu:>7.2f} {per_req:>10.0f} {per_doc:>8.0f} {n / wall:>11.0f}")
    per = {name: cpu / reqs for name, reqs, _, cpu, _ in rows}
    print(f"embed-1 / health CPU per request: {per['embed-1'] / per['health']:.2f}")
    print(f"lora / generate CPU per request: {per['lora'] / per['generate']:.2f} ({loads} adapter loads)")


if __name__ == "__main__":
    main()
