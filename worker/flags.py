"""Which flags to pass to this SGLang server, decided from what its own `--help` lists.

Flag spellings drift between releases (`--mamba-scheduler-strategy` became
`--mamba-radix-cache-strategy` in 0.5.22 and the old spelling is gone; an unknown flag makes the
server exit at once). So spellings are chosen from the installed server's `--help`, never from a
table alone, and a flag the server does not list is never sent.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass

from batchfleet import sglang
from batchfleet.config import Config, lora_item
from batchfleet.errors import ConfigError, ServerStartError
from batchfleet.records import Strategy

__all__ = ["ServerCLI", "build_argv", "lora_flags", "parallel_flags", "read_server_cli", "server_shape", "tp_size_for"]

NEW_STRATEGY_FLAG = "--mamba-radix-cache-strategy"  # 0.5.22+
OLD_STRATEGY_FLAG = "--mamba-scheduler-strategy"  # before 0.5.22
# A request's `priority` orders the server's waiting queue (higher first); nothing running is preempted.
PRIORITY_FLAGS = ["--enable-priority-scheduling", "--disable-priority-preemption"]
# Tensor parallelism, spelled as the server's --help lists it (0.5.23: `--tp-size`, alias
# `--tensor-parallel-size`); the other sizes only as the user gives them in BATCHFLEET_SERVER_ARGS.
TP_FLAGS = ("--tp-size", "--tensor-parallel-size")
PP_FLAGS = ("--pp-size", "--pipeline-parallel-size")
DP_FLAGS = ("--dp-size", "--data-parallel-size")
ATTN_DP_FLAGS = ("--attn-dp-size", "--attention-data-parallel-size")
DP_ATTENTION_FLAG = "--enable-dp-attention"
_FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
_CHOICES = re.compile(r"(--[a-z0-9][a-z0-9-]*)\s+\{([^}]*)\}")


@dataclass(frozen=True, slots=True)
class ServerCLI:
    """The flags (and their choices) one installed server accepts."""

    flags: frozenset[str]
    choices: dict[str, frozenset[str]]

    @classmethod
    def from_help(cls, text: str) -> ServerCLI:
        choices = {m.group(1): frozenset(c.strip() for c in m.group(2).split(",")) for m in _CHOICES.finditer(text)}
        return cls(flags=frozenset(_FLAG.findall(text)), choices=choices)

    def knows(self, flag: str) -> bool:
        return flag in self.flags

    def accepts(self, flag: str, value: str) -> bool:
        return self.knows(flag) and (flag not in self.choices or value in self.choices[flag])


def read_server_cli(cmd: list[str], *, timeout_s: float = 300.0) -> ServerCLI:
    """Run `<server command> --help` and read which flags it lists."""
    try:
        done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerStartError(f"could not run {shlex.join(cmd)} --help: {exc}") from exc
    text = done.stdout + done.stderr
    if done.returncode != 0 or "--model-path" not in text:
        raise ServerStartError(f"{shlex.join(cmd)} --help did not list --model-path (exit {done.returncode})",
                               log_tail=text[-2000:])
    return ServerCLI.from_help(text)


def strategy_flags(strategy: Strategy | str, cli: ServerCLI) -> list[str]:
    """Flags for one rung of the strategy ladder on this server; ConfigError when it cannot do it."""
    strategy = Strategy(strategy)
    if strategy is Strategy.DEFAULT:
        return []  # the server's own `auto`
    if strategy is Strategy.NO_RADIX:
        if not cli.knows("--disable-radix-cache"):
            raise ConfigError("this server has no --disable-radix-cache")
        return ["--disable-radix-cache"]
    if cli.accepts(NEW_STRATEGY_FLAG, strategy):
        out = [NEW_STRATEGY_FLAG, strategy.value]
        # 0.5.23 refuses an explicit no_buffer while the overlap scheduler is on (`auto` would turn
        # it off by itself); releases with the new spelling are the ones that validate this.
        if strategy is Strategy.NO_BUFFER and cli.knows("--disable-overlap-schedule"):
            out.append("--disable-overlap-schedule")
        return out
    if cli.accepts(OLD_STRATEGY_FLAG, strategy):
        return [OLD_STRATEGY_FLAG, strategy.value]
    raise ConfigError(f"this server accepts no mamba strategy {strategy.value!r} (neither {NEW_STRATEGY_FLAG} "
                      f"nor {OLD_STRATEGY_FLAG} lists it)")


def _size(tokens: list[str], names: tuple[str, ...]) -> int | None:
    raw = sglang.flag_value(tokens, *names)
    if raw is None:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"BATCHFLEET_SERVER_ARGS has {names[0]} {raw!r}: it must be a positive whole number")
    return int(raw)


def tp_size_for(extra: list[str], gpus: tuple[int, ...]) -> tuple[int, bool]:
    """The tensor-parallel size of a server on `gpus`, and whether the user's BATCHFLEET_SERVER_ARGS
    (`extra`) already says it. As SGLang lays a server out (sglang_sim/parallel.py), it uses
    TP x PP x (DP replicas) GPUs, where `--dp-size` with `--enable-dp-attention` (or `--attn-dp-size`)
    is attention data parallelism inside the TP group and adds none. So TP = GPUs / (PP x replicas);
    a `--tp-size` the user gave must agree with the group, else ConfigError (one line)."""
    tp, pp, dp = _size(extra, TP_FLAGS), _size(extra, PP_FLAGS) or 1, _size(extra, DP_FLAGS) or 1
    attention_dp = DP_ATTENTION_FLAG in extra or (_size(extra, ATTN_DP_FLAGS) or 1) > 1
    replicas = 1 if attention_dp else dp
    n = len(gpus)
    what = f"GPU {gpus[0]}" if n == 1 else f"a group of {n} GPUs ({','.join(map(str, gpus))})"
    if tp is not None:
        if tp * pp * replicas != n:
            uses = f"--tp-size {tp}" + (f" x --pp-size {pp}" if pp > 1 else "") + (
                f" x --dp-size {replicas}" if replicas > 1 else "")
            world = tp * pp * replicas
            raise ConfigError(f"BATCHFLEET_SERVER_ARGS has {uses} = {world} GPU(s), but this worker's server runs on "
                              f"{what}: make them agree (a server on {world} GPUs is the worker of a group's queue, "
                              f"e.g. <host>.gpu0-{world - 1}), or leave --tp-size out: the worker sets it")
        return tp, True
    if n % (pp * replicas):
        raise ConfigError(f"this worker's server runs on {what}, which {pp * replicas} pipeline stage(s) x "
                          "data-parallel replica(s) (BATCHFLEET_SERVER_ARGS --pp-size, --dp-size) do not divide")
    return n // (pp * replicas), False


def parallel_flags(config: Config, cli: ServerCLI, gpus: tuple[int, ...]) -> list[str]:
    """The tensor-parallel size of a server on `gpus`, in this server's spelling; nothing on one GPU
    (SGLang's default, 1) or when BATCHFLEET_SERVER_ARGS already gives it (and agrees)."""
    tp, given = tp_size_for(config.server_argv_extra, gpus)
    if given or tp == 1:
        return []
    for flag in TP_FLAGS:
        if cli.knows(flag):
            return [flag, str(tp)]
    raise ConfigError(f"this server lists no {TP_FLAGS[0]} (nor {TP_FLAGS[1]}) in its --help: it cannot run on "
                      f"{len(gpus)} GPUs")


def lora_flags(config: Config) -> list[str]:
    """The fleet's LoRA adapters (BATCHFLEET_LORA_PATHS) as SGLang 0.5.23 loads them at start:
    `--enable-lora --lora-paths NAME=PATH ... [--max-loras-per-batch N]`; nothing without adapters. The
    paths are passed as given: a directory with the PEFT `adapter_config.json` on the server's host, or a
    hub id the server downloads."""
    if not config.lora_paths:
        return ["--max-loras-per-batch", str(config.max_loras_per_batch)] if config.max_loras_per_batch else []
    items = [f"{name}={path}" for name, path in (lora_item(i) for i in config.lora_paths)]
    out = ["--enable-lora", "--lora-paths", *items]
    if config.max_loras_per_batch:
        out += ["--max-loras-per-batch", str(config.max_loras_per_batch)]
    return out


def build_argv(config: Config, cli: ServerCLI, *, port: int, strategy: Strategy | str | None = None,
               mem_fraction_static: float | None = None, max_running_requests: int | None = None,
               gpus: tuple[int, ...] = (0,)) -> list[str]:
    """The full command line of one server (on `gpus`: its tensor-parallel size). Explicit arguments
    override the configuration (the supervisor's restarts use them); every generated flag is checked
    against `cli`."""
    if not config.model_path:
        raise ConfigError("no model: set BATCHFLEET_MODEL_PATH")
    want: list[str] = ["--model-path", config.model_path, "--host", config.server_host, "--port", str(port),
                       *parallel_flags(config, cli, gpus)]
    if cli.knows("--enable-metrics"):
        want.append("--enable-metrics")  # the supervisor needs running/queued/KV/mamba gauges
    mem = mem_fraction_static if mem_fraction_static is not None else config.mem_fraction_static
    if mem is not None:
        want += ["--mem-fraction-static", str(mem)]
    mrr = max_running_requests if max_running_requests is not None else config.max_running_requests
    if mrr is not None:
        want += ["--max-running-requests", str(mrr)]
    if config.server_api_key:
        want += ["--api-key", config.server_api_key]
    want += strategy_flags(strategy or config.strategy, cli)
    if config.priority_scheduling:
        want += PRIORITY_FLAGS
    want += lora_flags(config)
    extra = config.server_argv_extra
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and not cli.knows(flag):
            raise ConfigError(f"BATCHFLEET_SERVER_ARGS has {flag}, which this server does not accept "
                              "(see its --help); it would make the server exit at start-up")
    for token in want:
        if token.startswith("--") and not cli.knows(token):
            raise ConfigError(f"this server does not accept {token}")
    # Generated flags come last so that a restart's strategy/memory overrides win over the same
    # flag in BATCHFLEET_SERVER_ARGS (argparse keeps the last occurrence).
    return [*shlex.split(config.sglang_cmd), *extra, *want]


# The parallel layout's flags, every spelling SGLang 0.5.23's argparse accepts (its aliases, and the
# short prefixes the brief's users type; argparse takes an unambiguous prefix of a long option).
_SIZE_FLAGS = {
    "tp": ("--tp-size", "--tensor-parallel-size", "--tp"),
    "dp": ("--dp-size", "--data-parallel-size", "--dp"),
    "pp": ("--pp-size", "--pipeline-parallel-size", "--pp"),
}
_DP_ATTENTION = "--enable-dp-attention"


def server_shape(argv: list[str]) -> str:
    """The server's shape, read from the command line the worker starts it with: tensor-, data- and
    pipeline-parallel sizes (1 when not given; argparse keeps the last occurrence) and whether
    attention runs data-parallel. Compact, for status records and the supervisor's peer groups:
    "tp1", "tp4", "tp2dp2+dpattn", "tp4pp2". A value that is not a positive integer counts as 1
    (the server itself would refuse it)."""
    sizes = {"tp": 1, "dp": 1, "pp": 1}
    dp_attention = False
    spelled = {flag: name for name, flags in _SIZE_FLAGS.items() for flag in flags}
    for i, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if flag == _DP_ATTENTION and not eq:
            dp_attention = True
            continue
        name = spelled.get(flag)
        if name is None:
            continue
        value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        sizes[name] = int(value) if value.isdigit() and int(value) > 0 else 1
    shape = f"tp{sizes['tp']}" + (f"dp{sizes['dp']}" if sizes["dp"] > 1 else "") + \
        (f"pp{sizes['pp']}" if sizes["pp"] > 1 else "")
    return shape + ("+dpattn" if dp_attention else "") + _lora_shape(argv)


def _lora_shape(argv: list[str]) -> str:
    """"+lora<N>" for a server with LoRA on (`--enable-lora` or `--lora-paths`; N its
    `--max-loras-per-batch`, SGLang's 8 unset): its adapter slots take GPU memory before the KV cache is
    sized, so it is another kind of server to the fleet's memory and the supervisor's peer groups."""
    if "--enable-lora" not in argv and "--lora-paths" not in argv:
        return ""
    n = sglang.flag_value(argv, "--max-loras-per-batch")
    return f"+lora{n if n and n.isdigit() else 8}"
