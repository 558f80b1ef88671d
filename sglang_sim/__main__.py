"""`python -m sglang_sim <sglang flags>`: a stand-in for `python -m sglang.launch_server`."""

import sys

from .launch import main

if __name__ == "__main__":
    sys.exit(main())
