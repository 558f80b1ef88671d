"""SGLang's start-up memory sizing (kv_cache_configurator.py / allocation_sizing.py), on a profile,
for one GPU of a server's group (upstream: python/sglang/srt/mem_cache/kv_cache_configurator.py,
srt/arg_groups/memory_hook.py, srt/model_executor/model_runner.py).

Per GPU, for a layout of TP x PP GPUs per replica and A attention-DP ranks (attention TP = TP / A):

    weights = ((W - W_attn) / TP + W_attn / attnTP) / PP
    mf      = --mem-fraction-static | profile's value - (TP*PP - 1) / 8 GB / total  (memory_hook: reserve TP*PP/8 GB)
    slack   = memory_before_model_load * (1 - mf)
    rest    = memory_before_model_load - weights - held - lora - slack   (lora: the LoRA buffers, lora.py)
    mamba pool (per DP rank): --max-mamba-cache-size // A | radix off + --max-running-requests // A | auto-fit:
        budget = rest * r / (1 + r)   (r = --mamba-full-memory-ratio, 0.9)
        pool   = (budget - per_slot) // per_slot,   per_slot = state bytes / attnTP / PP
    KV tokens  = (rest - (pool + 1) * per_slot) / (kv bytes per token / min(attnTP, KV heads) / PP)
    cap (per DP rank) = min(--max-running-requests // A or clamp(tokens / context * 512, 2048, 4096),
                            tokens // 2, pool // ratio)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fatal import MainProcessError, SchedulerError
from .parallel import Layout
from .profiles import Profile

__all__ = ["MemoryPlan", "oom_line", "plan_memory", "resolve_strategy", "slots_per_request", "startup_log_lines"]

GB = 1 << 30


def _size(gb: float) -> str:
    """A size as torch's allocator prints it (c10 format_size): KiB, MiB or GiB, two decimals."""
    if gb <= 1 / 1024:
        return f"{gb * 1024 * 1024:.2f} KiB"
    return f"{gb * 1024:.2f} MiB" if gb <= 1 else f"{gb:.2f} GiB"


def oom_line(*, gpu: int, tried_gb: float, total_gb: float, free_gb: float) -> str:
    """torch's CUDA out-of-memory message (c10/cuda/CUDACachingAllocator.cpp, torch >= 2.5 wording)."""
    in_use = total_gb - free_gb
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {_size(tried_gb)}. GPU {gpu} has a "
            f"total capacity of {_size(total_gb)} of which {_size(free_gb)} is free. Including non-PyTorch "
            f"memory, this process has {_size(in_use)} memory in use. Of the allocated memory "
            f"{_size(in_use * 0.97)} is allocated by PyTorch, and {_size(in_use * 0.01)} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
            "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def resolve_strategy(requested: str, *, hybrid: bool, overlap: bool, legacy: bool,
                     page_size: int | None = None) -> tuple[str, bool]:
    """(resolved strategy, overlap schedule on) as 0.5.23's ServerArgs resolves them."""
    if not hybrid:
        return requested if requested != "auto" else "no_buffer", overlap
    if requested == "auto":
        # auto keeps extra_buffer when the overlap scheduler runs or pages are wider than a token; else
        # it drops to no_buffer (srt/arg_groups/overrides.py _mamba_radix_cache_resolution).
        paged = page_size is not None and page_size > 1
        requested, overlap = ("extra_buffer", overlap) if overlap or paged else ("no_buffer", False)
    if requested == "no_buffer" and page_size not in (None, 1) and not legacy:
        # srt/arg_groups/mamba_hook.py validate_mamba_no_buffer: only the sequence-end state exists
        raise MainProcessError("AssertionError: no_buffer only supports page_size=1.")
    if requested == "no_buffer" and overlap and not legacy:
        # srt/arg_groups/mamba_hook.py validate_mamba_no_buffer, in the launching process
        raise MainProcessError(
            "AssertionError: no_buffer do not support overlap schedule. Try to set disable_overlap_schedule=True.")
    return requested, overlap


def slots_per_request(strategy: str, *, overlap: bool, radix: bool) -> int:
    """Mamba state slots reserved per running request (the reference's "ratio")."""
    if not radix:
        return 1
    if strategy == "extra_buffer":
        return 5 if overlap else 4
    if strategy == "extra_buffer_lazy":
        return 4
    return 3


