"""Enqueue into the store, the memory it costs, and what a queued prompt costs in Redis — each beside
RQ's `Queue.enqueue_many` measured in the same run.

    .venv/bin/python bench/bench_enqueue.py [--n 1000000] [--baseline-n 200000] [--layout-n 50000] [--against DIR]
                                            [--only store|layout|against|plan]

1. store: N short generated prompts, `producer enqueue FILE` as a subprocess against a private
   redis-server, with `producer head` running beside it (it feeds each queue's window as the store
   fills). Reports prompts/s into the store (the command's own figure), peak RSS of the enqueue and
   head processes (VmHWM), Redis peak used_memory, and the store's size on disk.
   Baseline: RQ's enqueue_many puts every prompt in Redis; it runs on the first `baseline-n` prompts
   of the same file (10M would need ~20 GB of Redis), and its Redis bytes per prompt give the
   projection for N.
   With `--against DIR` (a checkout of another commit, e.g. `git worktree add --detach /tmp/c7aa53c
   c7aa53c`; repeatable), `producer enqueue` of the same file from this tree and from each DIR (its
   code on PYTHONPATH, this venv), `--ab-repeat` times each, interleaved, without a head, each into a
   fresh store: the median and the range of each, and this tree's ratio to each.
2. plan: the same file enqueued with the plan and with --no-plan (short prompts, and N/5 few-shot
   prompts of ~1.6 KB that the plan keys at several anchors; `--keyed`: N prompts of ~626 B sharing 1,000
   openings instead), interleaved, and the plan's sorted pass inside one feed transaction and beside a
   feed loop (the longest feed transaction while it ran).
3. layout: `layout-n` prompts of `words` random words each, all queued (a window as big as the run),
   Redis bytes per queued prompt beyond its text: our job layout vs enqueue_many's. Best of `repeat`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import redis
from rq import Queue

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchfleet.config import Config
from batchfleet.jobs import GENERATE, job_id_for, prompt_wire
from batchfleet.keys import FAILURE_TTL_S
from batchfleet.serializer import OrjsonSerializer
from fleetrun.redisproc import PrivateRedis
from producer.api import enqueue

BIN = Path(sys.executable).parent
MIB = 2**20


def short_prompts(path: Path, n: int) -> None:
    """`n` short generated prompts (~90 B a line), mixed max_tokens."""
    with path.open("wb", buffering=1 << 20) as fh:
        for start in range(0, n, 100_000):
            fh.write(b"".join(
                b'{"id":"p%08d","prompt":"Write a short note about item number %d.","max_tokens":%d}\n'
                % (i, i, 64 << (i % 3)) for i in range(start, min(n, start + 100_000))))


def worded_prompts(path: Path, n: int, words: int) -> float:
    """`n` prompts of `words` random pseudo-words; returns the mean text bytes."""
    rng = random.Random(7)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    total = 0
    with path.open("wb") as fh:
        for i in range(n):
            text = " ".join(rng.choices(vocab, k=words))
            total += len(text.encode())
            fh.write(orjson.dumps({"id": f"p{i:07d}", "prompt": text, "max_tokens": 256}) + b"\n")
    return total / n


def used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


class PeakRss:
    """Samples /proc/<pid>/status VmHWM (the kernel's own peak RSS) until the process ends."""

    def __init__(self, pid: int) -> None:
        self.pid, self.kib, self.done = pid, 0, threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while not self.done.is_set():
            try:
                for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.kib = max(self.kib, int(line.split()[1]))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.1)

    @property
    def mib(self) -> float:
        return self.kib / 1024


def rq_enqueue_many(r: redis.Redis, path: Path, limit: int, queues: tuple[str, ...], run: str) -> float:
    """RQ's own way: read and decode the same file, prepare_data + enqueue_many per 1,000. Seconds."""
    qs = [Queue(q, connection=r, serializer=OrjsonSerializer) for q in queues]
    t0 = time.perf_counter()
    batch, b = [], 0
    with path.open("rb") as fh:
        for seq, raw in enumerate(fh, 1):
            if seq > limit:
                break
            d = orjson.loads(raw)
            cid = d["id"]
            prompt = prompt_wire(cid, seq, "/v1/completions", {"prompt": d["prompt"], "max_tokens": d["max_tokens"],
                                                               "model": "default"}, run=run)
            batch.append(Queue.prepare_data(
                GENERATE, args=(prompt,), job_id=job_id_for(run, cid), description=f"generate({cid})",
                result_ttl=0, failure_ttl=FAILURE_TTL_S, timeout=3600))
            if len(batch) == 1000:
                qs[b % len(qs)].enqueue_many(batch)
                batch, b = [], b + 1
    if batch:
        qs[b % len(qs)].enqueue_many(batch)
    return time.perf_counter() - t0


