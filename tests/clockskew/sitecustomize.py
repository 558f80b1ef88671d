"""Test-only: a host whose wall clock is off. When BF_TEST_CLOCK_SKEW_S is set, every Python process
started with this directory on PYTHONPATH (tests/hosts.py does it for a skewed host) sees
`time.time()` and `time.time_ns()` shifted by that many seconds, as if the host's clock were wrong.
Monotonic clocks are left alone, as on a real host whose NTP is broken."""

import os
import time

_skew = float(os.environ.get("BF_TEST_CLOCK_SKEW_S") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