@dataclass(frozen=True)
class MemoryPlan:
    """One DP rank's pools, and what each GPU of the group holds (the GPUs of a group are alike)."""

    mem_fraction_static: float
    memory_before_load_gb: float
    slack_gb: float
    rest_gb: float
    mamba_pool: int  # max_mamba_cache_size of one DP rank (0 for plain models)
    ratio: int
    max_total_num_tokens: int
    requested_max_running: int | None  # as passed (the whole server's)
    requested_per_worker: int | None  # per DP rank: // attention-DP size
    effective_max_running: int  # per dp rank
    capped_by_mamba: bool
    kv_gb: float
    conv_gb: float
    ssm_gb: float
    weight_gb: float
    available_gpu_mem_gb: float
    context_len: int
    chunked_prefill_size: int
    used_gb: float  # what nvidia-smi shows on each GPU of the group while the server lives
    max_prefill_tokens: int = 16384
    lora_gb: float = 0.0  # the LoRA buffers, allocated before the KV cache is sized

    def as_internal_state(self, last_gen_throughput: float, *, world_size: int) -> dict[str, Any]:
        return {
            "world_size": world_size,
            "max_mamba_cache_size": self.mamba_pool,
            "effective_max_running_requests_per_dp": self.effective_max_running,
            "last_gen_throughput": round(last_gen_throughput, 2),
            "memory_usage": {
                "weight": round(self.weight_gb, 2),
                "kvcache": round(self.kv_gb, 2),
                "mamba": round(self.conv_gb + self.ssm_gb, 2),
                "token_capacity": self.max_total_num_tokens,
            },
        }


def default_mem_fraction(profile: Profile, layout: Layout) -> float:
    """SGLang's auto value: the profile's (one GPU) less TP*PP/8 GB more reserve (memory_hook.py)."""
    extra_gb = (layout.tp * layout.pp - 1) / 8
    return round(profile.default_mem_fraction - extra_gb / profile.gpu_total_gb, 3)


def plan_memory(profile: Profile, flags: dict[str, Any], *, ratio: int, layout: Layout | None = None,
                lora_gb: float = 0.0) -> MemoryPlan:
    """Size the pools of one (dp) rank; raises SchedulerError where the real scheduler would die.
    `lora_gb`: what the LoRA memory pool takes on each GPU (ModelRunner allocates it after the weights
    and before the KV configurator runs, so it comes out of the KV cache)."""
    layout = layout or Layout()
    tp, pp, attn_dp, attn_tp = layout.tp, layout.pp, layout.attn_dp, layout.attn_tp
    gpu = layout.ranks()[0].ordinal  # the first rank reports (torch names its device by ordinal)
    mf = flags.get("mem_fraction_static") or default_mem_fraction(profile, layout)
    before = profile.gpu_total_gb - profile.cuda_context_gb
    dense = profile.weight_gb - profile.attn_weight_gb
    weight = (dense / tp + profile.attn_weight_gb / attn_tp) / pp
    if weight > before:  # the weights alone do not fit: dies while loading them
        raise SchedulerError(oom_line(gpu=gpu, tried_gb=min(2.0, weight - before + 0.5),
                                      total_gb=profile.gpu_total_gb, free_gb=0.31), after_load=True)
    slack = before * (1 - mf)
    if weight + profile.held_gb + lora_gb > before * 0.999 or slack < profile.activation_gb:
        need_gb = profile.activation_gb - max(slack, 0.0)
        raise SchedulerError(oom_line(gpu=gpu, tried_gb=max(need_gb, 0.25), total_gb=profile.gpu_total_gb,
                                      free_gb=max(slack, 0.05)), after_load=True)
    rest = before - weight - profile.held_gb - lora_gb - slack
    not_enough = f"RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. " \
                 f"Current value: mem_fraction_static={mf}"
    if rest <= 0:
        raise SchedulerError(not_enough, after_load=True)
    per_slot = profile.mamba_slot_bytes / attn_tp / pp / GB
    radix = not flags.get("disable_radix_cache")
    requested = flags.get("max_running_requests")
    per_worker = max(1, int(requested) // attn_dp) if requested else None
    pool = 0
    if profile.hybrid:
        if flags.get("max_mamba_cache_size"):
            pool = int(flags["max_mamba_cache_size"]) // attn_dp
        elif not radix and per_worker:
            pool = per_worker
        else:
            r = flags.get("mamba_full_memory_ratio") or 0.9
            budget = rest * r / (1 + r)
            pool = int((budget - per_slot) // per_slot)
        if pool <= 0:
            raise SchedulerError(
                "RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
                f"Computed max_mamba_cache_size={pool} (total_rest_memory={rest:.2f} GB, "
                f"mamba_cache_per_req={per_slot * 1024:.2f} MB). Try: (1) reduce --max-running-requests, "
                "(2) increase --mem-fraction-static, (3) reduce --speculative-num-draft-tokens, or "
                "(4) use GPUs with more memory.", after_load=True)
    mamba_gb = (pool + 1) * per_slot if profile.hybrid else 0.0
    kv_gb = rest - mamba_gb
    kv_per_token = profile.kv_bytes_per_token / min(attn_tp, profile.kv_heads) / pp
    tokens = int(kv_gb * GB / kv_per_token)
    if flags.get("max_total_tokens"):
        tokens = min(tokens, int(flags["max_total_tokens"]))
        kv_gb = tokens * kv_per_token / GB
    if tokens <= 0:
        raise SchedulerError(not_enough, after_load=True)
    context = int(flags.get("context_length") or profile.context_len)
    estimate = max(min(int(tokens / context * 512), 4096), 2048)
    candidates = [per_worker or estimate, tokens // 2]
    by_mamba = pool // ratio if profile.hybrid else None
    effective = min(candidates if by_mamba is None else [*candidates, by_mamba])
    capped = by_mamba is not None and by_mamba < min(candidates)
    if effective <= 0:
        raise SchedulerError(
            "RuntimeError: Hybrid (mamba/linear-attention) state cache is too small to serve any requests. "
            f"max_mamba_cache_size={pool}, mamba_ratio={ratio}, resulting max_num_reqs={effective}. "
            "Try: (1) reduce --max-running-requests, (2) increase --mem-fraction-static, or "
            "(3) use GPUs with more memory.", after_load=True)
    conv = (pool + 1) * profile.mamba_conv_bytes / attn_tp / pp / GB
    ssm = (pool + 1) * profile.mamba_ssm_bytes / attn_tp / pp / GB
    used = profile.cuda_context_gb + weight + profile.held_gb + lora_gb + kv_gb + mamba_gb + profile.activation_gb
    chunked = int(flags.get("chunked_prefill_size") or profile.chunked_prefill_size)
    if attn_dp > 1:
        chunked //= attn_dp  # parallel_hook.handle_data_parallelism
    return MemoryPlan(
        mem_fraction_static=mf, memory_before_load_gb=before, slack_gb=slack, rest_gb=rest,
        mamba_pool=pool, ratio=ratio, max_total_num_tokens=tokens, requested_max_running=requested,
        requested_per_worker=per_worker, effective_max_running=effective, capped_by_mamba=capped, kv_gb=kv_gb,
        conv_gb=conv, ssm_gb=ssm, weight_gb=weight, available_gpu_mem_gb=slack - profile.activation_gb * 0.6,
        context_len=context, chunked_prefill_size=chunked, used_gb=used,
        max_prefill_tokens=int(flags.get("max_prefill_tokens") or 16384), lora_gb=lora_gb,
    )


def startup_log_lines(profile: Profile, plan: MemoryPlan, *, load_s: float) -> list[tuple[str, bool]]:
    """The sizing lines one rank prints at start-up, in their real wording, in order; the flag says
    whether only TP rank 0 prints it (the `max_total_num_tokens=...` summary, scheduler.py)."""
    lines = [(
        f"Load weight end. elapsed={load_s:.2f} s, type={profile.architecture}, "
        f"avail mem={plan.memory_before_load_gb - plan.weight_gb:.2f} GB, mem usage={plan.weight_gb:.2f} GB.",
        False)]
    if profile.hybrid:
        lines.append((
            f"Mamba Cache is allocated. max_mamba_cache_size: {plan.mamba_pool}, "
            f"conv_state size: {plan.conv_gb:.2f}GB, ssm_state size: {plan.ssm_gb:.2f}GB ", False))
    half = plan.kv_gb / 2
    lines.append((f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {plan.max_total_num_tokens}, "
                  f"K size: {half:.2f} GB, V size: {half:.2f} GB", False))
    if plan.capped_by_mamba:
        lines.append((
            f"max_running_requests is capped to {plan.effective_max_running} by the mamba state cache "
            f"(max_mamba_cache_size={plan.mamba_pool}, {plan.ratio} state slots per request). To raise it: "
            "increase --mamba-full-memory-ratio or --max-mamba-cache-size, or halve the state size with "
            "--mamba-ssm-dtype bfloat16.", False))
    elif plan.requested_per_worker is not None and plan.effective_max_running < plan.requested_per_worker:
        lines.append((
            f"max_running_requests was reduced from the requested {plan.requested_per_worker} to "
            f"{plan.effective_max_running} (per dp worker) due to the available KV cache capacity.", False))
    lines.append((
        f"max_total_num_tokens={plan.max_total_num_tokens}, chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens={plan.max_prefill_tokens}, max_running_requests={plan.effective_max_running}, "
        f"context_len={plan.context_len}, available_gpu_mem={plan.available_gpu_mem_gb:.2f} GB", True))
    return lines
