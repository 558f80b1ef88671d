"""`python -m sglang_sim <sglang flags>`: a stand-in for `python -m sglang.launch_server`."""

import sys


def main() -> int:
    try:
        from .launch import main as launch
    except ModuleNotFoundError as exc:
        if exc.name != "aiohttp":
            raise
        print("sglang_sim: the simulator needs aiohttp, which is not installed: reinstall batchfleet",
              file=sys.stderr)
        return 2
    return launch()


if __name__ == "__main__":
    sys.exit(main())
