"""The continuous-batching scheduler: waiting queue, admission, prefill, decode, in model time.

CPU matters more than fidelity here (8 simulators and 8 workers share 2 cores), so nothing sleeps
per token: one ticker wakes every TICK_S of wall time, turns the elapsed wall time into model time
(x SGLANG_SIM_TIME_SCALE) and lets each dp rank run as many prefill batches and decode steps as
fit, jumping over runs of identical decode steps in one pass (every running request gains one
token per step, so k steps are one addition).

A rank's clock `t` is the end of its latest forward. It starts no forward before the global clock
reaches `t` (the GPU is busy until then), and the requests a forward finishes are answered only
once the global clock reaches that forward's end (`Rank.answer_due`): so a rank may run ahead of
the global clock by at most one forward, and a request's wall latency is at least its forwards'
model time / SGLANG_SIM_TIME_SCALE, prefill-only (embedding) requests included.

Mamba slots a running request *holds* (for `mamba usage`) differ from the `ratio` it *reserves*
for admission: 1 working slot, plus (ratio - 3) tracking slots under extra_buffer variants, plus
one locked cached-prefix state per two running requests while the radix cache is on. Under the
seed default that is 32 * 3 + 16 = 112 of 187 slots (0.60) with 32 running.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .fatal import SITE_PACKAGES, SchedulerError, die_in_scheduler
from .faults import Faults
from .logs import log
from .memory import MemoryPlan
from .metrics import Metrics
from .parallel import Layout
from .profiles import Profile
from .radix_cache import CacheConfig, RequestCache

if TYPE_CHECKING:
    from .lora import Registry, SlotPool

__all__ = ["Engine", "EngineConfig", "QueueFullError", "Request", "embedding_request"]

TICK_S = 0.015
NEW_TOKEN_RATIO = 0.3
MAX_SWITCHES = 2000  # adapter loads the record keeps (the latest)


class QueueFullError(Exception):
    pass


@dataclass(eq=False)
class Request:
    rid: str
    prompt_words: list[str]
    output_words: list[str]
    finish_reason: str  # "stop" | "length" once all output words are out
    matched_stop: str | None
    endpoint: str
    internal: bool = False  # health probes: not counted in metrics, record or faults
    arrival_model: float = 0.0
    admitted_model: float | None = None
    first_token_model: float | None = None
    finish_model: float | None = None
    cached_tokens: int = 0  # reused at the first prefill (meta_info; a retracted request keeps it)
    generated: int = 0
    state: str = "waiting"  # waiting | running | finished | aborted
    priority: int | None = None  # the request's `priority` (priority scheduling)
    abort_message: str | None = None
    abort_status: int = 200
    retractions: int = 0
    # radix cache (radix_cache.py): the locked node, the tokens the tree owns, this admission's reuse
    cache_node: Any = None
    cache_len: int = 0
    prefix_len: int = 0
    branching: int | None = None
    prefill_end: int = 0
    log_entry: list | None = None  # the request's row of the observation record, when it keeps one
    adapter: str | None = None  # the LoRA adapter's name (None: the base model)
    lora_id: str | None = None  # ... and its id: the slot it needs, the radix namespace
    embedding: bool = False  # an embedding request (prefill only; its vector is made when answered)
    crash_on_decode: bool = False  # a generation that would decode on an embedding server (see Rank)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_tokens: int = field(init=False)  # max(1, words): read in every admission pass, so kept

    def __post_init__(self) -> None:
        self.prompt_tokens = max(1, len(self.prompt_words))

    @property
    def remaining(self) -> int:
        return len(self.output_words) - self.generated

    @property
    def reserve_tokens(self) -> int:
        # Like SGLang, admission budgets only a share of the tokens still to come (new_token_ratio);
        # if the pool fills anyway, decode retracts requests (see Rank._retract).
        return self.prompt_tokens + self.generated + int(min(self.remaining, 4096) * NEW_TOKEN_RATIO)


def embedding_request(tokens: list[str], *, rid: str, endpoint: str, adapter: Any = None,
                      internal: bool = False) -> Request:
    """An embedding request (prefill only) of `tokens` on `adapter` (a lora.Adapter, None: the base)."""
    return Request(rid=rid, prompt_words=tokens, output_words=[], finish_reason="length", matched_stop=None,
                   endpoint=endpoint, internal=internal, adapter=adapter.name if adapter else None,
                   lora_id=adapter.lora_id if adapter else None, embedding=True)


@dataclass(frozen=True)
class EngineConfig:
    profile: Profile
    plan: MemoryPlan
    strategy: str
    overlap: bool
    radix: bool
    decode_log_interval: int
    time_scale: float
    max_queued: int | None
    layout: Layout = field(default_factory=Layout)
    page_size: int = 1  # --page-size
    track_interval: int = 256  # --mamba-track-interval
    embedding: bool = False  # --is-embedding: every request is prefill only
    prefill_max_requests: int | None = None  # --prefill-max-requests
    lora: Registry | None = None  # LoRA on: the adapters (the server's) and the pool's shapes
    lora_load_s: Any = None  # lora_id -> model seconds one load into a slot costs
    # --enable-priority-scheduling: the waiting queue in (priority, arrival) order, higher values first
    # unless --schedule-low-priority-values-first; a request without one gets the lowest
    priority_scheduling: bool = False
    low_priority_first: bool = False

    def cache_config(self) -> CacheConfig:
        chunk = self.plan.chunked_prefill_size
        return CacheConfig(enabled=self.radix, hybrid=self.profile.hybrid, strategy=self.strategy,
                           page=self.page_size, chunk=chunk if chunk > 0 else 1 << 62,
                           track_interval=self.track_interval)

    @property
    def prefill_budget(self) -> int:
        """New tokens one prefill batch takes: `--chunked-prefill-size` (rem_chunk_tokens) and
        `--max-prefill-tokens` (rem_input_tokens), whichever binds; chunking off (-1): the latter."""
        chunk = self.plan.chunked_prefill_size
        return min(chunk, self.plan.max_prefill_tokens) if chunk > 0 else self.plan.max_prefill_tokens

    @property
    def live_mamba_slots(self) -> int:
        """Mamba slots a running request holds of its own: 1 working slot, plus the tracking slots of
        extra_buffer variants (2 at ratio 5, 1 at ratio 4)."""
        return self.plan.ratio - 2 if self.strategy.startswith("extra_buffer") else 1

    def decode_step_s(self, batch: int) -> float:
        """One decode step of `batch` requests on this server's group (parallel.py's speed model)."""
        return self.profile.decode_step_s(self.layout.micro_batch(batch)) * self.layout.step_factor

    def prefill_s(self, new_tokens: int) -> float:
        return self.profile.prefill_s(new_tokens) * self.layout.step_factor


class Rank:
    """One data-parallel rank: its own queue, batch and memory pools."""

    def __init__(self, engine: Engine, index: int, prefix: str = "") -> None:
        self.engine, self.index, self.prefix = engine, index, prefix
        cfg = engine.cfg
        self.cap = cfg.plan.effective_max_running
        self.tokens = cfg.plan.max_total_num_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.t = 0.0  # this rank's model clock: the end of its latest forward (see the module doc)
        self.answer_due = False  # the latest forward finished requests, answered once the clock reaches t
        self.decode_steps = 0
        self.cache = RequestCache(cfg.cache_config())
        self.last_prefill_t = 0.0
        self.last_log_t, self.last_log_tokens, self.gen_tokens = 0.0, 0, 0
        self.gen_throughput = 0.0
        self.hung = False
        self.idle_since: float | None = None
        # Slot fill, in model time: occupied slot-seconds so far, and (model time, slot-seconds) when
        # the rank first ran `cap` requests and at its latest admission of a client request.
        self.slot_s = 0.0
        self.full_at: tuple[float, float] | None = None
        self.last_admit: tuple[float, float] | None = None
        self.first_admit: tuple[float, float] | None = None  # ... just before its first client request's prefill
        self.longest_s = 0.0  # the longest admission-to-finish of a client request, in model time
        self.slots: SlotPool | None = engine.new_slot_pool()  # LoRA's GPU pool, when LoRA is on
        # what `#running-req` and num_running_reqs read on an embedding server (its running batch is
        # the previous prefill batch, under the overlap schedule, while the next one is formed)
        self.shown_running = 0
        self.last_prefill_n = 0

    # ---- usage figures -------------------------------------------------------------------
    def private_tokens(self) -> int:
        """KV of running requests that the radix tree does not hold."""
        return sum(r.prompt_tokens + r.generated - r.cache_len for r in self.running)

    def used_tokens(self) -> int:
        """SGLang's num_used: the pool less free and evictable tokens (cached tokens no running request
        locks count as free)."""
        return self.private_tokens() + self.cache.protected

    def _make_room(self, tokens: int) -> None:
        """Evict unlocked cached tokens (LRU leaves) until `tokens` more fit in the pool, as the
        allocator does before it allocates (`evict_from_tree_cache`)."""
        over = self.private_tokens() + self.cache.tree.total + tokens - self.tokens
        if over > 0:
            self.cache.tree.evict_tokens(over)

    def _fit_states(self) -> None:
        """Cached mamba states share the pool with running requests' own slots: evict the least
        recently used unlocked ones past what is left (SGLang evicts when a slot allocation fails)."""
        cfg = self.engine.cfg
        if not (cfg.profile.hybrid and cfg.radix):
            return
        room = max(0, cfg.plan.mamba_pool - len(self.running) * cfg.live_mamba_slots)
        tree = self.cache.tree
        if tree.states > room:
            tree.evict_states(tree.states - room)

    def _mamba_slot_free(self) -> bool:
        cfg = self.engine.cfg
        return cfg.plan.mamba_pool - len(self.running) * cfg.live_mamba_slots - self.cache.tree.states > 0

    def mamba_used(self) -> int:
        cfg = self.engine.cfg
        if not cfg.profile.hybrid:
            return 0
        n = len(self.running)
        if not cfg.radix:
            return n
        live = cfg.plan.ratio - 2 if cfg.strategy.startswith("extra_buffer") else 1
        return n * live + math.ceil(n / 2)

    def full_usage(self) -> float:
        return self.used_tokens() / self.tokens

    def mamba_usage(self) -> float:
        pool = self.engine.cfg.plan.mamba_pool
        return self.mamba_used() / pool if pool else 0.0

    def _log(self, msg: str) -> None:
        log(msg, prefix=self.prefix)

    def step_batch(self) -> int:
        """The batch a decode step is priced on: this rank's, or with attention DP the whole TP
        group's, whose ranks step in lock-step (parallel.py)."""
        return self.engine.running if self.engine.cfg.layout.attn_dp > 1 else len(self.running)

    def _usage_text(self) -> str:
        if self.engine.cfg.profile.hybrid:
            return (f"#full token: {self.used_tokens()}, full token usage: {self.full_usage():.2f}, "
                    f"mamba num: {self.mamba_used()}, mamba usage: {self.mamba_usage():.2f}")
        return f"#token: {self.used_tokens()}, token usage: {self.full_usage():.2f}"

    # ---- scheduling ----------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        """FCFS admission. Each candidate is matched and its prefix locked first, so the budget sees
        its cached tokens as in use and every other cached token as free (PrefillAdder.add_one_req)."""
        batch: list[Request] = []
        cfg = self.engine.cfg
        budget, max_requests = cfg.prefill_budget, cfg.prefill_max_requests
        cache = self.cache
        reserved = cache.protected + sum(r.reserve_tokens - r.cache_len for r in self.running)
        new_tokens = 0
        pool = self.slots
        loras = {r.lora_id for r in self.running} if pool is not None else set()
        skipped: list[Request] = []
        while self.waiting and len(self.running) + len(batch) < self.cap:
            if max_requests and len(batch) >= max_requests:
                break
            req = self.waiting[0]
            if req.state != "waiting":
                self.waiting.popleft()
                continue
            if pool is not None and req.lora_id not in loras and not pool.fits(loras, req.lora_id):
                # can_schedule_lora_req: its adapter would exceed --max-loras-per-batch; it stays queued
                # and later requests whose adapters run already pass it
                skipped.append(self.waiting.popleft())
                continue
            if (self.running or batch) and reserved + req.reserve_tokens - req.prompt_tokens - req.generated >= \
                    self.tokens:  # cannot fit whatever it reuses: spare the match (CPU)
                break
            cached, moved = cache.admit(req)
            need = reserved + moved + req.reserve_tokens - cached
            whole = reserved + moved + req.prompt_tokens + len(req.output_words) - cached
            if need > self.tokens or (req.retractions and whole > self.tokens):
                cache.release(req)
                if not self.running and not batch:  # cannot fit even alone
                    self.waiting.popleft()
                    self.engine.finish_abort(req, "Input is too long to fit in the KV cache.", status=500)
                    continue
                break
            extend = req.prompt_tokens + req.generated - cached
            if batch and new_tokens + extend > budget:
                cache.release(req)
                break
            self.waiting.popleft()
            if not req.retractions:
                req.cached_tokens = cached
                if req.log_entry is not None:
                    req.log_entry[2] = cached
                    self.engine.admit_log.append([req.rid, len(self.engine.request_log or ())])
            batch.append(req)
            loras.add(req.lora_id)
            reserved = need
            new_tokens += extend
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        return batch

    def advance(self, now: float) -> None:
        """Run prefill batches and decode steps until this rank's clock reaches `now`: each forward
        starts at or before `now` (the last may end after it), and what a forward finishes is answered
        at the first call whose `now` has reached the forward's end."""
        engine, cfg = self.engine, self.engine.cfg
        while True:
            if self.hung or self.t > now:  # a forward runs until t: nothing starts, nothing it finishes is out
                return
            if self.answer_due:
                self.answer_due = False
                self._retire(engine)
            batch = self._admit()
            if batch and self.running and min(r.arrival_model for r in batch) > self.t:
                # The batch arrived after this rank's clock: the GPU did not sit idle waiting for it,
                # it kept decoding, and the prefill follows the step in progress. (Jumping the clock
                # to the arrival would idle every running request for up to a step per admission.)
                for r in batch:
                    self.cache.release(r)
                self.waiting.extendleft(reversed(batch))
                step = cfg.decode_step_s(self.step_batch())
                self._decode(math.ceil((min(r.arrival_model for r in batch) - self.t) / step))
                continue
            if batch:
                new_tokens = sum(r.prompt_tokens + r.generated - r.prefix_len for r in batch)
                self._make_room(new_tokens)  # the extend's KV is allocated before the forward
                self.t = max(self.t, min(r.arrival_model for r in batch))
                if self.first_admit is None and any(not r.internal for r in batch):
                    self.first_admit = (self.t, self.slot_s)
                start = self.t
                prefill = cfg.prefill_s(new_tokens) + engine.load_adapters(self, {r.lora_id for r in batch})
                self.slot_s += prefill * (len(self.running) + len(batch))  # the batch holds its slots already
                self.t += prefill
                for r in batch:
                    r.state, r.admitted_model = "running", self.t
                    self.running.append(r)
                    engine.on_admitted(r)
                    self.cache.prefilled(r)  # the chunk-end and end-of-prefill checkpoints
                    if r.first_token_model is None:  # a re-admitted (retracted) request keeps its output
                        r.generated = min(1, len(r.output_words))  # prefill samples the first token
                        r.first_token_model = self.t
                        self.gen_tokens += r.generated
                    r.changed.set()
                self._fit_states()
                engine.metrics.on_prefill(batch, self.t)
                if self.full_at is None and len(self.running) >= self.cap:
                    self.full_at = (self.t, self.slot_s)
                if any(not r.internal for r in batch):
                    self.last_admit = (self.t, self.slot_s)
                self._log(_prefill_line(self, batch, new_tokens, start))
                if any(r.crash_on_decode for r in batch):
                    _die_decoding_embeddings(self.prefix)
                self.answer_due = True  # answered at the forward's end (the loop's top)
                continue
            if not self.running:
                self.t = max(self.t, now)
                # Idle time must not dilute the next throughput window; after 1 s idle report 0.
                if self.idle_since is None:
                    self.idle_since = self.t
                elif self.t - self.idle_since > 1.0:
                    self.gen_throughput = 0.0
                self.last_log_t, self.last_log_tokens = self.t, self.gen_tokens
                return
            self.idle_since = None
            fit = int((now - self.t) / cfg.decode_step_s(self.step_batch()))
            if fit <= 0:
                return
            self._decode(fit)

    def _decode(self, steps: int) -> None:
        """Up to `steps` decode steps, stopping early at a finish, a log line or a full KV pool."""
        engine = self.engine
        self._retract()
        if self.slots is not None:  # the decode forward needs its adapters in the pool too
            self.t += engine.load_adapters(self, {r.lora_id for r in self.running})
        step = engine.cfg.decode_step_s(self.step_batch())
        interval = self.engine.cfg.decode_log_interval
        to_log = interval - self.decode_steps % interval
        room = max(1, (self.tokens - self.used_tokens()) // len(self.running))
        k = min(steps, min(r.remaining for r in self.running), to_log, room)
        k = max(k, 1)
        self._make_room(k * len(self.running))  # check_decode_mem evicts before it retracts
        self.slot_s += k * step * len(self.running)
        self.t += k * step
        self.decode_steps += k
        for r in self.running:
            r.generated += k
            r.changed.set()
        self.gen_tokens += k * len(self.running)
        engine.metrics.generation_tokens += k * sum(1 for r in self.running if not r.internal)
        if self.decode_steps % interval == 0:
            self._decode_log()
        self.answer_due = True  # answered at the steps' end (advance's loop top)

    def _retract(self) -> None:
        """Free KV when the next step would overflow it: newest requests go back to the queue head."""
        retracted: list[Request] = []
        while len(self.running) > 1 and self.used_tokens() + len(self.running) > self.tokens:
            victim = min(self.running, key=lambda r: (r.generated, -r.prompt_tokens))
            self.running.remove(victim)
            self.cache.release(victim)  # its KV is freed, not inserted: the pool needs the room now
            victim.state, victim.retractions = "waiting", victim.retractions + 1
            retracted.append(victim)
        if retracted:
            self.waiting.extendleft(reversed(retracted))
            self.engine.metrics.retracted += len(retracted)
            self._log(f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                      f"#new_token_ratio: {NEW_TOKEN_RATIO:.4f} -> {NEW_TOKEN_RATIO:.4f}")

    def _decode_log(self) -> None:
        span = self.t - self.last_log_t
        if span > 0:
            self.gen_throughput = (self.gen_tokens - self.last_log_tokens) / span
        self.last_log_t, self.last_log_tokens = self.t, self.gen_tokens
        graph = len(self.running) <= (self.engine.cfg.plan.effective_max_running)
        self._log(
            f"Decode batch, #running-req: {len(self.running)}, {self._usage_text()}, "
            f"cuda graph: {graph}, gen throughput (token/s): {self.gen_throughput:.2f}, "
            f"#queue-req: {len(self.waiting)}"
        )

    def _retire(self, engine: Engine) -> None:
        still = []
        for r in self.running:
            if r.state == "aborted":
                self.cache.release(r)
                continue
            if r.remaining <= 0:
                r.state, r.finish_model = "finished", self.t
                if not r.internal:
                    engine.last_finish_wall = time.time()
                    if r.admitted_model is not None:
                        self.longest_s = max(self.longest_s, self.t - r.admitted_model)
                self.cache.finished(r, slot_free=self._mamba_slot_free())
                engine.metrics.on_finish(r)
                engine.release_adapter(r)
                r.changed.set()
                r.done.set()
            else:
                still.append(r)
        self.running = still
        self._fit_states()

    def drop_aborted(self) -> None:
        for r in self.running:
            if r.state != "running":
                self.cache.release(r)
        self.running = [r for r in self.running if r.state == "running"]


def _prefill_line(rank: Rank, batch: list[Request], new_tokens: int, start: float) -> str:
    """The scheduler's `Prefill batch` line (metrics_reporter.report_prefill_stats) for a batch whose
    forward began at `start`."""
    cfg = rank.engine.cfg
    if cfg.embedding:
        # its running batch holds the previous prefill batch while this one is formed (overlap schedule,
        # back to back), else nothing: embedding requests finish in their prefill
        rank.shown_running = rank.last_prefill_n if cfg.overlap and start <= rank.last_prefill_t else 0
        rank.last_prefill_n = len(batch)
    if cfg.profile.hybrid:
        usage = f"full token usage: {rank.full_usage():.2f}, mamba usage: {rank.mamba_usage():.2f}"
    else:
        usage = f"token usage: {rank.full_usage():.2f}"
    gap, rank.last_prefill_t = rank.t - rank.last_prefill_t, rank.t
    pending = sum(q.prompt_tokens + q.generated for q in rank.waiting if q.state == "waiting")
    running = rank.shown_running if cfg.embedding else len(rank.running)
    return (f"Prefill batch, #new-seq: {len(batch)}, #new-token: {new_tokens}, "
            f"#cached-token: {sum(r.prefix_len for r in batch)}, {usage}, "
            f"#running-req: {running}, #queue-req: {len(rank.waiting)}, "
            f"#pending-token: {pending}, cuda graph: False, "
            f"input throughput (token/s): {new_tokens / gap if gap > 0 else 0.0:.2f}")


def _die_decoding_embeddings(prefix: str) -> None:
    """A generation request with max_new_tokens > 1 on an embedding server: after its prefill it stays in
    the running batch, the next (decode) step hands `process_batch_result_decode` an EmbeddingBatchResult,
    and the scheduler dies on it, taking the server down (read from 0.5.23's code, not run)."""
    srt = f"{SITE_PACKAGES}/sglang/srt/managers"
    die_in_scheduler([(SchedulerError(
        "AttributeError: 'EmbeddingBatchResult' object has no attribute 'auxiliary_host_output'",
        after_load=False, frames=(
            (f"{srt}/scheduler.py", 6390, "run_scheduler_process", "scheduler.run_event_loop()"),
            (f"{srt}/scheduler.py", 1532, "event_loop_overlap", "self.process_batch_result(tmp_batch, tmp_result)"),
            (f"{srt}/scheduler_components/batch_result_processor.py", 959, "process_batch_result_decode",
             "auxiliary_output_starts = self.snapshot_auxiliary_output_starts(batch, result)"),
            (f"{srt}/scheduler_components/batch_result_processor.py", 223, "snapshot_auxiliary_output_starts",
             "if result.auxiliary_host_output is None:"),
        )), prefix)])


class Engine:
    def __init__(self, cfg: EngineConfig, *, faults: Faults, metrics: Metrics) -> None:
        self.cfg, self.faults, self.metrics = cfg, faults, metrics
        # LoRA: loads into a GPU slot per adapter name, and [model s, dp rank, loaded, evicted] per load
        self.lora_loads: Counter[str] = Counter()
        self.lora_switches: list[list] = []
        self.peak_adapters = 0  # the most distinct adapters (the base counting) one rank's forward ran with
        stats = cfg.layout.stats_ranks()  # the rank of each DP rank that logs its batches
        self.ranks = [Rank(self, i, stats[i].prefix(cfg.layout)) for i in range(cfg.layout.num_dp_ranks)]
        self._wall0 = time.monotonic()
        self._next_rank = 0
        self.admitted_total = 0
        self.first_admit_wall: float | None = None  # time.time() of the first client admission
        self.last_finish_wall: float | None = None  # ... and of the latest client finish
        self.peak_running = 0
        self.peak_queued = 0
        self.on_tick: list = []  # callbacks after each tick (observation record)
        # [rid, prompt tokens, cached tokens, sha1 of the first 32 words (12 hex)] per client request, in
        # arrival order, when the observation record lists them (SGLANG_SIM_RECORD_REQUESTS=1); with LoRA
        # on, a fifth entry: the adapter's name (None: the base model)
        self.request_log: list[list] | None = None
        # with request_log: [rid, requests arrived by then] of the client requests in the order first admitted
        self.admit_log: list[list] = []
        self._task: asyncio.Task | None = None

    def model_now(self) -> float:
        return (time.monotonic() - self._wall0) * self.cfg.time_scale

    @property
    def running(self) -> int:
        return sum(len(r.running) for r in self.ranks)

    @property
    def queued(self) -> int:
        """Requests waiting (a waiting queue holds no other: `finish_abort` takes an aborted one out). Read every
        tick: a sum over each queue cost ~0.2 of a core per server with 4,000 queued embeddings."""
        return sum(len(r.waiting) for r in self.ranks)

    @property
    def reported_running(self) -> int:
        """num_running_reqs as the scheduler reports it (an embedding server: see Rank.shown_running)."""
        return sum(r.shown_running for r in self.ranks) if self.cfg.embedding else self.running

    def new_slot_pool(self) -> SlotPool | None:
        if self.cfg.lora is None:
            return None
        from .lora import SlotPool

        settings = self.cfg.lora.settings
        return SlotPool(settings.max_loras_per_batch, settings.eviction_policy, self.cfg.lora.pinned_ids)

    def load_adapters(self, rank: Rank, ids: set[str | None]) -> float:
        """Model seconds a forward of `rank` needing adapters `ids` spends loading them into its GPU pool."""
        if rank.slots is None:
            return 0.0
        self.peak_adapters = max(self.peak_adapters, len(ids | {r.lora_id for r in rank.running}))
        return sum(self.on_lora_load(rank.index, lora_id, victim) for lora_id, victim in rank.slots.ensure(ids))

    def on_lora_load(self, rank: int, lora_id: str, victim: str | None) -> float:
        """An adapter was loaded into a GPU slot of `rank` (evicting `victim`): count it; its cost."""
        reg = self.cfg.lora
        assert reg is not None
        name = reg.known[lora_id].name
        self.lora_loads[name] += 1
        gone = None if victim is None else reg.known[victim].name
        self.lora_switches.append([round(self.ranks[rank].t, 6), rank, name, gone])
        del self.lora_switches[:-MAX_SWITCHES]
        return self.cfg.lora_load_s(lora_id)

    def release_adapter(self, req: Request) -> None:
        if self.cfg.lora is not None and req.lora_id is not None:
            self.cfg.lora.release(req.lora_id)

    @property
    def gen_throughput(self) -> float:
        return sum(r.gen_throughput for r in self.ranks)

    def submit(self, req: Request) -> None:
        """Queue a request on the next dp rank (round robin); QueueFullError past --max-queued-requests."""
        rank = self.ranks[self._next_rank % len(self.ranks)]
        # Requests the next scheduling step will admit are not "queued" (they arrived within a tick).
        if self.cfg.max_queued is not None and not req.internal and \
                len(rank.waiting) - max(0, rank.cap - len(rank.running)) >= self.cfg.max_queued:
            raise QueueFullError("The request queue is full.")
        req.arrival_model = self.model_now()
        self._next_rank += 1
        if self.request_log is not None and not req.internal:
            head = " ".join(req.prompt_words[:32]).encode()
            req.log_entry = [req.rid, req.prompt_tokens, 0, hashlib.sha1(head).hexdigest()[:12]]
            if self.cfg.lora is not None:  # a LoRA server's rows name the adapter too
                req.log_entry.append(req.adapter)
            self.request_log.append(req.log_entry)
        if self.cfg.priority_scheduling:
            self._queue_by_priority(rank, req)
        else:
            rank.waiting.append(req)

    def _queue_by_priority(self, rank: Rank, req: Request) -> None:
        """SGLang 0.5.23's FCFS with priority scheduling (`SchedulePolicy._sort_by_priority_and_fcfs`:
        the waiting queue sorted by priority, then arrival): behind every request of its priority or a
        better one. A request without a priority gets the worst (`_set_or_validate_priority`)."""
        sign = 1 if self.cfg.low_priority_first else -1
        if req.priority is None:
            req.priority = sys.maxsize if self.cfg.low_priority_first else -sys.maxsize - 1
        key = sign * req.priority
        at = len(rank.waiting)
        while at > 0 and sign * (rank.waiting[at - 1].priority or 0) > key:
            at -= 1
        rank.waiting.insert(at, req)

    def on_admitted(self, req: Request) -> None:
        self.peak_running = max(self.peak_running, self.running)
        if req.internal:
            return
        self.admitted_total += 1
        if self.first_admit_wall is None:
            self.first_admit_wall = time.time()
        self.faults.on_admitted(self.admitted_total, self, req.prompt_words)

    def finish_abort(self, req: Request, message: str, *, status: int = 200, dequeue: bool = True) -> None:
        """End `req` aborted. A queued one leaves its waiting queue (`dequeue`; False: the caller rebuilds the
        queues), so that a waiting queue holds only waiting requests and `queued` is its length."""
        if req.state in ("finished", "aborted"):
            return
        if dequeue and req.state == "waiting":
            for rank in self.ranks:
                if req in rank.waiting:
                    rank.waiting.remove(req)
                    break
        req.state, req.abort_message, req.finish_model = "aborted", message, self.model_now()
        req.abort_status = status
        if not req.internal:
            self.metrics.aborted += 1
        self.release_adapter(req)
        req.changed.set()
        req.done.set()

    def abort(self, rid: str | None, *, abort_all: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (or all); returns how many."""
        n = 0
        for rank in self.ranks:
            for req in [*rank.running, *rank.waiting]:
                if req.internal or req.state in ("finished", "aborted"):
                    continue
                if abort_all or (rid and req.rid.startswith(rid)):
                    self.finish_abort(req, "Abort request." if not abort_all else "Abort all requests.", dequeue=False)
                    n += 1
            rank.drop_aborted()
            if n:
                rank.waiting = deque(q for q in rank.waiting if q.state == "waiting")
        return n

    def flush_cache(self) -> bool:
        if self.running or self.queued:
            return False
        for rank in self.ranks:
            rank.cache.tree.flush()
        return True

    def hang(self) -> None:
        for rank in self.ranks:
            rank.hung = True

    def tick(self) -> None:
        now = self.model_now()
        for rank in self.ranks:
            rank.advance(now)
        self.peak_running = max(self.peak_running, sum(len(r.running) for r in self.ranks))
        self.peak_queued = max(self.peak_queued, self.queued)
        for cb in self.on_tick:
            cb()

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
