"""The benches' stand-ins keep up with the product's protocols (bench_dispatch and bench_window crashed
for weeks because `InstantAnswers` lacked `Server.is_generation`: no test ran them)."""

from __future__ import annotations

import inspect

from bench.instant import InstantAnswers
from worker.server_side import Server


def test_instant_answers_has_every_member_of_the_dispatchers_server() -> None:
    wanted = {name for name, _ in inspect.getmembers(Server) if not name.startswith("_")}
    missing = sorted(name for name in wanted if not hasattr(InstantAnswers(), name))
    assert wanted and missing == []
