"""Prometheus text for `/metrics` (only with --enable-metrics), with SGLang's names and labels.

Latencies are observed in model seconds so that a supervisor reads the same figures it would
read on real GPUs whatever SGLANG_SIM_TIME_SCALE is.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine, Request

__all__ = ["Histogram", "Metrics"]

_LAT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 2400)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = _LAT_BUCKETS) -> None:
        self.buckets = buckets
        self._hits = [0] * (len(buckets) + 1)  # per bucket, not cumulative (one bisect per observation)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        self._hits[bisect_left(self.buckets, value)] += 1

    @property
    def counts(self) -> list[int]:
        """Cumulative counts per `le` bucket, as Prometheus reads them."""
        out, total = [], 0
        for hits in self._hits[:-1]:
            total += hits
            out.append(total)
        return out


class Metrics:
    """Counters and histograms fed by the engine; gauges are read from it when scraped."""

    def __init__(self) -> None:
        self.prompt_tokens = 0  # client prompts at their first prefill (prompt_tokens_total)
        self.cached_tokens = 0  # ... the tokens they reused then
        self.cached_finished = 0  # reused tokens of finished requests (cached_tokens_total, counted at finish)
        self.cache_hit_rate = 0.0  # of the latest prefill batch (below)
        self.generation_tokens = 0
        self.requests = 0
        self.aborted = 0
        self.retracted = 0
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.queue = Histogram()

    def on_prefill(self, batch: list[Request], now: float) -> None:
        """`sglang:cache_hit_rate` is the latest prefill batch's reused / (reused + computed) prompt
        tokens, retracted requests left out (0 when only they ran), set each time a prefill batch is
        reported (SchedulerMetricsReporter.report_prefill_stats); decode reports leave it alone."""
        hit = computed = 0
        clients = False
        for r in batch:
            if r.internal:
                continue
            clients = True
            if r.retractions:  # a re-admitted request was observed the first time
                continue
            hit += r.prefix_len
            computed += r.prefill_end - r.prefix_len
            self.prompt_tokens += r.prompt_tokens
            self.cached_tokens += r.cached_tokens
            self.ttft.observe(now - r.arrival_model)
            self.queue.observe((r.admitted_model or now) - r.arrival_model)
        if clients:
            self.cache_hit_rate = hit / (hit + computed) if hit + computed else 0.0

    def on_finish(self, r: Request) -> None:
        if r.internal:
            return
        self.requests += 1
        self.cached_finished += r.cached_tokens
        self.e2e.observe((r.finish_model or 0.0) - r.arrival_model)

    def render(self, engine: Engine, model_name: str) -> str:
        labels = f'engine_type="unified",model_name="{model_name}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, value: Any, lab: str = labels) -> None:
            out.append(f"# HELP sglang:{name} {doc}")
            out.append(f"# TYPE sglang:{name} {kind}")
            out.append(f"sglang:{name}{{{lab}}} {float(value)}")

        ranks = engine.ranks
        full = max(r.full_usage() for r in ranks)
        mamba = max(r.mamba_usage() for r in ranks)
        plan = engine.cfg.plan
        metric("num_running_reqs", "gauge", "The number of running requests.", engine.reported_running)
        metric("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", engine.queued)
        metric("gen_throughput", "gauge", "The generation throughput (token/s).", engine.gen_throughput)
        metric("token_usage", "gauge", "The token usage (max of full and mamba on hybrids).", max(full, mamba))
        metric("full_token_usage", "gauge", "The full-attention KV token usage.", full)
        metric("mamba_usage", "gauge", "The mamba state slot usage.", mamba)
        metric("num_used_tokens", "gauge", "The number of used tokens.", sum(r.used_tokens() for r in ranks))
        metric("cache_hit_rate", "gauge", "The prefix cache hit rate.", self.cache_hit_rate)
        metric("num_retracted_reqs", "gauge", "The number of retracted requests.", 0)
        metric("max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV pool.",
               plan.max_total_num_tokens)
        metric("context_len", "gauge", "The context length.", plan.context_len)
        if engine.cfg.lora is not None:  # metrics_reporter._update_lora_metrics (the base model not counted)
            used = max(len({q.lora_id for q in r.running} - {None}) for r in ranks)
            slots = engine.cfg.lora.settings.max_loras_per_batch
            metric("lora_pool_slots_used", "gauge", "Number of LoRA adapter slots currently occupied in GPU memory.",
                   used)
            metric("lora_pool_slots_total", "gauge",
                   "Total number of LoRA adapter slots available (max_loras_per_batch).", slots)
            metric("lora_pool_utilization", "gauge",
                   "LoRA pool utilization ratio (used/total). 1.0 means pool is full.", used / slots)
        metric("prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens)
        if self.cached_finished:  # a labelled counter appears once it has counted something
            metric("cached_tokens_total", "counter", "Number of cached prompt tokens by source (device/host/storage).",
                   self.cached_finished, f'{labels},cache_source="device"')
        metric("generation_tokens_total", "counter", "Number of generation tokens processed.",
               self.generation_tokens)
        metric("num_requests_total", "counter", "Number of requests processed.", self.requests)
        metric("num_aborted_requests_total", "counter", "Number of requests aborted.", self.aborted)
        metric("num_retracted_requests_total", "counter", "Number of retracted requests.", self.retracted)
        for name, doc, h in (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
            ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", self.e2e),
            ("queue_time_seconds", "Histogram of queueing time in seconds.", self.queue),
        ):
            out.append(f"# HELP sglang:{name} {doc}")
            out.append(f"# TYPE sglang:{name} histogram")
            for b, c in zip(h.buckets, h.counts, strict=True):
                out.append(f'sglang:{name}_bucket{{{labels},le="{float(b)}"}} {float(c)}')
            out.append(f'sglang:{name}_bucket{{{labels},le="+Inf"}} {float(h.count)}')
            out.append(f"sglang:{name}_sum{{{labels}}} {h.sum}")
            out.append(f"sglang:{name}_count{{{labels}}} {float(h.count)}")
        return "\n".join(out) + "\n"
