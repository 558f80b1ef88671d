"""What kind of server a profile makes with the flags given: generation or embedding (SGLang 0.5.23).

Upstream, under sglang/srt/: `configs/model_config.py` `is_generation_model` (the profiles' *ForCausalLM
architectures generate unless `--is-embedding`), the Matryoshka fields of `ModelConfig`
(`matryoshka_dimensions`, `is_matryoshka`, from the HF config as `--json-model-override-args` overrides
it), `configs/embedding_model_spec.py` `resolve_embedding_model_spec` and `resolved_embedding_plan`
(`/model_info`'s "embedding" block), and what each architecture's `forward(..., get_embedding=True)`
does (models/*.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .fatal import SITE_PACKAGES, MainProcessError, SchedulerError
from .profiles import Profile

__all__ = ["ModelKind", "embedding_forward_error", "resolve_model_kind"]

# What `model.forward(..., get_embedding=True)` does per architecture (models/*.py, read, not run):
# None = a LAST-token pooler that L2-normalises; else the exception the first forward raises.
_EMBED_FORWARD: dict[str, str | None] = {
    "LlamaForCausalLM": None,  # models/llama.py: Pooler(LAST, normalize=True)
    "Qwen3ForCausalLM": None,  # models/qwen3.py
    "Qwen3_5ForConditionalGeneration": None,  # models/qwen3_vl.py's forward, inherited
    # no get_embedding parameter and no **kwargs
    "Qwen3MoeForCausalLM": "TypeError: Qwen3MoeForCausalLM.forward() got an unexpected keyword argument "
                           "'get_embedding'",
    # takes **kwargs, returns logits; the scheduler then reads `.embeddings` of them
    "Qwen3NextForCausalLM": "AttributeError: 'LogitsProcessorOutput' object has no attribute 'embeddings'",
}


@dataclass(frozen=True)
class ModelKind:
    """Generation or embedding, and what `dimensions` may be (`ModelConfig`)."""

    is_embedding: bool = False
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    hidden_size: int = 1024

    @property
    def is_generation(self) -> bool:
        return not self.is_embedding

    def embedding_plan(self, flags: dict[str, Any], chunked_prefill_size: int) -> dict[str, Any]:
        """`/model_info`'s "embedding" block: the explicit decoder-embedding spec with the flag, "none" without."""
        on = self.is_embedding
        return {
            "family": "explicit_decoder_embedding" if on else "none", "task": "embed" if on else "none",
            "execution": "decoder_pooling" if on else "none", "attention": "causal" if on else "none",
            "pooling": "model_defined", "normalize": on, "postprocessor": "model_defined" if on else "none",
            "tokenizer_special_tokens": "model_default", "supports_dimensions": self.is_matryoshka,
            "supports_token_embeddings": False, "supports_multimodal": False, "requires_embedding_flag": on,
            "auto_enable_embedding": False, "bcg_eligibility": "standard" if on else "disabled",
            "safe_disable_kv_cache": False, "safe_disable_radix_cache": False, "safe_disable_chunked_prefill": False,
            "enabled": on, "matryoshka_dimensions": list(self.matryoshka_dimensions),
            "bcg": {"prefill_backend": "breakable", "enabled": True, "capture_token_budget": None,
                    "capture_batch_sizes": []},
            "cache": {"kv_cache_disabled": bool(flags.get("prefill_only_disable_kv_cache")),
                      "radix_cache_disabled": bool(flags.get("disable_radix_cache")),
                      "chunked_prefill_disabled": chunked_prefill_size == -1},
        }


def resolve_model_kind(profile: Profile, flags: dict[str, Any]) -> ModelKind:
    """The kind of server; MainProcessError for a `--json-model-override-args` that is not JSON."""
    try:
        override = json.loads(flags.get("json_model_override_args") or "{}")
    except ValueError as e:
        raise MainProcessError(f"json.decoder.JSONDecodeError: {e}") from None
    if not isinstance(override, dict):
        override = {}
    dims = override.get("matryoshka_dimensions", profile.matryoshka_dimensions) or ()
    return ModelKind(is_embedding=bool(flags.get("is_embedding")), matryoshka_dimensions=tuple(dims),
                     is_matryoshka=bool(dims) or bool(override.get("is_matryoshka", profile.is_matryoshka)),
                     hidden_size=int(override.get("hidden_size", profile.hidden_size)))


def embedding_forward_error(profile: Profile) -> SchedulerError | None:
    """The scheduler's death when the architecture cannot pool (at its first forward, before ready)."""
    error = _EMBED_FORWARD.get(profile.architecture)
    if error is None:
        return None
    runner = f"{SITE_PACKAGES}/sglang/srt/model_executor/model_runner.py"
    return SchedulerError(error, after_load=True, frames=(
        (f"{SITE_PACKAGES}/sglang/srt/managers/scheduler.py", 6362, "run_scheduler_process",
         "scheduler = Scheduler(server_args, port_args)"),
        (runner, 3021, "forward", "output = self._forward_raw("),
        (runner, 2890, "forward_extend", "return self.model.forward("),
    ))
