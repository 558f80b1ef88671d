"""`/server_info`, `/model_info` and `/v1/models` (upstream, under sglang/srt/: `entrypoints/http_server.py`
`server_info`, `model_info`, `available_models`; `utils/common.py` `build_server_info`;
`managers/scheduler_components/internal_state.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import ServerState, SimServer

__all__ = ["model_cards", "model_info", "server_info"]


def server_info(server: SimServer) -> dict[str, Any]:
    """Every parsed flag, the resolved ones over them, and one `internal_states` entry per scheduler."""
    st, plan = server.state, server.state.plan
    info = dict(st.flags)
    info[("mamba_scheduler_strategy" if st.legacy else "mamba_radix_cache_strategy")] = st.strategy
    info.update(
        mem_fraction_static=plan.mem_fraction_static, disable_overlap_schedule=not st.overlap,
        served_model_name=st.model_name, context_length=st.flags.get("context_length"),
        status="ready" if server.ready else "starting", max_total_num_tokens=plan.max_total_num_tokens,
        max_req_input_len=plan.context_len - 5, version=st.version,
        chunked_prefill_size=plan.chunked_prefill_size, is_embedding=st.kind.is_embedding,
        **st.lora_settings.server_info(st.flags),
    )
    if not st.legacy:
        # resolved values: `--dp-size N --enable-dp-attention` reads back as attn_dp_size=N, dp_size=1
        info.update(tp_size=st.layout.tp, pp_size=st.layout.pp, dp_size=st.layout.dp,
                    attn_dp_size=st.layout.attn_dp, enable_dp_attention=st.layout.attn_dp > 1)
    states = []
    for rank in server.engine.ranks:
        s = plan.as_internal_state(rank.gen_throughput, world_size=st.layout.world_size)
        if st.legacy:
            s.pop("effective_max_running_requests_per_dp")
        states.append(s)
    info["internal_states"] = states
    return info


def model_info(st: ServerState) -> dict[str, Any]:
    """`is_generation` is how a client tells an embedding server (`/server_info` has no such key)."""
    p = st.profile
    return {
        "model_path": st.flags["model_path"], "served_model_name": st.model_name,
        "tokenizer_path": st.flags.get("tokenizer_path") or st.flags["model_path"],
        "is_generation": st.kind.is_generation, "preferred_sampling_params": None,
        "weight_version": "default", "load_format": st.flags.get("load_format"), "reasoning_parser": None,
        "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": p.model_type, "architectures": [p.architecture],
        "embedding": st.kind.embedding_plan(st.flags, st.plan.chunked_prefill_size),
    }


def model_cards(st: ServerState, created: int) -> dict[str, Any]:
    """The base model, then every registered LoRA adapter."""
    name = st.model_name
    cards = [{"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": name,
              "parent": None, "max_model_len": st.plan.context_len}]
    if st.lora is not None:
        cards += [{"id": a.name, "object": "model", "created": created, "owned_by": "sglang", "root": a.path,
                   "parent": name, "max_model_len": None} for a in st.lora.registry.values()]
    return {"object": "list", "data": cards}
