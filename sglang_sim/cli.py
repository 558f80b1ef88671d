"""The command line of SGLang, rebuilt from the bundled `--help` text of 0.5.23.

Building the parser from the real help text (instead of a hand-written subset) is what makes the
simulator reject exactly the flags the real server rejects: an unknown or misspelled flag exits
with status 2 and argparse's message, as `sglang.launch_server` does. Older releases (env
`SGLANG_SIM_VERSION` < 0.5.22) get the old spellings patched in, so a launcher that hard-codes one
spelling breaks against the simulator the same way it would break against a real server.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = ["DEFAULT_VERSION", "SimVersion", "build_parser", "parse_args", "sim_version"]

DEFAULT_VERSION = "0.5.23"
_HELP_FILE = "launch-help-0.5.23.txt"

# Value types of the flags the simulator acts on; everything else is kept as the string given.
_INT_FLAGS = {
    "port", "max_running_requests", "max_queued_requests", "max_total_tokens", "context_length",
    "decode_log_interval", "tp_size", "dp_size", "pp_size", "attn_dp_size", "gpu_id_step", "nnodes", "node_rank",
    "chunked_prefill_size", "max_prefill_tokens",
    "max_mamba_cache_size", "mamba_track_interval", "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill",
    "cuda_graph_max_bs", "random_seed", "base_gpu_id", "page_size", "stream_interval",
    "prefill_max_requests", "max_loras_per_batch", "max_lora_rank", "max_loaded_loras",
}
_FLOAT_FLAGS = {"mem_fraction_static", "mamba_full_memory_ratio", "schedule_conservativeness",
                "lora_drain_wait_threshold"}

# Defaults of the flags the simulator reports back in /server_info (values of SGLang 0.5.23).
_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1", "port": 30000, "decode_log_interval": 40, "mamba_radix_cache_strategy": "auto",
    "mamba_scheduler_strategy": "auto", "mamba_track_interval": 256, "tp_size": 1, "dp_size": 1,
    "pp_size": 1, "attn_dp_size": 1, "schedule_policy": "fcfs", "log_level": "info", "dtype": "auto",
    "load_format": "auto", "kv_cache_dtype": "auto", "tokenizer_mode": "auto", "page_size": 1, "stream_interval": 1,
    "schedule_conservativeness": 1.0, "base_gpu_id": 0, "max_prefill_tokens": 16384,
    "max_loras_per_batch": 8, "lora_eviction_policy": "lru", "lora_backend": "csgmv", "max_lora_chunk_size": 16,
    "lora_drain_wait_threshold": 0.0, "json_model_override_args": "{}",
}

# Legacy spellings, applied when the simulated version predates 0.5.22.
_LEGACY_SUBST = [
    ("  --mamba-radix-cache-strategy {auto,no_buffer,extra_buffer,extra_buffer_lazy}",
     "  --mamba-scheduler-strategy {auto,no_buffer,extra_buffer}"),
    ("  --cuda-graph-max-bs-decode CUDA_GRAPH_MAX_BS_DECODE", "  --cuda-graph-max-bs CUDA_GRAPH_MAX_BS"),
]
_LEGACY_DROP = ["  --cuda-graph-max-bs-prefill CUDA_GRAPH_MAX_BS_PREFILL"]


@dataclass(frozen=True)
class SimVersion:
    """The SGLang version being impersonated and the behaviour that hangs on it."""

    text: str

    @property
    def tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", self.text)[:3])

    @property
    def legacy(self) -> bool:
        """True for releases before the 0.5.22 renames (old flag spellings, only get_ endpoints)."""
        return self.tuple < (0, 5, 22)

    @property
    def strategy_flag(self) -> str:
        return "mamba_scheduler_strategy" if self.legacy else "mamba_radix_cache_strategy"


def sim_version() -> SimVersion:
    return SimVersion(os.environ.get("SGLANG_SIM_VERSION", DEFAULT_VERSION))


def _help_lines(version: SimVersion) -> list[str]:
    text = resources.files("sglang_sim").joinpath("data", _HELP_FILE).read_text()
    lines = text.splitlines()
    if version.legacy:
        out = []
        for line in lines:
            if any(line.startswith(d) for d in _LEGACY_DROP):
                continue
            for old, new in _LEGACY_SUBST:
                if line.startswith(old):
                    line = new + line[len(old):]
            out.append(line)
        lines = out
    return lines


def _option_blocks(lines: list[str]) -> list[tuple[str, str]]:
    """(spec, description) for every option listed after `options:`."""
    start = lines.index("options:") + 1
    blocks: list[tuple[str, str]] = []
    for line in lines[start:]:
        if line.startswith("  -"):
            spec, _, desc = line[2:].partition("  ")
            blocks.append((spec.strip(), desc.strip()))
        elif line.startswith("    ") and blocks:
            spec, desc = blocks[-1]
            blocks[-1] = (spec, f"{desc} {line.strip()}".strip())
    return blocks


_ALT = re.compile(r"^(?P<name>--?[A-Za-z0-9][\w-]*)(?: (?P<arg>.+))?$")


def _add_option(parser: argparse.ArgumentParser, spec: str, desc: str) -> None:
    alts = [a.strip() for a in spec.split(", ")]
    names, args = [], []
    for alt in alts:
        m = _ALT.match(alt)
        if not m:
            raise ValueError(f"cannot parse option spec {spec!r}")
        names.append(m["name"])
        args.append(m["arg"])
    if "--help" in names:
        return
    dest = names[0].lstrip("-").replace("-", "_")
    arg = args[0]
    kw: dict[str, Any] = {"dest": dest, "help": desc.replace("%", "%%") or None}
    if any(n.startswith("--no-") for n in names[1:]):
        kw.update(action=argparse.BooleanOptionalAction, default=None)
        parser.add_argument(names[0], **kw)
        return
    if arg is None:
        kw.update(action="store_true", default=False)
        parser.add_argument(*names, **kw)
        return
    kw["default"] = _DEFAULTS.get(dest)
    if arg.endswith(" ...]"):
        kw["nargs"] = "*" if arg.startswith("[") else "+"
        arg = arg.split(" ")[0].strip("[]")
    elif arg.startswith("[") and arg.endswith("]"):
        kw["nargs"] = "?"
        arg = arg[1:-1]
    if arg.startswith("{"):
        kw["choices"] = arg.strip("{}").split(",")
    else:
        kw["metavar"] = arg
    if dest in _INT_FLAGS:
        kw["type"] = int
    elif dest in _FLOAT_FLAGS:
        kw["type"] = float
    if names[0] == "--model-path":
        kw["required"] = True
    parser.add_argument(*names, **kw)


def build_parser(version: SimVersion | None = None) -> argparse.ArgumentParser:
    """The launch parser of `version` (default: env SGLANG_SIM_VERSION, else 0.5.23)."""
    version = version or sim_version()
    # allow_abbrev stays on as in SGLang: that is why `--cuda-graph-max-bs` is "ambiguous" on 0.5.23.
    parser = argparse.ArgumentParser(prog="sglang serve")
    for spec, desc in _option_blocks(_help_lines(version)):
        _add_option(parser, spec, desc)
    return parser


def parse_args(argv: list[str], version: SimVersion | None = None) -> dict[str, Any]:
    """Parse argv like SGLang would; exits with status 2 on an unknown flag or a bad choice."""
    ns = build_parser(version).parse_args(argv)
    return vars(ns)
