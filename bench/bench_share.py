"""Fair share between the tenants of one fleet, through `batchfleet serve` and the official `openai`
client: a latecomer's small batch, weights, a high-priority batch on a full fleet, and the slot fill
the share costs.

Each round, in one private Redis, three `batchfleet serve --gpus 0-7 --no-supervisor` in turn (one per
part below, each a run of its own: no tenant's usage carries from one part to the next) on simulated
GPUs (the hybrid 27B profile `seed-27b-96gb`, default strategy), with a tenants file of three tenants
(keys as SHA-256). Requests are chat lines of ~40 words with `max_tokens` `--max-tokens`, answered at
the simulated model's own lengths (exponential, mean ~260 tokens, capped there): as in real work, they
end at different times (all of one length, fed together, would free a server's slots at once and none
between, and a high request could start only then). Times are
wall seconds; the servers run `--time-scale` simulated seconds per wall second. Every result is read
from the run's store (its Redis time, its usage) and every batch's files are checked exactly once.

    alone     tenant B submits 2,000 requests on the idle fleet: T_alone, submit to last result
    late      tenant A submits 200,000; 60 s after it is in progress, B submits the same 2,000: T_shared.
              Goal: T_shared <= 1.5 x T_alone + one request's generation (here: B alone's first
              result, from its submit: an upper bound of one generation)
    high      (the same serve) while A runs, tenant C submits 100 requests of 16 tokens with metadata.priority "high":
              its first result and its last, from the submit (goal: starts within 2 s: its first
              result comes at most one 16-token generation after its start); requests aborted by the
              servers over the part (goal 0). A is then cancelled.
    weights   weights A 1, B 3; both submit `--big` requests, more than the fleet runs in the
              part: over each `--window-s` window after the first, B's share of the output tokens
              finished in it (goal 0.75 +- 0.05)
    fill      the servers' slot fill (the simulators' occupied slot-seconds over capacity x model
              seconds): during A alone in `late` (after its first 15 s), and during `weights` (its
              windows after the first). Goal: shared >= 0.995 x single

    python bench/bench_share.py [--rounds 3] [--time-scale 2] [--max-tokens 1024] [--big 60000]
                                [--window-s 120] [--windows 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetrun.redisproc import PrivateRedis  # noqa: E402
from tests.serveproc import Serve, serve_env  # noqa: E402

KEYS = {"A": "bench-key-tenant-a", "B": "bench-key-tenant-b", "C": "bench-key-tenant-c"}
GPUS = 8
ENV = {"SGLANG_SIM_PROFILE": "seed-27b-96gb", "BATCHFLEET_MODEL_PATH": "Qwen/Qwen3.6-27B",
       "SGLANG_SIM_NUM_GPUS": str(GPUS), "SGLANG_SIM_STARTUP_S": "1.0", "BATCHFLEET_STARTUP_TIMEOUT_S": "120",
       "BATCHFLEET_SHUTDOWN_GRACE_S": "2", "BATCHFLEET_HEALTH_INTERVAL_S": "5"}
VOCAB = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "po", "ru", "sa", "ti") for b in ("n", "r", "s", "t", "l", "m")]


def tenants_toml(weights: dict[str, float]) -> str:
    out = []
    for name, key in KEYS.items():
        prios = '["high", "normal", "low"]' if name == "C" else '["normal", "low"]'
        out.append(f'[tenants.{name}]\nkeys = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
                   f"weight = {weights.get(name, 1)}\npriorities = {prios}\n")
    return "\n".join(out)


def write_tenants(path: Path, weights: dict[str, float]) -> None:
    path.write_text(tenants_toml(weights))
    path.chmod(0o600)


def lines(path: Path, n: int, tag: str, max_tokens: int) -> Path:
    """`n` chat requests of at most `max_tokens` tokens, each ending where the model stops."""
    with path.open("wb") as fh:
        for i in range(n):
            words = " ".join(VOCAB[(i * 7 + j * 13) % len(VOCAB)] for j in range(40))
            fh.write(orjson.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"max_tokens": max_tokens,
                                            "messages": [{"role": "user", "content": f"{tag} {i}: {words}"}]}})
                     + b"\n")
    return path


class Bench:
    def __init__(self, tmp: Path, url: str, args: argparse.Namespace, *, run: str, weights: dict[str, float]) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.args = args
        self.run = run
        self.tenants = tmp / "tenants.toml"
        write_tenants(self.tenants, weights)
        env = serve_env(tmp, url, **ENV, SGLANG_SIM_TIME_SCALE=str(args.time_scale))
        self.sv = Serve(tmp, url, "--gpus", f"0-{GPUS - 1}", "--no-supervisor", "--tenants", str(self.tenants),
                        "--max-requests", "250000", env=env, run=run)
        self.clients = {t: self.sv.client(k) for t, k in KEYS.items()}
        for c in self.clients.values():
            c.timeout = 600

    def start(self) -> None:
        self.sv.start(timeout_s=120)
        deadline = time.monotonic() + 180  # until every simulated server says it is ready (its record)
        while time.monotonic() < deadline:
            recs = [self.sim(g) for g in range(GPUS)]
            if all(r and r.get("ready") for r in recs):
                return
            time.sleep(0.5)
        raise SystemExit(f"the servers did not start:\n{self.sv.log()[-3000:]}")

    def sim(self, gpu: int) -> dict[str, Any] | None:
        path = self.tmp / f"sim-gpu{gpu}.json"
        with contextlib.suppress(OSError, ValueError):
            return orjson.loads(path.read_bytes())
        return None

    def submit(self, tenant: str, path: Path, **meta: str) -> tuple[str, float]:
        c = self.clients[tenant]
        with path.open("rb") as fh:
            f = c.files.create(file=fh, purpose="batch")
        t0 = time.time()
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata=meta or None)
        return b.id, t0

    def wait_status(self, tenant: str, bid: str, statuses: tuple[str, ...], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            b = self.clients[tenant].batches.retrieve(bid)
            if b.status in statuses:
                return b
            time.sleep(0.25)
        raise SystemExit(f"batch {bid} not {statuses} after {timeout_s} s")

    def results(self, bid: str) -> list[tuple[float, int]]:
        """(finished_at, completion tokens) of each result of batch `bid`, from the store."""
        db = sqlite3.connect(f"file:{self.sv.state / (self.run + '.sqlite')}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute("SELECT r.finished_at, r.line FROM results r JOIN prompts p ON p.seq = r.seq "
                              "WHERE p.cid >= ? AND p.cid < ?", (bid + ":", bid + ";")).fetchall()
        finally:
            db.close()
        out = []
        for at, line in rows:
            body = (orjson.loads(line).get("response") or {}).get("body") or {}
            out.append((at, int((body.get("usage") or {}).get("completion_tokens") or 0)))
        return out

    def exact(self, tenant: str, bid: str, n: int) -> tuple[int, int]:
        """(lost, duplicated) over the batch's output and error files: each custom_id once."""
        b = self.clients[tenant].batches.retrieve(bid)
        seen: Counter[str] = Counter()
        for fid in (b.output_file_id, b.error_file_id):
            if fid:
                for raw in self.clients[tenant].files.content(fid).read().splitlines():
                    seen[orjson.loads(raw)["custom_id"]] += 1
        return n - len(seen), sum(v - 1 for v in seen.values() if v > 1)

    def fill_mark(self) -> list[tuple[float, float, int]]:
        """Per rank of every server: (model seconds, occupied slot-seconds, capacity) now."""
        out = []
        for g in range(GPUS):
            rec = self.sim(g) or {}
            out += [(r["t"], r["slot_s"], r["cap"]) for r in rec.get("slot_fill", [])]
        return out

    def aborted(self) -> int:
        return sum((self.sim(g) or {}).get("aborted_total", 0) for g in range(GPUS))


