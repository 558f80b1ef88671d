"""Model/GPU profiles: the numbers the memory model and the step-time model run on.

A profile stands for one model on one GPU. Memory is in GB the way SGLang counts it (GiB, 2**30
bytes). Choose one with env `SGLANG_SIM_PROFILE` (default `tiny-hybrid`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["PROFILES", "Profile", "get_profile"]

MIB = 1 << 20


@dataclass(frozen=True)
class Profile:
    name: str
    model_path: str
    architecture: str
    hybrid: bool
    gpu_total_gb: float
    cuda_context_gb: float  # taken before the model loads (memory_before_model_load = total - this)
    weight_gb: float
    held_gb: float  # held by activations, CUDA graphs, workspaces when the pools are sized
    activation_gb: float  # must fit in the slack (1 - mem_fraction_static) or the server OOMs
    mamba_conv_bytes: int  # conv state of all mamba layers, one request
    mamba_ssm_bytes: int  # SSM state of all mamba layers, one request
    kv_bytes_per_token: int  # K+V of all full-attention layers, one token
    context_len: int
    default_mem_fraction: float  # SGLang's auto value for this GPU size
    chunked_prefill_size: int
    # Decode step (model seconds) = base + per_req * b, plus per_req_after_knee * (b - knee) past the knee:
    # decode is memory-bound (weights are read once per step whatever the batch) until compute catches up.
    decode_base_s: float
    decode_per_req_s: float
    decode_knee: int
    decode_per_req_after_knee_s: float
    prefill_base_s: float
    prefill_per_token_s: float

    @property
    def mamba_slot_bytes(self) -> int:
        return self.mamba_conv_bytes + self.mamba_ssm_bytes

    def decode_step_s(self, batch: int) -> float:
        over = max(0, batch - self.decode_knee)
        return self.decode_base_s + self.decode_per_req_s * batch + self.decode_per_req_after_knee_s * over

    def prefill_s(self, new_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * new_tokens


PROFILES: dict[str, Profile] = {
    # Calibrated on the seed report: a 27B hybrid (Qwen3.6-27B-like) on a 96 GB RTX PRO 6000.
    # held_gb is chosen so that pool(0.88) = 188 (ratio 5 -> 37) and pool(0.90) = 218 (ratio 3 -> 72);
    # one request's mamba state is 30 MiB; 32 KiB of KV per token gives ~200K tokens at 0.88.
    "seed-27b-96gb": Profile(
        name="seed-27b-96gb", model_path="Qwen/Qwen3.6-27B", architecture="Qwen3_5ForConditionalGeneration",
        hybrid=True, gpu_total_gb=96.0, cuda_context_gb=0.5, weight_gb=54.1, held_gb=18.3, activation_gb=3.5,
        mamba_conv_bytes=2 * MIB, mamba_ssm_bytes=28 * MIB, kv_bytes_per_token=32 * 1024, context_len=262144,
        default_mem_fraction=0.88, chunked_prefill_size=8192,
        decode_base_s=0.064, decode_per_req_s=0.00005, decode_knee=96, decode_per_req_after_knee_s=0.0008,
        prefill_base_s=0.015, prefill_per_token_s=0.00008,
    ),
    # Small numbers, same formulas: ~12 slots under extra_buffer, ~20 under no_buffer, fast steps.
    "tiny-hybrid": Profile(
        name="tiny-hybrid", model_path="sim/tiny-hybrid", architecture="Qwen3NextForCausalLM",
        hybrid=True, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=2.0, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=2 * MIB, mamba_ssm_bytes=26 * MIB, kv_bytes_per_token=16 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.020, decode_per_req_s=0.0001, decode_knee=64, decode_per_req_after_knee_s=0.0005,
        prefill_base_s=0.005, prefill_per_token_s=0.00002,
    ),
    # Test-only (supervisor's "canary does not gain"): tiny-hybrid's memory, but decode turns
    # compute-bound past 12 running requests, so the extra slots of no_buffer cost throughput.
    "knee-hybrid": Profile(
        name="knee-hybrid", model_path="sim/knee-hybrid", architecture="Qwen3NextForCausalLM",
        hybrid=True, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=2.0, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=2 * MIB, mamba_ssm_bytes=26 * MIB, kv_bytes_per_token=16 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.020, decode_per_req_s=0.0001, decode_knee=12, decode_per_req_after_knee_s=0.01,
        prefill_base_s=0.005, prefill_per_token_s=0.00002,
    ),
    # A plain transformer: no mamba pool, concurrency bounded by KV tokens.
    "tiny-plain": Profile(
        name="tiny-plain", model_path="sim/tiny-plain", architecture="LlamaForCausalLM",
        hybrid=False, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=2.0, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=128 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.020, decode_per_req_s=0.0001, decode_knee=64, decode_per_req_after_knee_s=0.0005,
        prefill_base_s=0.005, prefill_per_token_s=0.00002,
    ),
}


def get_profile(name: str | None = None) -> Profile:
    """The profile named (default: env SGLANG_SIM_PROFILE, else tiny-hybrid); KeyError lists choices."""
    name = name or os.environ.get("SGLANG_SIM_PROFILE", "tiny-hybrid")
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown SGLANG_SIM_PROFILE {name!r}; choose from {sorted(PROFILES)}") from None
