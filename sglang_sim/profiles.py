"""Model/GPU profiles: the numbers the memory model and the step-time model run on.

A profile stands for one model on one kind of GPU. Memory is in GB the way SGLang counts it (GiB,
2**30 bytes). Choose one with env `SGLANG_SIM_PROFILE` (default `tiny-hybrid`).

Figures are for the whole model on one GPU: weights, KV bytes per token and mamba state bytes per
request of all layers; the decode and prefill times of one GPU that would hold all of it. A server on
a group of GPUs divides them as SGLang shards the model (memory.py) and speeds them up with the
simple model of parallel.py, so a profile too big for one GPU (`dense-70b-96gb`, `moe-235b-96gb`)
dies of CUDA out of memory with `--tp-size 1` and serves with `--tp-size 4`.
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
    kv_heads: int = 8  # KV heads of a full-attention layer: TP ranks past this many hold copies
    attn_weight_gb: float = 0.0  # attention weights, sharded over attention-TP only (replicated across attention DP)
    # The shapes LoRA buffers and embeddings are sized on (HF config names): hidden_size is also the
    # embedding dimension; q_dim/kv_dim are heads x head_dim. One set for every layer (a hybrid's linear
    # attention layers are priced as if they were full attention).
    model_type: str = "llama"
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 32
    q_dim: int = 1024
    kv_dim: int = 1024
    # Matryoshka support as the HF config declares it (`is_matryoshka`, `matryoshka_dimensions`);
    # `--json-model-override-args` can turn it on.
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

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
        prefill_base_s=0.015, prefill_per_token_s=0.00008, kv_heads=4, attn_weight_gb=4.0,
        model_type="qwen3_5", hidden_size=5120, intermediate_size=17408, num_layers=64, q_dim=6144, kv_dim=1024,
    ),
    # Small numbers, same formulas: ~12 slots under extra_buffer, ~20 under no_buffer, fast steps.
    "tiny-hybrid": Profile(
        name="tiny-hybrid", model_path="sim/tiny-hybrid", architecture="Qwen3NextForCausalLM",
        hybrid=True, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=2.0, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=2 * MIB, mamba_ssm_bytes=26 * MIB, kv_bytes_per_token=16 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.020, decode_per_req_s=0.0001, decode_knee=64, decode_per_req_after_knee_s=0.0005,
        prefill_base_s=0.005, prefill_per_token_s=0.00002,
        model_type="qwen3_next", hidden_size=1024, intermediate_size=4096, num_layers=16, q_dim=1024, kv_dim=512,
    ),
    # A 70B-class dense transformer (Llama-3.3-70B-like, bf16) on the same 96 GB card: 131 GB of weights
    # do not fit one GPU; TP2 leaves ~8 GB per GPU for KV, TP4 ~41 GB. 80 layers x 8 KV heads x 128 x
    # 2 x 2 bytes = 320 KiB of KV per token. Step times are not calibrated on a measurement: the
    # one-GPU step scales the seed profile's by the weights read per step (131 / 54 GB), with a
    # steeper per-request cost (every layer attends); a TP4 server decodes one request in ~56 ms per step.
    "dense-70b-96gb": Profile(
        name="dense-70b-96gb", model_path="meta-llama/Llama-3.3-70B-Instruct", architecture="LlamaForCausalLM",
        hybrid=False, gpu_total_gb=96.0, cuda_context_gb=0.5, weight_gb=131.4, held_gb=10.0, activation_gb=3.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=320 * 1024, context_len=131072,
        default_mem_fraction=0.88, chunked_prefill_size=8192,
        decode_base_s=0.155, decode_per_req_s=0.0005, decode_knee=128, decode_per_req_after_knee_s=0.001,
        prefill_base_s=0.04, prefill_per_token_s=0.0002, kv_heads=8, attn_weight_gb=22.5,
        hidden_size=8192, intermediate_size=28672, num_layers=80, q_dim=8192, kv_dim=1024,
    ),
    # A large MoE (Qwen3-235B-A22B-like, FP8 weights, bf16 KV): 221 GB of weights need TP4 at least on
    # 96 GB cards. 94 layers x 4 KV heads x 128 x 2 x 2 bytes = 188 KiB per token; with TP8 the 4 KV
    # heads are copied on two GPUs each, which is what `--attn-dp-size` (or `--dp-size N
    # --enable-dp-attention`) avoids. Decode reads the active experts (22B) at small batches and more
    # of them as the batch grows; the figures are invented to that shape, not measured.
    "moe-235b-96gb": Profile(
        name="moe-235b-96gb", model_path="Qwen/Qwen3-235B-A22B-Instruct-2507-FP8",
        architecture="Qwen3MoeForCausalLM", hybrid=False, gpu_total_gb=96.0, cuda_context_gb=0.5, weight_gb=221.0,
        held_gb=10.0, activation_gb=3.5, mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=188 * 1024,
        context_len=262144, default_mem_fraction=0.88, chunked_prefill_size=8192,
        decode_base_s=0.09, decode_per_req_s=0.0003, decode_knee=256, decode_per_req_after_knee_s=0.0008,
        prefill_base_s=0.05, prefill_per_token_s=0.00012, kv_heads=4, attn_weight_gb=6.2,
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=1536, num_layers=94, q_dim=8192, kv_dim=512,
    ),
    # A dense 8B model that fits one 80 GB A100 (Llama-3.1-8B-Instruct-like, bf16): 8.03B parameters =
    # 14.96 GB of weights; 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB of KV per token.
    # SGLang's auto memory fraction on an 80 GB card is (81920 - 13440) / 81920 = 0.836 (memory_hook:
    # 512 MB + 1.5 x the 8192-token chunk + 1/8 GB + 2 x the 256 decode graphs, over the 10 GB floor),
    # leaving ~413K KV tokens. Step times are invented to a plausible shape, not measured: decode reads
    # the weights once per step (~9 ms at the A100's ~1.7 TB/s) plus a per-request share; prefill
    # ~12.5K tokens/s (16 GFLOP per token at ~65% of 312 TFLOP/s).
    "llama-8b-a100": Profile(
        name="llama-8b-a100", model_path="meta-llama/Llama-3.1-8B-Instruct", architecture="LlamaForCausalLM",
        hybrid=False, gpu_total_gb=80.0, cuda_context_gb=0.5, weight_gb=14.96, held_gb=1.0, activation_gb=3.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=128 * 1024, context_len=131072,
        default_mem_fraction=0.836, chunked_prefill_size=8192,
        decode_base_s=0.009, decode_per_req_s=0.00006, decode_knee=192, decode_per_req_after_knee_s=0.0002,
        prefill_base_s=0.01, prefill_per_token_s=0.00008, kv_heads=8, attn_weight_gb=2.5,
        hidden_size=4096, intermediate_size=14336, num_layers=32, q_dim=4096, kv_dim=1024,
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
        model_type="qwen3_next", hidden_size=1024, intermediate_size=4096, num_layers=16, q_dim=1024, kv_dim=512,
    ),
    # An embedding model that fits one 96 GB card (Qwen3-Embedding-0.6B-like: a Qwen3ForCausalLM
    # checkpoint, so SGLang needs `--is-embedding`; LAST-token pooling, L2-normalised, 1024 dimensions).
    # 0.596B parameters in bf16 = 1.11 GiB; 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 112 KiB
    # of KV per token; context 32768. Its HF config declares no Matryoshka support, so `dimensions`
    # is refused unless `--json-model-override-args '{"is_matryoshka": true}'`. Step times are
    # invented to a plausible shape, not measured: prefill 5 ms + 10 us a token (~100K tokens/s:
    # 1.2 GFLOP a token at ~100 TFLOP/s achieved); decode (served without --is-embedding) 4 ms a step.
    "embed-0.6b-96gb": Profile(
        name="embed-0.6b-96gb", model_path="Qwen/Qwen3-Embedding-0.6B", architecture="Qwen3ForCausalLM",
        hybrid=False, gpu_total_gb=96.0, cuda_context_gb=0.5, weight_gb=1.11, held_gb=1.0, activation_gb=3.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=112 * 1024, context_len=32768,
        default_mem_fraction=0.88, chunked_prefill_size=8192,
        decode_base_s=0.004, decode_per_req_s=0.00002, decode_knee=256, decode_per_req_after_knee_s=0.0001,
        prefill_base_s=0.005, prefill_per_token_s=0.00001, kv_heads=8, attn_weight_gb=0.2,
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_layers=28, q_dim=2048, kv_dim=1024,
    ),
    # A small embedding model for tests: tiny-plain's card and memory, 256 dimensions, fast steps.
    "tiny-embed": Profile(
        name="tiny-embed", model_path="sim/tiny-embed", architecture="Qwen3ForCausalLM",
        hybrid=False, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=0.5, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=32 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.005, decode_per_req_s=0.0001, decode_knee=64, decode_per_req_after_knee_s=0.0005,
        prefill_base_s=0.004, prefill_per_token_s=0.00001,
        model_type="qwen3", hidden_size=256, intermediate_size=1024, num_layers=8, q_dim=512, kv_dim=256,
    ),
    # A plain transformer: no mamba pool, concurrency bounded by KV tokens.
    "tiny-plain": Profile(
        name="tiny-plain", model_path="sim/tiny-plain", architecture="LlamaForCausalLM",
        hybrid=False, gpu_total_gb=8.0, cuda_context_gb=0.25, weight_gb=2.0, held_gb=1.0, activation_gb=0.5,
        mamba_conv_bytes=0, mamba_ssm_bytes=0, kv_bytes_per_token=128 * 1024, context_len=4096,
        default_mem_fraction=0.85, chunked_prefill_size=2048,
        decode_base_s=0.020, decode_per_req_s=0.0001, decode_knee=64, decode_per_req_after_knee_s=0.0005,
        prefill_base_s=0.005, prefill_per_token_s=0.00002,
        hidden_size=1024, intermediate_size=4096, num_layers=32, q_dim=1024, kv_dim=1024,
    ),
}


def get_profile(name: str | None = None) -> Profile:
    """The profile named (default: env SGLANG_SIM_PROFILE, else tiny-hybrid); KeyError lists choices."""
    name = name or os.environ.get("SGLANG_SIM_PROFILE", "tiny-hybrid")
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown SGLANG_SIM_PROFILE {name!r}; choose from {sorted(PROFILES)}") from None
