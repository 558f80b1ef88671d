"""A simulator of an SGLang 0.5.23 server (HTTP API, command line, metrics, logs, memory model).

Start it exactly like SGLang: `python -m sglang_sim --model-path M --port P ...`. Test-only
conveniences live in env vars (SGLANG_SIM_*), the `/sim/observed` route and the record file.
"""

from .textgen import count_tokens, expected_completion, render_chat

__all__ = ["count_tokens", "expected_completion", "render_chat"]
