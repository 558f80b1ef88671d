"""The simulator's radix cache against the SGLang v0.4 router figures (issue 28 §1): a shared-prefix
workload sent to N simulated servers by a plain asyncio HTTP client, routed by prefix (every prompt
of a group to one server) and round-robin, in the same run, each on cold caches.

SGLang v0.4's blog (cache-aware router against round-robin, 8 x A100, Llama-3.1-8B, a shared-prefix
workload): 1.9x throughput, cache hit rate 75% vs 20%.

Workload (default: the shape of SGLang's own shared-prefix benchmark, `bench_serving
--dataset-name generated-shared-prefix` defaults): G groups x P prompts, each prompt = its group's
system prompt (S random words) + its own question (Q random words), O output tokens (ignore_eos),
shuffled with a fixed seed, all sent at once (bench_serving's default request rate: inf): each
server gets its share as one `/generate` list, in arrival order (`--single`: one request each).

Figures, summed over the servers: cache hit rate = reused / prompt tokens (the observation record's
`cached_tokens_total` / `prompt_tokens_total`, each request counted at its first prefill);
throughput = (prompt + output tokens) / makespan, and output tokens / makespan, the makespan from the
first request sent to the last answer in simulated seconds (wall x SGLANG_SIM_TIME_SCALE). Also the
simulators' CPU seconds per mode, and the in-process CPU cost of the radix cache per request
(match, end-of-prefill and finish inserts) on 3K-token prompts.

    .venv/bin/python bench/bench_sim_cache.py [--servers 8] [--profile llama-8b-a100] [--groups 64]
        [--per-group 16] [--system-len 2048] [--question-len 128] [--output-len 256] [--time-scale 4]
        [--sim-args '--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule'] [--single]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_sim.engine import Request  # noqa: E402
from sglang_sim.profiles import get_profile  # noqa: E402
from sglang_sim.radix_cache import CacheConfig, RequestCache  # noqa: E402
from tests.simproc import SimProc  # noqa: E402

VOCAB = [f"w{i}" for i in range(20000)]


def workload(groups: int, per_group: int, system_len: int, question_len: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    systems = [" ".join(rng.choices(VOCAB, k=system_len)) for _ in range(groups)]
    rows = [(g, f"{systems[g]} {' '.join(rng.choices(VOCAB, k=question_len))}")
            for g in range(groups) for _ in range(per_group)]
    rng.shuffle(rows)
    return rows


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_mode(sims: list[SimProc], rows: list[tuple[int, str]], *, by_prefix: bool, output_len: int,
                   time_scale: float, single: bool) -> dict[str, float]:
    """One mode on cold caches. Each server gets its prompts, in arrival order, as one /generate list
    (SGLang's batch form: all queued at once, as bench_serving's infinite request rate does), or with
    `single` as one request each."""
    limits = httpx.Limits(max_connections=None, keepalive_expiry=600)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as c:
        for s in sims:  # cold caches for each mode
            assert (await c.post(s.url + "/flush_cache")).status_code == 200
        before = [(await c.get(s.url + "/sim/observed")).json() for s in sims]
        cpu0 = sum(cpu_s(s.proc.pid) for s in sims if s.proc)
        params = {"max_new_tokens": output_len, "ignore_eos": True}
        per_server: list[list[str]] = [[] for _ in sims]
        for i, (group, text) in enumerate(rows):
            per_server[(group if by_prefix else i) % len(sims)].append(text)
        bodies = [(s, orjson.dumps({"text": texts if not single else text, "sampling_params": params}))
                  for s, texts in zip(sims, per_server, strict=True) if texts
                  for text in (texts if single else [None])]
        headers = {"Content-Type": "application/json"}

        async def send(server: SimProc, body: bytes) -> int:
            r = await c.post(server.url + "/generate", content=body, headers=headers)
            r.raise_for_status()
            answers = r.json()
            return sum(int(a["meta_info"]["completion_tokens"]) for a in (answers if isinstance(answers, list)
                                                                          else [answers]))

        t0 = time.monotonic()
        out = sum(await asyncio.gather(*(send(server, body) for server, body in bodies)))
        wall = time.monotonic() - t0
        after = [(await c.get(s.url + "/sim/observed")).json() for s in sims]
    prompt = sum(a["prompt_tokens_total"] - b["prompt_tokens_total"] for a, b in zip(after, before, strict=True))
    cached = sum(a["cached_tokens_total"] - b["cached_tokens_total"] for a, b in zip(after, before, strict=True))
    model_s = wall * time_scale
    return {"hit": cached / prompt if prompt else 0.0, "tok_s": (prompt + out) / model_s,
            "out_s": out / model_s, "makespan": model_s, "prompt": prompt, "cached": cached,
            "sim_cpu": sum(cpu_s(s.proc.pid) for s in sims if s.proc) - cpu0}


def cache_cpu_us(n: int = 2000, system_len: int = 2048, question_len: int = 1024) -> float:
    """CPU microseconds per request of the radix cache alone: match + end-of-prefill insert + finish
    insert, 3K-token prompts over 64 shared prefixes, the tree kept under 400K tokens by eviction."""
    cache = RequestCache(CacheConfig(enabled=True, hybrid=False, strategy="no_buffer", chunk=8192))
    rows = workload(64, n // 64 + 1, system_len, question_len, seed=7)[:n]
    rng = random.Random(3)
    reqs = [Request(rid=str(i), prompt_words=text.split(), output_words=rng.choices(VOCAB, k=256),
                    finish_reason="length", matched_stop=None, endpoint="bench") for i, (_, text) in enumerate(rows)]
    t0 = time.process_time()
    for r in reqs:
        cache.admit(r)
        cache.prefilled(r)
        r.generated = 256
        cache.finished(r)
        if cache.tree.total > 400_000:
            cache.tree.evict_tokens(cache.tree.total - 400_000)
    return (time.process_time() - t0) / n * 1e6


def ratio(a: float, b: float) -> str:
    return f"{a / b:>7.2f}x" if b else f"{'-':>8}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--profile", default="llama-8b-a100")
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sim-args", default="", help="more flags for every server, e.g. "
                    "'--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule'")
    ap.add_argument("--single", action="store_true", help="one HTTP request per prompt (the client's CPU then "
                    "weighs on the figures of a small box)")
    args = ap.parse_args()
    try:
        model = get_profile(args.profile).model_path
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    rows = workload(args.groups, args.per_group, args.system_len, args.question_len, args.seed)
    # A connection opened for one of ~1,000 requests sent at once may wait seconds on this box's two
    # busy cores before its request is written; SGLang's 5 s keep-alive would close it under the client.
    env = {"SGLANG_SIM_PROFILE": args.profile, "SGLANG_SIM_TIME_SCALE": str(args.time_scale),
           "SGLANG_SIM_STARTUP_S": "0.5", "SGLANG_SIM_NUM_GPUS": str(args.servers), "SGLANG_TIMEOUT_KEEP_ALIVE": "600"}
    sims = [SimProc("--model-path", model, "--enable-metrics", *shlex.split(args.sim_args),
                    env={**env, "CUDA_VISIBLE_DEVICES": str(i)})
            for i in range(args.servers)]
    try:
        for s in sims:
            s.start(wait=False)
        for s in sims:
            s.wait_ready(timeout_s=60)
        rr = asyncio.run(run_mode(sims, rows, by_prefix=False, output_len=args.output_len,
                                  time_scale=args.time_scale, single=args.single))
        px = asyncio.run(run_mode(sims, rows, by_prefix=True, output_len=args.output_len,
                                  time_scale=args.time_scale, single=args.single))
    finally:
        for s in sims:
            s.stop()
    print(f"{len(rows)} prompts: {args.groups} groups x {args.per_group}, system prompt {args.system_len} + question "
          f"{args.question_len} words, {args.output_len} output tokens; {args.servers} x {args.profile}, "
          f"time scale {args.time_scale:g}{' ' + args.sim_args if args.sim_args else ''}")
    print(f"{'':28} {'by prefix':>12} {'round-robin':>12} {'ratio':>8}   SGLang v0.4 blog")
    print(f"{'cache hit rate':28} {px['hit']:>12.1%} {rr['hit']:>12.1%} {ratio(px['hit'], rr['hit'])}"
          f"   75% vs 20% (3.8x)")
    print(f"{'throughput (tok/s, in+out)':28} {px['tok_s']:>12,.0f} {rr['tok_s']:>12,.0f} "
          f"{ratio(px['tok_s'], rr['tok_s'])}   1.9x")
    print(f"{'output tok/s':28} {px['out_s']:>12,.0f} {rr['out_s']:>12,.0f} {ratio(px['out_s'], rr['out_s'])}")
    print(f"{'makespan (simulated s)':28} {px['makespan']:>12.1f} {rr['makespan']:>12.1f}")
    print(f"{'prompt / cached tokens':28} {px['prompt']:>6}/{px['cached']:<6} {rr['prompt']:>6}/{rr['cached']:<6}")
    print(f"{'simulators CPU s':28} {px['sim_cpu']:>12.1f} {rr['sim_cpu']:>12.1f}")
    print(f"radix cache CPU per request (match + inserts, {2048 + 1024}-token prompts, in process): "
          f"{cache_cpu_us():.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
