"""What a server says about itself at start-up, for the supervisor: pool sizes, the effective cap and
what caused it (`ServerFacts`). Read once per start from `/server_info` and the start-up log, both of
which a real SGLang 0.5.23 gives (upstream: `/server_info` in python/sglang/srt/entrypoints/http_server.py,
its `internal_states` from python/sglang/srt/managers/scheduler.py; the log lines from
python/sglang/srt/model_executor/model_runner.py, python/sglang/srt/mem_cache/memory_pool.py and the
scheduler; the mamba cap from python/sglang/srt/mem_cache/allocation_sizing.py):

    /server_info: max_running_requests (REQUESTED), max_total_num_tokens, mem_fraction_static,
                  chunked_prefill_size, max_prefill_tokens (the prefill forward's token budget),
                  mamba_radix_cache_strategy, disable_overlap_schedule, disable_radix_cache, version,
                  internal_states[i]: max_mamba_cache_size, effective_max_running_requests_per_dp,
                                      memory_usage {weight, kvcache, ...}
    log:          Load weight end. ..., avail mem=X GB, mem usage=W GB.
                  Mamba Cache is allocated. max_mamba_cache_size: P, conv_state size: aGB, ssm_state size: bGB
                  KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, K size: k GB, V size: v GB
                  WARNING: max_running_requests is capped to N by the mamba state cache
                           (max_mamba_cache_size=P, R state slots per request). ...
                  max_total_num_tokens=..., max_running_requests=N, context_len=C, ...

Pure: no I/O. A figure the server did not give stays None; nothing here is guessed from the
simulator (which prints the same lines in the same words).
"""

from __future__ import annotations

import re
from typing import Any

from batchfleet.records import CapCause, ServerFacts

__all__ = ["read_facts", "slots_per_request"]

_CAPPED = re.compile(r"max_running_requests is capped to (\d+) by the mamba state cache "
                     r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)")
_LOADED = re.compile(r"Load weight end\..*?avail mem=([\d.]+) GB, mem usage=([\d.]+) GB")
_MAMBA = re.compile(r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+), conv_state size: ([\d.]+) ?GB, "
                    r"ssm_state size: ([\d.]+) ?GB")
# 0.5.23: "KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, K size: k GB, V size: v GB" (older: no dtype)
_KV = re.compile(r"KV Cache is allocated\.(?: dtype: [^,]+,)? #tokens: (\d+), K size: ([\d.]+) GB, V size: ([\d.]+) GB")
_SIZING = re.compile(r"max_total_num_tokens=(\d+),.*?context_len=(\d+)")


def slots_per_request(strategy: str, *, overlap: bool, radix: bool) -> int:
    """Mamba state slots SGLang 0.5.23 reserves per running request (allocation_sizing.py)."""
    if not radix:
        return 1
    if strategy == "extra_buffer":
        return 5 if overlap else 4
    if strategy == "extra_buffer_lazy":
        return 4
    return 3


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def read_facts(info: dict[str, Any], log_text: str, *, effective: int) -> ServerFacts:
    """`ServerFacts` from a `/server_info` reply (maybe empty) and the log since the server started."""
    states = [s for s in (info.get("internal_states") or []) if isinstance(s, dict)]
    pools = [_int(s.get("max_mamba_cache_size")) for s in states]
    pool = sum(p for p in pools if p) if any(pools) else None
    mem = states[0].get("memory_usage") if states and isinstance(states[0].get("memory_usage"), dict) else {}
    strategy = info.get("mamba_radix_cache_strategy") or info.get("mamba_scheduler_strategy") or ""
    strategy = strategy if isinstance(strategy, str) else ""
    radix = not info.get("disable_radix_cache")
    overlap = not info.get("disable_overlap_schedule")
    tokens = _int(info.get("max_total_num_tokens"))
    context = _int(info.get("context_length"))
    weight, kv, mamba, before = _float(mem.get("weight")), _float(mem.get("kvcache")), None, None

    capped = _CAPPED.search(log_text)
    ratio = int(capped.group(3)) if capped else None
    if m := _LOADED.search(log_text):
        before = float(m.group(1)) + float(m.group(2))
        weight = weight if weight is not None else float(m.group(2))
    if m := _MAMBA.search(log_text):
        pool = pool if pool is not None else int(m.group(1))
        mamba = float(m.group(2)) + float(m.group(3))
    if m := _KV.search(log_text):
        tokens = tokens if tokens is not None else int(m.group(1))
        kv = kv if kv is not None else float(m.group(2)) + float(m.group(3))
    if m := _SIZING.search(log_text):
        tokens = tokens if tokens is not None else int(m.group(1))
        context = context if context is not None else int(m.group(2))
    if ratio is None and pool and strategy:
        ratio = slots_per_request(strategy, overlap=overlap, radix=radix)

    requested = _int(info.get("max_running_requests"))
    # The log line is definitive. Without it, a cap equal to what was asked is the request's (with the
    # radix cache off the pool is sized to the request, so pool // 1 equals it too).
    if capped:
        cause = CapCause.MAMBA
    elif requested is not None and requested == effective:
        cause = CapCause.REQUESTED
    elif pool and ratio and pool // ratio == effective:
        cause = CapCause.MAMBA
    elif tokens and tokens // 2 == effective:
        cause = CapCause.KV
    else:
        cause = CapCause.UNKNOWN
    version = info.get("version")
    chunk, most = _int(info.get("chunked_prefill_size")), _int(info.get("max_prefill_tokens"))
    budgets = [t for t in (chunk, most) if t is not None and t > 0]  # chunking off (-1): max_prefill_tokens alone
    return ServerFacts(
        effective_max_running=effective, requested_max_running=requested, cap_cause=cause,
        mamba_pool=pool or None, slots_per_request=ratio if pool else None, max_total_num_tokens=tokens,
        context_len=context, strategy=strategy, radix_cache=radix,
        mem_fraction_static=_float(info.get("mem_fraction_static")), memory_before_load_gb=before,
        weight_gb=weight, kv_gb=kv, mamba_gb=mamba, version=version if isinstance(version, str) else "",
        prefill_tokens=min(budgets) if budgets else None)
