"""What every batchfleet command line shares: the parser, the options `--run` and `--redis-url`, number
checks, exit codes, and one line on stderr for every mistake a person can make.

`--run` and `--redis-url` are accepted before or after the subcommand, the same way by `producer`,
`supervisor` and `batchfleet`:

    producer --run r1 status      producer status --run r1      (the same)

The top-level parser gets them with their defaults; each subcommand gets them again with
`argparse.SUPPRESS` as default, so a value given after the subcommand wins and an absent one does
not overwrite the value given before it.

Exit codes, one table for every command (docs/cli.md lists each command's):

    EXIT_OK                0    done
    EXIT_ATTENTION         1    something needs attention (rejected lines, prompts still pending)
    EXIT_USAGE             2    a usage, configuration, Redis, store or I/O error (EXIT_ERROR: the same)
    EXIT_ACTIVE            3    another launcher (`batchfleet run` or `serve`) of the run is active
    EXIT_INTERRUPTED     130    interrupted (Ctrl-C, or SIGTERM while starting)
    EXIT_BROKEN_PIPE     141    stdout was closed under us (`| head`: the rest of the output is dropped
                                quietly, as a shell tool killed by SIGPIPE would)

and the worker's (`rq worker` with worker.GPUWorker):

    EXIT_CONFIG            2    a configuration error a person must fix
    EXIT_SERVER_TAKEN      3    another process holds this GPU's server
    EXIT_SHUTDOWN_COMMAND 75    stopped on request through Redis (EX_TEMPFAIL: a supervisor restarts it)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["EXIT_ACTIVE", "EXIT_ATTENTION", "EXIT_BROKEN_PIPE", "EXIT_CONFIG", "EXIT_ERROR", "EXIT_INTERRUPTED",
           "EXIT_OK", "EXIT_SERVER_TAKEN", "EXIT_SHUTDOWN_COMMAND", "EXIT_USAGE", "REDIS_HELP", "RUN_HELP",
           "Parser", "UsageError",
           "add_common", "at_least", "broken_pipe", "common_parent", "error_line", "fraction", "port",
           "positive", "shown_default"]

# The exit codes (see the module doc).
EXIT_OK = 0
EXIT_ATTENTION = 1
EXIT_USAGE = 2
EXIT_ERROR = EXIT_USAGE  # the launchers' name for it: configuration, Redis, store, I/O, processes that died
EXIT_ACTIVE = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE
EXIT_CONFIG = 2
EXIT_SERVER_TAKEN = 3
EXIT_SHUTDOWN_COMMAND = 75  # EX_TEMPFAIL

RUN_HELP = "run name (default: BATCHFLEET_RUN, else 'default')"
REDIS_HELP = "Redis URL (default: BATCHFLEET_REDIS_URL, else REDIS_URL, else redis://127.0.0.1:6379/0)"


class UsageError(Exception):
    """Bad arguments or environment: exit 2 with the message (one line)."""


# --- the parser --------------------------------------------------------------------------------------
def shown_default(action: argparse.Action) -> str | None:
    """The default `--help` shows for an option: None when there is none worth showing (unset, a
    flag, a list to append to, or a default the help text already explains)."""
    d = action.default
    if d is None or d is argparse.SUPPRESS or isinstance(d, bool) or d == [] or not action.option_strings:
        return None
    if action.help is None or action.help is argparse.SUPPRESS or "default" in action.help:
        return None
    return f"{d:g}" if isinstance(d, float) else str(d)


class _Formatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        shown = shown_default(action)
        if text and shown is not None:
            text = f"{text} (default: {shown.replace('%', '%%')})"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with one line on stderr for a usage mistake (not the usage block) and the defaults
    in `--help`. Subparsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        error_line(self.prog, f"{message} (see {self.prog} --help)")
        sys.exit(EXIT_USAGE)


def add_common(p: argparse.ArgumentParser, *, sub: bool = False, run_help: str = RUN_HELP,
               redis_help: str = REDIS_HELP) -> None:
    """Add `--run` and `--redis-url` to `p` (`sub`: a subcommand's parser, see the module doc)."""
    default = argparse.SUPPRESS if sub else None
    p.add_argument("--run", default=default, metavar="NAME", help=run_help)
    p.add_argument("--redis-url", default=default, metavar="URL", help=redis_help)


def common_parent(run_help: str = RUN_HELP, redis_help: str = REDIS_HELP) -> argparse.ArgumentParser:
    """A parent parser for subcommands (`parents=[common_parent()]`)."""
    p = argparse.ArgumentParser(add_help=False)
    add_common(p, sub=True, run_help=run_help, redis_help=redis_help)
    return p


# --- numbers -----------------------------------------------------------------------------------------
def _number(kind: type, text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive(kind: type = float) -> Callable[[str], Any]:
    """An argparse type: a number > 0."""
    def check(text: str) -> Any:
        value = _number(kind, text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
        return value
    check.__name__ = "positive " + kind.__name__
    return check


def at_least(low: float, kind: type = float) -> Callable[[str], Any]:
    """An argparse type: a number >= `low`."""
    def check(text: str) -> Any:
        value = _number(kind, text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at least {low:g}")
        return value
    check.__name__ = f"number >= {low:g}"
    return check


def fraction(*, zero_ok: bool = False) -> Callable[[str], float]:
    """An argparse type: a fraction in (0, 1) (`zero_ok`: 0 too, meaning "leave it")."""
    def check(text: str) -> float:
        value = _number(float, text)
        if not (0 < value < 1 or (zero_ok and value == 0)):
            raise argparse.ArgumentTypeError(f"{text!r}: must be between 0 and 1" + (" (or 0)" if zero_ok else ""))
        return float(value)
    check.__name__ = "fraction"
    return check


def port(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: off)."""
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return int(value)


# --- one line, an exit code ----------------------------------------------------------------------------
def error_line(prog: str, text: str) -> None:
    """`prog: text` on stderr as one line (a multi-line text keeps its first line), whatever stderr is."""
    first = (text.strip().splitlines() or [""])[0]
    with contextlib.suppress(OSError, ValueError):  # stderr closed too: nothing left to tell
        print(f"{prog}: {first}", file=sys.stderr, flush=True)


def broken_pipe() -> int:
    """stdout's reader went away (`producer status | head -3`): drop the rest of the output quietly.
    Points stdout at /dev/null so that the interpreter's last flush cannot fail again. Returns
    EXIT_BROKEN_PIPE."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE
