"""How one server spreads over a group of GPUs: tensor (TP), pipeline (PP) and data (DP) parallelism.

As SGLang 0.5.23 lays it out (upstream: python/sglang/srt/server_args.py `compute_world_size`,
srt/arg_groups/parallel_hook.py, srt/managers/data_parallel_controller.py, srt/entrypoints/engine.py):

- `--dp-size D` runs D replicas, each a full TP x PP group: D x TP x PP GPUs, one scheduler (one
  `internal_states` entry, one batch, its own pools) per replica.
- `--attn-dp-size A` (or the deprecated `--dp-size A --enable-dp-attention`, which resolution turns
  into `attn_dp_size=A, dp_size=1`) splits the attention of ONE TP group into A data-parallel groups
  of TP / A GPUs each, while the FFN/MoE stays tensor parallel over all TP GPUs: TP x PP GPUs, A
  schedulers. Replicas and attention DP do not combine (ValueError); A must divide TP (assert).
- GPU ordinals: replica r, stage p, TP rank t -> base_gpu_id + r*TP*PP + p*TP + t*gpu_id_step, an
  index into the process's visible devices (CUDA_VISIBLE_DEVICES).
- Log prefixes per scheduler process: ` DP{d}` (when there is more than one DP rank), ` PP{p}` (PP > 1),
  ` TP{t}` (TP > 1), in that order (scheduler.py `configure_scheduler_process`).

Speed, the simulator's own simple model (docs/simulator.md): decode on one GPU is bound by reading
the weights once per step, so a TP group reads 1/TP of them per GPU, but the all-reduces and the
kernel launches of every layer do not shrink. `speedup(n) = n / (1 + 0.15 (n - 1))`: TP2 1.74x,
TP4 2.76x, TP8 3.90x one GPU. PP splits a batch into PP micro-batches that go through the whole
model in turn: a step of b requests costs one GPU's step of ceil(b / PP) requests, plus 5 % per
extra stage for the pipeline bubble and the transfers. Attention-DP ranks step in lock-step (the MoE
layers gather every rank's tokens), so their step is priced on the batch of the whole TP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .fatal import MainProcessError

__all__ = ["TP_OVERHEAD", "Layout", "Rank"]

TP_OVERHEAD = 0.15  # share of a decode step that does not shrink with TP (all-reduce, launches)
PP_OVERHEAD = 0.05  # per extra pipeline stage (bubble, activation transfer)


@dataclass(frozen=True)
class Rank:
    """One scheduler process: where it runs and how it labels its log lines."""

    dp: int | None  # None when the server has a single DP rank (no ` DP` prefix)
    pp: int
    tp: int
    ordinal: int  # index into the visible devices

    def prefix(self, layout: Layout) -> str:
        tags = ""
        if self.dp is not None:
            tags += f" DP{self.dp}"
        if layout.pp > 1:
            tags += f" PP{self.pp}"
        if layout.tp > 1:
            tags += f" TP{self.tp}"
        return tags


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1  # replicas
    attn_dp: int = 1  # attention data-parallel groups inside the TP group
    base_gpu_id: int = 0
    gpu_id_step: int = 1

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> Layout:
        """The layout SGLang resolves from the launch flags; MainProcessError where it refuses them."""

        def size(key: str) -> int:
            value = flags.get(key)
            return 1 if value is None else int(value)

        tp, pp, dp, attn_dp = size("tp_size"), size("pp_size"), size("dp_size"), size("attn_dp_size")
        for key, value in (("tp_size", tp), ("pp_size", pp), ("dp_size", dp)):
            if value < 1:  # SGLang checks only --attn-dp-size so; it fails later on these, the simulator here
                raise MainProcessError(f"ValueError: --{key.replace('_', '-')} must be positive (got {value}).")
        if flags.get("enable_dp_attention") and attn_dp == 1:
            attn_dp, dp = dp, 1  # parallel_hook.handle_deprecated_dp_attention
        if attn_dp < 1:
            raise MainProcessError(f"ValueError: --attn-dp-size must be positive (got {attn_dp}).")
        if attn_dp > 1 and dp > 1:
            raise MainProcessError(
                f"ValueError: --dp-size {dp} with --attn-dp-size {attn_dp}: data-parallel replicas combined "
                "with attention data parallelism are not supported.")
        if tp % attn_dp:
            raise MainProcessError("AssertionError")  # a bare `assert cfg.tp_size % cfg.attn_dp_size == 0`
        return cls(tp=tp, pp=pp, dp=dp, attn_dp=attn_dp, base_gpu_id=int(flags.get("base_gpu_id") or 0),
                   gpu_id_step=size("gpu_id_step"))

    @property
    def world_size(self) -> int:
        """GPUs the server uses (attention DP runs inside the TP group and adds none)."""
        return self.dp * self.tp * self.pp

    @property
    def attn_tp(self) -> int:
        """GPUs that share one attention-DP rank's attention (and its KV and mamba pools)."""
        return self.tp // self.attn_dp

    @property
    def num_dp_ranks(self) -> int:
        """Schedulers with a batch of their own: one `internal_states` entry each."""
        return self.dp * self.attn_dp

    def dp_rank_of(self, replica: int, tp_rank: int) -> int | None:
        if self.num_dp_ranks == 1:
            return None
        return replica if self.attn_dp == 1 else tp_rank // self.attn_tp

    def ranks(self) -> list[Rank]:
        """Every scheduler process, in launch order."""
        out = []
        for replica in range(self.dp):
            for pp in range(self.pp):
                for tp in range(self.tp):
                    ordinal = (self.base_gpu_id + replica * self.tp * self.pp + pp * self.tp
                               + tp * self.gpu_id_step)
                    out.append(Rank(dp=self.dp_rank_of(replica, tp), pp=pp, tp=tp, ordinal=ordinal))
        return out

    def stats_ranks(self) -> list[Rank]:
        """The rank that logs batches for each DP rank (attention-TP rank 0, first pipeline stage)."""
        return [r for r in self.ranks() if r.pp == 0 and r.tp % self.attn_tp == 0]

    # ---- speed ---------------------------------------------------------------------------------
    @staticmethod
    def speedup(n: int) -> float:
        return n / (1 + TP_OVERHEAD * (n - 1))

    def micro_batch(self, batch: int) -> int:
        """Requests per pipeline micro-batch: what one GPU's step model is priced on."""
        return math.ceil(batch / self.pp) if batch else 0

    @property
    def step_factor(self) -> float:
        """Multiplier of one GPU's step time (decode and prefill) for this layout."""
        return (1 + PP_OVERHEAD * (self.pp - 1)) / self.speedup(self.tp)

    def describe(self) -> str:
        parts = [f"tp={self.tp}"]
        if self.pp > 1:
            parts.append(f"pp={self.pp}")
        if self.dp > 1:
            parts.append(f"dp={self.dp}")
        if self.attn_dp > 1:
            parts.append(f"attn_dp={self.attn_dp}")
        return ", ".join(parts)