def keyed_prompts(path: Path, n: int) -> None:
    """`n` prompts of ~640 B that the plan keys: one of 1,000 shared openings (~560 B) and a question."""
    rng = random.Random(5)
    openings = [(f"You are assistant {k:04d}. " + " ".join(f"rule{rng.randrange(10**6)}" for _ in range(50)))[:560]
                for k in range(1000)]
    with path.open("wb", buffering=1 << 20) as fh:
        for start in range(0, n, 100_000):
            fh.write(b"".join(
                b'{"id":"k%08d","prompt":"%s Question %d?","max_tokens":%d}\n'
                % (i, openings[(i * 7919) % 1000].encode(), i, 64 << (i % 3))
                for i in range(start, min(n, start + 100_000))))


def bench_store(a: argparse.Namespace, work: Path) -> None:
    queues = ",".join(f"gpu{i}" for i in range(a.queues))
    path = work / ("keyed.jsonl" if a.keyed else "short.jsonl")
    t0 = time.perf_counter()
    (keyed_prompts if a.keyed else short_prompts)(path, a.n)
    kind = "keyed (planned)" if a.keyed else "short"
    print(f"[{a.n:,} {kind} prompts written in {time.perf_counter() - t0:.0f} s, {path.stat().st_size / MIB:,.0f} MiB]",
          file=sys.stderr)
    with PrivateRedis() as redis_proc:
        r = redis.Redis.from_url(redis_proc.url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
        env.update(REDIS_URL=redis_proc.url, BATCHFLEET_RUN="bench", BATCHFLEET_STATE_DIR=str(work / "state"))
        head = subprocess.Popen([str(BIN / "producer"), "head", "--interval", "1"], env=env,
                                stdout=subprocess.DEVNULL, stderr=(work / "head.log").open("wb"))
        head_rss = PeakRss(head.pid)
        samples: list[int] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                samples.append(used(r))
                time.sleep(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        enq = subprocess.Popen([str(BIN / "producer"), "enqueue", str(path), "--queues", queues, "--no-progress"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        enq_rss = PeakRss(enq.pid)
        out, err = enq.communicate()
        assert enq.returncode == 0, err
        time.sleep(3)  # the head's next passes
        sampling.set()
        sampler.join()
        head.terminate()
        head.wait(30)
        line = out.splitlines()[0]
        rate = float(line.split("(")[1].split("/s")[0].replace(",", ""))
        peak = int(r.info("memory")["used_memory_peak"])
        queued = sum(r.llen(f"rq:queue:{q}") for q in queues.split(","))
        store_b = sum(f.stat().st_size for f in (work / "state").glob("bench.sqlite*"))

        r.flushall()
        base_n = min(a.baseline_n, a.n)
        before = used(r)
        dt = rq_enqueue_many(r, path, base_n, tuple(queues.split(",")), "base")
        per = (used(r) - before) / base_n
    print(f"enqueue {a.n:,} {kind} prompts ({path.stat().st_size / a.n:.0f} B a line) onto {a.queues} queues, "
          f"`producer head` running")
    print(f"  into the store           : {rate:>10,.0f} prompts/s   (goal >= 50,000)")
    print(f"  rq enqueue_many          : {base_n / dt:>10,.0f} prompts/s   (first {base_n:,}, every prompt into Redis)")
    print(f"  ratio                    : {rate / (base_n / dt):>10.1f}x")
    print(f"  Redis peak used_memory   : {peak / MIB:>10,.1f} MiB   (goal < 256; {queued:,} prompts queued = the "
          f"window; max sampled {max(samples) / MIB:,.1f} MiB)")
    print(f"  rq enqueue_many, Redis   : {per * a.n / MIB:>10,.0f} MiB   ({per:,.0f} B a prompt x {a.n:,}, projected)")
    print(f"  enqueue process peak RSS : {enq_rss.mib:>10,.0f} MiB   (goal < 500)")
    print(f"  head process peak RSS    : {head_rss.mib:>10,.0f} MiB   (goal < 500)")
    print(f"  store on disk            : {store_b / MIB:>10,.0f} MiB   ({store_b / a.n:,.0f} B a prompt)")
    sys.stdout.flush()


def enqueue_from(tree: Path, path: Path, url: str, state: Path, run: str, *extra: str) -> tuple[float, float]:
    """`producer enqueue` of `path` with the code of `tree` (on PYTHONPATH): its own prompts/s figure, and
    the CPU seconds of the whole process (user + system, start-up included). `extra`: more arguments."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
    env["PYTHONPATH"] = str(tree)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", "import sys; from producer.cli import main; sys.exit(main())",
                           "--redis-url", url, "--run", run, "--state-dir", str(state), "enqueue", str(path),
                           "--queues", f"{run}.gpu0", "--no-progress", *extra],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    m = re.search(r"lines in \S+ s \(([\d,]+)/s\)", done.stdout + done.stderr)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"producer enqueue ({tree}) failed: {done.stdout}{done.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return float(m.group(1).replace(",", "")), cpu_s


def bench_against(a: argparse.Namespace, work: Path) -> None:
    here = Path(__file__).resolve().parents[1]
    trees = [here, *(Path(d).resolve() for d in a.against)]
    path = work / "short.jsonl"
    if not path.exists():
        short_prompts(path, a.n)
    rates: dict[Path, list[float]] = {tree: [] for tree in trees}
    cpu: dict[Path, list[float]] = {tree: [] for tree in trees}  # CPU microseconds a prompt
    with PrivateRedis() as redis_proc:
        for i in range(a.ab_repeat):  # interleaved, so the machine's load falls on each alike
            for t, tree in enumerate(trees):
                run = f"ab{i}t{t}"
                rate, cpu_s = enqueue_from(tree, path, redis_proc.url, work / run, run)
                rates[tree].append(rate)
                cpu[tree].append(1e6 * cpu_s / a.n)
                shutil.rmtree(work / run)
                redis.Redis.from_url(redis_proc.url).flushall()
    med = {tree: statistics.median(r) for tree, r in rates.items()}
    med_cpu = {tree: statistics.median(c) for tree, c in cpu.items()}
    print(f"producer enqueue of the same {a.n:,} short prompts by {len(trees)} checkouts, {a.ab_repeat} times each "
          f"interleaved (no head): median (range), ratio to the first; CPU of the whole process (less moved by "
          "the machine's other load than the rate)")
    for tree in trees:
        label = "this tree" if tree == here else tree.name
        pairs = ", ".join(f"{x / y:.2f}" for x, y in zip(rates[here], rates[tree], strict=True))
        print(f"  {label:<24} : {med[tree]:>10,.0f} prompts/s   ({min(rates[tree]):,.0f}-{max(rates[tree]):,.0f})"
              + ("" if tree == here else f"   this tree / it: {med[here] / med[tree]:.2f}x (per run: {pairs})"))
        cpu_pairs = ", ".join(f"{x / y:.2f}" for x, y in zip(cpu[here], cpu[tree], strict=True))
        print(f"  {'':<24}   {med_cpu[tree]:>10.2f} us CPU a prompt ({min(cpu[tree]):.2f}-{max(cpu[tree]):.2f})"
              + ("" if tree == here else f"   this tree / it: {med_cpu[here] / med_cpu[tree]:.3f}x "
                                         f"(per run: {cpu_pairs})"))
    sys.stdout.flush()


def fewshot_prompts(path: Path, n: int) -> None:
    """`n` prompts of ~1.6 KB: one of 20 few-shot templates (~1.5 KB) and a short question."""
    rng = random.Random(11)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    templates = [" ".join(rng.choices(vocab, k=250)) for _ in range(20)]
    with path.open("wb", buffering=1 << 20) as fh:
        for i in range(n):
            text = f"{templates[rng.randrange(20)]}\nQ: {' '.join(rng.choices(vocab, k=8))}\nA:"
            fh.write(orjson.dumps({"id": f"f{i:08d}", "prompt": text, "max_tokens": 64}) + b"\n")


_REBUILD = """
import resource, sys, time
from pathlib import Path
import producer.store
from producer.store import Store
store = Store.open(Path(sys.argv[1]), run=sys.argv[2])
t0 = time.perf_counter()
with store.write():
    n = store.plan.rebuild()
store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # its pages into the file: part of its cost, not the next's
dt = time.perf_counter() - t0
# the same pass beside a feed loop (what the head does from BACKGROUND_FROM waiting prompts): 64 prompts
# a feed transaction every 20 ms until the pass is installed; the longest feed transaction meanwhile
producer.store.BACKGROUND_FROM = 0
with store.write():
    store.db.execute("UPDATE meta SET value = ? WHERE key = 'plan_stale'", (repr(time.time() - 60),))
t1, longest, passes = time.perf_counter(), 0.0, 0
while passes == 0 or store.plan.building is not None:
    t = time.perf_counter()
    with store.write():
        store.fed_rows(store.next_to_feed(64))
    longest, passes = max(longest, time.perf_counter() - t), passes + 1
    time.sleep(0.02)
beside = time.perf_counter() - t1
store.close()
print(n, dt, beside, longest * 1000, passes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def bench_plan(a: argparse.Namespace, work: Path) -> None:
    """What the plan adds to an enqueue: the same file enqueued with the plan and with --no-plan, interleaved
    (`producer enqueue` computes each prompt's plan key), and the head's one sorted pass that orders the
    plan (`Plan.rebuild`, in a process of its own: its time and peak RSS)."""
    here = Path(__file__).resolve().parents[1]
    files = {"short": (work / "short.jsonl", a.n), "fewshot": (work / "fewshot.jsonl", max(1, a.n // 5))}
    if a.keyed:  # --keyed: N prompts of ~626 B sharing 1,000 openings instead (the 10M case)
        files = {"keyed": (work / "keyed.jsonl", a.n)}
    makers = {"short": short_prompts, "fewshot": fewshot_prompts, "keyed": keyed_prompts}
    for name, (path, n) in files.items():
        if not path.exists():
            makers[name](path, n)
    print(f"the plan at enqueue, {a.ab_repeat} runs of each, interleaved (no head): median (range); CPU of the whole "
          "process; the plan's sorted pass again, alone")
    with PrivateRedis() as redis_proc:
        for name, (path, n) in files.items():
            rates: dict[str, list[float]] = {"plan": [], "no-plan": []}
            cpu: dict[str, list[float]] = {"plan": [], "no-plan": []}
            rebuild: list[tuple[float, float]] = []
            beside: list[tuple[float, float, int]] = []
            for i in range(a.ab_repeat):
                for mode in ("plan", "no-plan"):
                    run = f"pl{i}{mode[0]}"
                    rate, cpu_s = enqueue_from(here, path, redis_proc.url, work / run, run,
                                               *(["--no-plan"] if mode == "no-plan" else []))
                    rates[mode].append(rate)
                    cpu[mode].append(cpu_s)
                    if mode == "plan":
                        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHFLEET_")}
                        env["PYTHONPATH"] = str(here)
                        done = subprocess.run([sys.executable, "-c", _REBUILD, str(work / run / f"{run}.sqlite"), run],
                                              env=env, capture_output=True, text=True, timeout=3600, check=True)
                        _, dt, bdt, longest, passes, rss = done.stdout.split()
                        rebuild.append((float(dt), float(rss)))
                        beside.append((float(bdt), float(longest), int(passes)))
                    shutil.rmtree(work / run)
                    redis.Redis.from_url(redis_proc.url).flushall()
            mp, mn = statistics.median(cpu["plan"]), statistics.median(cpu["no-plan"])
            rb = statistics.median(x for x, _ in rebuild)
            print(f"  {name} ({n:,} prompts, {path.stat().st_size / n:,.0f} B a line)")
            for mode in ("plan", "no-plan"):
                print(f"    {mode:<8}: {statistics.median(rates[mode]):>10,.0f} prompts/s "
                      f"({min(rates[mode]):,.0f}-{max(rates[mode]):,.0f}), {statistics.median(cpu[mode]):.1f} s CPU "
                      f"({min(cpu[mode]):.1f}-{max(cpu[mode]):.1f})")
            print(f"    plan / no-plan, CPU of the enqueue: {mp / mn:.3f}x (goal <= 1.10)")
            print(f"    the sorted pass alone, inside one feed transaction: {rb:.2f} s (the feed waits all along); "
                  f"beside a feed of 64 prompts every 20 ms: {statistics.median(b for b, _, _ in beside):.2f} s "
                  f"to install, the longest feed transaction meanwhile {max(x for _, x, _ in beside):.0f} ms "
                  f"({sum(p for _, _, p in beside):,} transactions); peak RSS {max(r for _, r in rebuild):,.0f} MiB")
    sys.stdout.flush()


def bench_layout(a: argparse.Namespace, work: Path) -> None:
    queues = tuple(f"gpu{i}" for i in range(a.queues))
    path = work / "worded.jsonl"
    text_b = worded_prompts(path, a.layout_n, a.words)
    best: dict[str, float] = {}
    with PrivateRedis() as redis_proc:
        r = redis.Redis.from_url(redis_proc.url)
        for _ in range(a.repeat):
            for name in ("rq enqueue_many", "batchfleet job", "batchfleet, listpack"):
                r.config_set("hash-max-listpack-value", 1024 if name.endswith("listpack") else 64)
                r.flushall()
                shutil.rmtree(work / "layout", ignore_errors=True)
                before = used(r)
                if name == "rq enqueue_many":
                    rq_enqueue_many(r, path, a.layout_n, queues, "layout")
                else:
                    config = Config(run="layout", redis_url=redis_proc.url, state_dir=work / "layout",
                                    window_default=a.layout_n, window_max=a.layout_n)
                    done = enqueue(config, r, path, queues=queues)
                    done.store.close()
                    assert done.fed.total == a.layout_n, done.fed
                assert sum(r.llen(f"rq:queue:{q}") for q in queues) == a.layout_n
                per = (used(r) - before) / a.layout_n - text_b
                best[name] = min(best.get(name, per), per)
    print(f"Redis bytes per queued prompt beyond its text ({a.layout_n:,} prompts of {a.words} words, mean text "
          f"{text_b:.0f} B, Redis default config, best of {a.repeat})")
    print(f"  rq enqueue_many          : {best['rq enqueue_many']:>+7,.0f} B   (9 hash fields, zlib data)")
    print(f"  batchfleet job           : {best['batchfleet job']:>+7,.0f} B   (data, origin, status; goal <= 600)")
    print(f"  ratio                    : {best['batchfleet job'] / best['rq enqueue_many']:>7.2f}x")
    print(f"  (batchfleet job with the Redis server's hash-max-listpack-value 1024: "
          f"{best['batchfleet, listpack']:+,.0f} B: a job hash then stays a compact listpack)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="short prompts enqueued into the store")
    ap.add_argument("--keyed", action="store_true",
                    help="store, plan: prompts of ~640 B sharing 1,000 openings, which the plan keys and sorts")
    ap.add_argument("--baseline-n", type=int, default=200_000, help="of them through rq enqueue_many")
    ap.add_argument("--layout-n", type=int, default=50_000)
    ap.add_argument("--words", type=int, default=60, help="words per prompt in the layout measure")
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("store", "layout", "against", "plan"),
                    help="one measure (against: only the checkouts' comparison, which needs --against)")
    ap.add_argument("--against", metavar="DIR", action="append", default=[],
                    help="also enqueue the same file with the code of this checkout (repeatable)")
    ap.add_argument("--ab-repeat", type=int, default=3, help="runs of each tree with --against")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-enqueue-") as tmp:
        if a.only in (None, "store"):
            bench_store(a, Path(tmp))
        if a.only in (None, "store", "against") and a.against:
            bench_against(a, Path(tmp))
        if a.only in (None, "plan"):
            bench_plan(a, Path(tmp))
        if a.only in (None, "layout"):
            bench_layout(a, Path(tmp))


if __name__ == "__main__":
    main()
