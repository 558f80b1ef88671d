"""Flag spellings come from the server's own --help; a flag it does not list is never sent."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from batchfleet import sglang
from batchfleet.config import Config
from batchfleet.errors import ConfigError
from worker.flags import ServerCLI, build_argv, tp_size_for

HELP_0523 = (Path(__file__).parents[1] / "sglang_sim" / "data" / "launch-help-0.5.23.txt")
LEGACY_HELP = """usage: launch_server.py [-h] --model-path MODEL_PATH [--host HOST] [--port PORT]
  [--mem-fraction-static MEM_FRACTION_STATIC] [--max-running-requests MAX_RUNNING_REQUESTS]
  [--disable-radix-cache] [--disable-overlap-schedule] [--enable-metrics]
  [--mamba-scheduler-strategy {auto,no_buffer,extra_buffer}]
"""


@pytest.fixture(scope="module")
def cli_0523() -> ServerCLI:
    # The simulator bundles the real --help of SGLang 0.5.23.
    return ServerCLI.from_help(HELP_0523.read_text())


def cfg(**kw) -> Config:
    return Config(model_path="/models/m", sglang_cmd="python -m sglang.launch_server", **kw)


def test_new_spelling_and_overlap_for_no_buffer(cli_0523):
    argv = build_argv(cfg(), cli_0523, port=30003, strategy="no_buffer", mem_fraction_static=0.9,
                      max_running_requests=128)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--mamba-scheduler-strategy" not in argv
    i = argv.index("--mamba-radix-cache-strategy")
    assert argv[i + 1] == "no_buffer" and "--disable-overlap-schedule" in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "30003"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.9"
    assert "--enable-metrics" in argv


def test_legacy_spelling_without_overlap_flag():
    cli = ServerCLI.from_help(LEGACY_HELP)
    argv = build_argv(cfg(), cli, port=30000, strategy="no_buffer")
    assert argv[argv.index("--mamba-scheduler-strategy") + 1] == "no_buffer"
    assert "--mamba-radix-cache-strategy" not in argv and "--disable-overlap-schedule" not in argv
    with pytest.raises(ConfigError):  # the old flag has no extra_buffer_lazy choice
        build_argv(cfg(), cli, port=30000, strategy="extra_buffer_lazy")


def test_default_strategy_sends_nothing_and_radix_off(cli_0523):
    argv = build_argv(cfg(), cli_0523, port=30000, strategy="default")
    assert not any("mamba" in a for a in argv) and "--disable-radix-cache" not in argv
    assert "--disable-radix-cache" in build_argv(cfg(), cli_0523, port=30000, strategy="no_radix")


def test_unknown_extra_flag_is_refused_before_start(cli_0523):
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        build_argv(cfg(server_args="--cuda-graph-max-bs 64"), cli_0523, port=30000)
    argv = build_argv(cfg(server_args="--cuda-graph-max-bs-decode 64 --tp-size 1"), cli_0523, port=30000)
    assert "--cuda-graph-max-bs-decode" in argv


def test_capacity_is_the_effective_value_never_the_requested_one():
    info = {"max_running_requests": 128, "internal_states": [
        {"effective_max_running_requests_per_dp": 36}, {"effective_max_running_requests_per_dp": 36}]}
    assert sglang.effective_capacity(info) == 72
    assert sglang.effective_capacity({"max_running_requests": 128}) is None
    log = ("[2026-11-29 08:00:00] max_total_num_tokens=195000, chunked_prefill_size=8192, "
           "max_prefill_tokens=16384, max_running_requests=37, context_len=262144, available_gpu_mem=3.10 GB\n")
    assert sglang.capacity_from_log(log) == 37
    assert sglang.capacity_from_log(log + "[x] Post-capture KV sizing: max_running_requests 37 -> 36\n") == 36


def test_metrics_parsing_combines_ranks():
    text = """# HELP sglang:num_running_reqs x
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",dp_rank="0"} 30.0
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",dp_rank="1"} 2.0
sglang:mamba_usage{model_name="m",dp_rank="0"} 0.61
sglang:mamba_usage{model_name="m",dp_rank="1"} 0.1
sglang:full_token_usage{model_name="m"} 0.21
sglang:cache_hit_rate{model_name="m"} 0.05
sglang:gen_throughput{model_name="m"} 487.2
"""
    m = sglang.parse_metrics(text)
    assert m.running == 32 and m.mamba_usage == 0.61 and m.full_kv_usage == 0.21
    assert m.gen_throughput == 487.2 and m.queued is None


# --- a server on a group of GPUs ---------------------------------------------------------------------------
def _tp(argv: list[str]) -> list[str]:
    return [a for i, a in enumerate(argv) if "tp-size" in a or "tensor-parallel" in a or (
        i and ("tp-size" in argv[i - 1] or "tensor-parallel" in argv[i - 1]))]


def test_a_group_of_gpus_passes_its_tensor_parallel_size_as_the_servers_help_spells_it(cli_0523):
    assert _tp(build_argv(cfg(), cli_0523, port=30000)) == []  # one GPU: SGLang's default, nothing sent
    assert _tp(build_argv(cfg(), cli_0523, port=30000, gpus=(0, 1, 2, 3))) == ["--tp-size", "4"]
    # a release that lists only the long spelling gets that one; one that lists neither cannot run a group
    long_only = ServerCLI.from_help(LEGACY_HELP + "  [--tensor-parallel-size TENSOR_PARALLEL_SIZE]\n")
    assert _tp(build_argv(cfg(), long_only, port=30000, gpus=(4, 5))) == ["--tensor-parallel-size", "2"]
    with pytest.raises(ConfigError, match="lists no --tp-size"):
        build_argv(cfg(), ServerCLI.from_help(LEGACY_HELP), port=30000, gpus=(0, 1))


@pytest.mark.parametrize("args, gpus, tp", [
    ("--tp-size 4", (0, 1, 2, 3), None),  # the user's agrees: sent once, as the user wrote it
    ("--tp-size=2", (0, 1), None),
    ("--tensor-parallel-size 2", (6, 7), None),
    ("--dp-size 2", (0, 1, 2, 3), "2"),  # 2 replicas of TP2
    ("--dp-size 4 --enable-dp-attention", (0, 1, 2, 3), "4"),  # attention DP inside one TP4 group
    ("--attn-dp-size 2", (0, 1, 2, 3), "4"),
    ("--pp-size 2", (0, 1, 2, 3), "2"),
    ("--pp-size 2 --dp-size 2", (0, 1, 2, 3), None),  # TP1 x PP2 x 2 replicas: nothing to add
])
def test_the_tensor_parallel_size_fills_the_group_with_the_users_other_sizes(cli_0523, args, gpus, tp):
    argv = build_argv(cfg(server_args=args), cli_0523, port=30000, gpus=gpus)
    sent = [argv[i + 1] for i, a in enumerate(argv) if a == "--tp-size" and i >= argv.index("--model-path")]
    assert sent == ([tp] if tp else [])
    assert tp_size_for(shlex.split(args), gpus)[1] is ("tp-size" in args or "parallel-size" in args)


@pytest.mark.parametrize("args, gpus, words", [
    ("--tp-size 2", (0, 1, 2, 3), "--tp-size 2 = 2 GPU(s), but this worker's server runs on a group of 4 GPUs"),
    ("--tp-size 2", (3,), "runs on GPU 3"),
    ("--tp-size 4 --dp-size 2", (0, 1, 2, 3), "--tp-size 4 x --dp-size 2 = 8 GPU(s)"),
    ("--dp-size 3", (0, 1, 2, 3), "do not divide"),
    ("--tp-size four", (0, 1), "must be a positive whole number"),
])
def test_a_users_tensor_parallel_size_that_disagrees_with_the_group_is_one_line(cli_0523, args, gpus, words):
    with pytest.raises(ConfigError) as exc:
        build_argv(cfg(server_args=args), cli_0523, port=30000, gpus=gpus)
    assert words in str(exc.value) and "\n" not in str(exc.value)
@pytest.mark.parametrize(("argv", "shape"), [
    ([], "tp1"),
    (["--model-path", "/m", "--port", "30000"], "tp1"),
    (["--tp-size", "4"], "tp4"),
    (["--tp", "4"], "tp4"),
    (["--tensor-parallel-size=8"], "tp8"),
    (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], "tp2dp2+dpattn"),
    (["--tp-size", "4", "--data-parallel-size", "2"], "tp4dp2"),
    (["--tp-size", "4", "--pp-size", "2"], "tp4pp2"),
    (["--tp-size", "2", "--tp-size", "4"], "tp4"),  # argparse keeps the last occurrence
    (["--enable-dp-attention-local-control-broadcast", "--tp-size", "2"], "tp2"),  # another flag
    (["--tp-size", "x"], "tp1"),  # not a size: the server would refuse it; counted as 1
    (["--tp-size"], "tp1"),
])
def test_server_shape_from_the_servers_own_argv(argv, shape):
    from worker.flags import server_shape

    assert server_shape(argv) == shape


def test_server_shape_of_a_built_command_line(cli_0523):
    """The shape is read from the final command line the keeper starts (extra args included)."""
    from worker.flags import server_shape

    c = Config(model_path="/models/m", sglang_cmd="python -m sglang.launch_server",
               server_args="--tp-size 2 --dp-size 2 --enable-dp-attention")
    assert server_shape(build_argv(c, cli_0523, port=30000, gpus=(0, 1))) == "tp2dp2+dpattn"
    # the worker of a group adds the size itself
    assert server_shape(build_argv(cfg(), cli_0523, port=30000, gpus=(0, 1, 2, 3))) == "tp4"
    assert server_shape(build_argv(cfg(), cli_0523, port=30000)) == "tp1"


def test_priority_scheduling_starts_the_server_ordering_its_queue_by_priority_without_preemption(cli_0523):
    assert "--enable-priority-scheduling" not in build_argv(cfg(), cli_0523, port=30000)
    argv = build_argv(cfg(priority_scheduling=True), cli_0523, port=30000)
    assert "--enable-priority-scheduling" in argv and "--disable-priority-preemption" in argv
    with pytest.raises(ConfigError, match="--enable-priority-scheduling"):  # a server that does not know it
        build_argv(cfg(priority_scheduling=True), ServerCLI.from_help(LEGACY_HELP), port=30000)