def fill_between(a: list[tuple[float, float, int]], b: list[tuple[float, float, int]]) -> float:
    used = sum(sb - sa for (_, sa, _), (_, sb, _) in zip(a, b, strict=True))
    room = sum(cap * (tb - ta) for (ta, _, cap), (tb, _, _) in zip(a, b, strict=True))
    return used / room if room else float("nan")


def one_round(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The parts of one round, each on a serve of its own (a fresh run: no tenant's usage carries over
    from one part to the next)."""
    out: dict[str, Any] = {}
    files = {"b": lines(work / "b.jsonl", 2000, "b", args.max_tokens),
             "a": lines(work / "a.jsonl", 200_000, "a", args.max_tokens),
             "c": lines(work / "c.jsonl", 100, "c", 16),
             "big_a": lines(work / "big_a.jsonl", args.big, "wa", args.max_tokens),
             "big_b": lines(work / "big_b.jsonl", args.big, "wb", args.max_tokens)}
    lost = dup = 0
    with PrivateRedis() as redis_proc:
        # alone
        bench = Bench(work / "alone", redis_proc.url, args, run="alone", weights={})
        try:
            bench.start()
            bid, t0 = bench.submit("B", files["b"])
            bench.wait_status("B", bid, ("completed",), 1800)
            res = bench.results(bid)
            out["t_alone"] = max(at for at, _ in res) - t0
            out["first_alone"] = min(at for at, _ in res) - t0
            x, y = bench.exact("B", bid, 2000)
            lost, dup = lost + x, dup + y
        finally:
            bench.sv.stop()
        # late, high
        bench = Bench(work / "late", redis_proc.url, args, run="late", weights={})
        try:
            bench.start()
            aid, _ = bench.submit("A", files["a"])
            bench.wait_status("A", aid, ("in_progress",), 600)
            a_on = time.monotonic()
            time.sleep(15)
            single0 = bench.fill_mark()
            time.sleep(max(0.0, 60 - (time.monotonic() - a_on)))
            single1 = bench.fill_mark()
            out["fill_single"] = fill_between(single0, single1)
            bid, t0 = bench.submit("B", files["b"])
            bench.wait_status("B", bid, ("completed",), 1800)
            res = bench.results(bid)
            out["t_shared"] = max(at for at, _ in res) - t0
            x, y = bench.exact("B", bid, 2000)
            lost, dup = lost + x, dup + y
            before = bench.aborted()
            cid, t0 = bench.submit("C", files["c"], priority="high")
            bench.wait_status("C", cid, ("completed",), 600)
            res = bench.results(cid)
            out["high_first"] = min(at for at, _ in res) - t0
            out["high_last"] = max(at for at, _ in res) - t0
            out["aborted"] = bench.aborted() - before
            x, y = bench.exact("C", cid, 100)
            lost, dup = lost + x, dup + y
            bench.clients["A"].batches.cancel(aid)
            bench.wait_status("A", aid, ("cancelled",), 900)
            x, y = bench.exact("A", aid, 200_000)
            lost, dup = lost + x, dup + y
        finally:
            bench.sv.stop()
        # weights
        bench = Bench(work / "weights", redis_proc.url, args, run="weights", weights={"A": 1, "B": 3})
        try:
            bench.start()
            wa, _ = bench.submit("A", files["big_a"])
            wb, _ = bench.submit("B", files["big_b"])
            bench.wait_status("A", wa, ("in_progress",), 600)
            bench.wait_status("B", wb, ("in_progress",), 600)
            t_on = time.time()
            marks = [bench.fill_mark()]
            for w in range(args.windows):
                time.sleep(max(0.0, t_on + (w + 1) * args.window_s - time.time()))
                marks.append(bench.fill_mark())
            ra, rb = bench.results(wa), bench.results(wb)
            shares = []
            for w in range(1, args.windows):
                lo, hi = t_on + w * args.window_s, t_on + (w + 1) * args.window_s
                ta = sum(n for at, n in ra if lo <= at < hi)
                tb = sum(n for at, n in rb if lo <= at < hi)
                shares.append(tb / (ta + tb) if ta + tb else float("nan"))
            out["shares"] = shares
            out["fill_shared"] = fill_between(marks[1], marks[-1])
            for t, b_id in (("A", wa), ("B", wb)):
                bench.clients[t].batches.cancel(b_id)
                bench.wait_status(t, b_id, ("cancelled",), 900)
                x, y = bench.exact(t, b_id, args.big)
                lost, dup = lost + x, dup + y
        finally:
            bench.sv.stop()
    out["lost"], out["duplicated"] = lost, dup
    return out


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=1024, help="each request's cap")
    ap.add_argument("--big", type=int, default=60_000, help="requests of each tenant's batch in `weights`")
    ap.add_argument("--window-s", type=float, default=120.0)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rounds = []
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {GPUS} simulated GPUs (seed-27b-96gb), time scale "
          f"{args.time_scale:g}, at most {args.max_tokens} tokens a request", flush=True)
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-share-") as tmp:
            res = one_round(args, Path(tmp))
        rounds.append(res)
        print(f"round {r + 1}: B alone {res['t_alone']:.1f} s (first result {res['first_alone']:.1f} s), B beside A "
              f"{res['t_shared']:.1f} s; high first {res['high_first']:.2f} s, last {res['high_last']:.2f} s, aborted "
              f"{res['aborted']}; B's shares {', '.join(f'{s:.3f}' for s in res['shares'])}; fill single "
              f"{res['fill_single']:.4f}, shared {res['fill_shared']:.4f}; lost {res['lost']}, duplicated "
              f"{res['duplicated']}", flush=True)
    allow = [x["t_shared"] / (1.5 * x["t_alone"] + x["first_alone"]) for x in rounds]
    shares = [s for x in rounds for s in x["shares"]]
    print(f"\nfair share, {args.rounds} rounds (median, range):")
    print(f"  B alone           : {spread([x['t_alone'] for x in rounds], '{:.1f}')} s")
    print(f"  B beside A        : {spread([x['t_shared'] for x in rounds], '{:.1f}')} s; beside / alone "
          f"{spread([x['t_shared'] / x['t_alone'] for x in rounds])}x; over 1.5 x alone + one generation "
          f"{spread(allow)} (goal <= 1)")
    print(f"  high, first result: {spread([x['high_first'] for x in rounds])} s (goal: starts within 2 s); last "
          f"{spread([x['high_last'] for x in rounds])} s; aborted {sum(x['aborted'] for x in rounds)} (goal 0)")
    print(f"  B's share, weights 1:3: {spread(shares, '{:.3f}')} over {len(shares)} windows of {args.window_s:g} s "
          f"(goal 0.75 +- 0.05); outside: {sum(1 for s in shares if abs(s - 0.75) > 0.05)}")
    print(f"  slot fill shared / single: {spread([x['fill_shared'] / x['fill_single'] for x in rounds], '{:.4f}')} "
          f"(goal >= 0.995; single {spread([x['fill_single'] for x in rounds], '{:.4f}')}, shared "
          f"{spread([x['fill_shared'] for x in rounds], '{:.4f}')})")
    print(f"  lost {sum(x['lost'] for x in rounds)}, duplicated {sum(x['duplicated'] for x in rounds)}")
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
