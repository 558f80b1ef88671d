"""The options every batchfleet command shares (`--run`, `--redis-url`), accepted before or after
the subcommand the same way by `producer`, `supervisor` and `batchfleet`:

    producer --run r1 status      producer status --run r1      (the same)

The top-level parser gets them with their defaults; each subcommand gets them again with
`argparse.SUPPRESS` as default, so a value given after the subcommand wins and an absent one does
not overwrite the value given before it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_common", "common_parent"]


RUN_HELP = "run name (default: BATCHFLEET_RUN, else 'default')"
REDIS_HELP = "Redis URL (default: BATCHFLEET_REDIS_URL, else REDIS_URL, else redis://127.0.0.1:6379/0)"


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
