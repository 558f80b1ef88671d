"""SGLang's start-up memory sizing (kv_cache_configurator.py / allocation_sizing.py), on a profile.

    slack = memory_before_model_load * (1 - mem_fraction_static)
    rest  = memory_before_model_load - weights - held - slack
    mamba pool: --max-mamba-cache-size | radix off + --max-running-requests | auto-fit:
        budget = rest * r / (1 + r)   (r = --mamba-full-memory-ratio, 0.9)
        pool   = (budget - per_slot) // per_slot
    KV tokens  = (rest - (pool + 1) * per_slot) / kv_bytes_per_token   (capped by --max-total-tokens)
    cap        = min(--max-running-requests or token estimate, tokens // 2, pool // ratio)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .profiles import Profile

__all__ = ["MemoryPlan", "StartupError", "plan_memory", "resolve_strategy", "slots_per_request", "startup_log_lines"]

GB = 1 << 30


class StartupError(Exception):
    """A fatal start-up condition; `log_line` is what SGLang would print before dying."""

    def __init__(self, log_line: str) -> None:
        super().__init__(log_line)
        self.log_line = log_line


def resolve_strategy(requested: str, *, hybrid: bool, overlap: bool, legacy: bool) -> tuple[str, bool]:
    """(resolved strategy, overlap schedule on) as 0.5.23's ServerArgs resolves them."""
    if not hybrid:
        return requested if requested != "auto" else "no_buffer", overlap
    if requested == "auto":
        # auto keeps extra_buffer only when the overlap scheduler runs; else it drops to no_buffer.
        return ("extra_buffer", True) if overlap else ("no_buffer", False)
    if requested == "no_buffer" and overlap and not legacy:
        raise StartupError(
            "ValueError: mamba radix cache strategy no_buffer do not support overlap schedule, "
            "please add --disable-overlap-schedule"
        )
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
    mem_fraction_static: float
    memory_before_load_gb: float
    slack_gb: float
    rest_gb: float
    mamba_pool: int  # max_mamba_cache_size (0 for plain models)
    ratio: int
    max_total_num_tokens: int
    requested_max_running: int | None
    effective_max_running: int  # per dp rank
    capped_by_mamba: bool
    kv_gb: float
    conv_gb: float
    ssm_gb: float
    weight_gb: float
    available_gpu_mem_gb: float
    context_len: int
    chunked_prefill_size: int
    used_gb: float  # what nvidia-smi shows while the server lives

    def as_internal_state(self, last_gen_throughput: float) -> dict[str, Any]:
        return {
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


def plan_memory(profile: Profile, flags: dict[str, Any], *, ratio: int) -> MemoryPlan:
    """Size the pools for one (dp) rank; raises StartupError like the real server would die."""
    tp = max(1, int(flags.get("tp_size") or 1))
    mf = flags.get("mem_fraction_static") or profile.default_mem_fraction
    before = profile.gpu_total_gb - profile.cuda_context_gb
    weight = profile.weight_gb / tp
    slack = before * (1 - mf)
    if weight + profile.held_gb > before * 0.999 or slack < profile.activation_gb:
        need_gb = profile.activation_gb - max(slack, 0.0)
        raise StartupError(
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {max(need_gb, 0.25):.2f} GiB. "
            f"GPU 0 has a total capacity of {profile.gpu_total_gb:.2f} GiB of which {max(slack, 0):.2f} GiB "
            "is free. Of the allocated memory, PyTorch holds the rest."
        )
    rest = before - weight - profile.held_gb - slack
    if rest <= 0:
        raise StartupError("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
    per_slot = profile.mamba_slot_bytes / tp / GB
    radix = not flags.get("disable_radix_cache")
    requested = flags.get("max_running_requests")
    pool = 0
    if profile.hybrid:
        if flags.get("max_mamba_cache_size"):
            pool = int(flags["max_mamba_cache_size"])
        elif not radix and requested:
            pool = int(requested)
        else:
            r = flags.get("mamba_full_memory_ratio") or 0.9
            budget = rest * r / (1 + r)
            pool = int((budget - per_slot) // per_slot)
    mamba_gb = (pool + 1) * per_slot if profile.hybrid else 0.0
    kv_gb = rest - mamba_gb
    tokens = int(kv_gb * GB / (profile.kv_bytes_per_token / tp))
    if flags.get("max_total_tokens"):
        tokens = min(tokens, int(flags["max_total_tokens"]))
        kv_gb = tokens * profile.kv_bytes_per_token / tp / GB
    if tokens <= 0:
        raise StartupError("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
    context = int(flags.get("context_length") or profile.context_len)
    estimate = max(2048, tokens * 512 // context)
    candidates = [requested or estimate, tokens // 2]
    by_mamba = pool // ratio if profile.hybrid else None
    effective = min(candidates if by_mamba is None else [*candidates, by_mamba])
    capped = by_mamba is not None and by_mamba < min(candidates)
    if effective <= 0:
        raise StartupError(
            f"RuntimeError: max_running_requests is capped to 0 by the mamba state cache "
            f"(max_mamba_cache_size={pool}, {ratio} state slots per request). "
            "Increase --max-mamba-cache-size or --mem-fraction-static."
        )
    conv = (pool + 1) * profile.mamba_conv_bytes / tp / GB
    ssm = (pool + 1) * profile.mamba_ssm_bytes / tp / GB
    used = profile.cuda_context_gb + weight + profile.held_gb + kv_gb + mamba_gb + profile.activation_gb
    return MemoryPlan(
        mem_fraction_static=mf, memory_before_load_gb=before, slack_gb=slack, rest_gb=rest,
        mamba_pool=pool, ratio=ratio, max_total_num_tokens=tokens, requested_max_running=requested,
        effective_max_running=effective, capped_by_mamba=capped, kv_gb=kv_gb, conv_gb=conv, ssm_gb=ssm,
        weight_gb=weight, available_gpu_mem_gb=slack - profile.activation_gb * 0.6, context_len=context,
        chunked_prefill_size=int(flags.get("chunked_prefill_size") or profile.chunked_prefill_size),
        used_gb=used,
    )


def startup_log_lines(profile: Profile, plan: MemoryPlan) -> list[str]:
    """The sizing lines SGLang prints at start-up, in their real wording."""
    lines = [
        f"Load weight end. type={profile.architecture}, dtype=torch.bfloat16, "
        f"avail mem={plan.memory_before_load_gb - plan.weight_gb:.2f} GB, mem usage={plan.weight_gb:.2f} GB.",
    ]
    if profile.hybrid:
        lines.append(
            f"Mamba Cache is allocated. max_mamba_cache_size: {plan.mamba_pool}, "
            f"conv_state size: {plan.conv_gb:.2f}GB, ssm_state size: {plan.ssm_gb:.2f}GB"
        )
    half = plan.kv_gb / 2
    lines.append(
        f"KV Cache is allocated. #tokens: {plan.max_total_num_tokens}, K size: {half:.2f} GB, V size: {half:.2f} GB"
    )
    if plan.capped_by_mamba:
        lines.append(
            f"WARNING: max_running_requests is capped to {plan.effective_max_running} by the mamba state cache "
            f"(max_mamba_cache_size={plan.mamba_pool}, {plan.ratio} state slots per request). "
            "To allow more, increase --max-mamba-cache-size or --mem-fraction-static, "
            "or use --mamba-radix-cache-strategy no_buffer."
        )
    lines.append(
        f"max_total_num_tokens={plan.max_total_num_tokens}, chunked_prefill_size={plan.chunked_prefill_size}, "
        f"max_prefill_tokens=16384, max_running_requests={plan.effective_max_running}, "
        f"context_len={plan.context_len}, available_gpu_mem={plan.available_gpu_mem_gb:.2f} GB"
    )
    return lines
