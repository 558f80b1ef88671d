"""The simulator's priority scheduling, as SGLang 0.5.23's (`--enable-priority-scheduling`): the waiting
queue in (priority, arrival) order, higher values first; running requests keep running."""

from __future__ import annotations

import asyncio

import httpx

from tests.simproc import start_sim

ENV = {"SGLANG_SIM_STARTUP_S": "0.05", "SGLANG_SIM_TIME_SCALE": "2"}


async def _order(url: str, priorities: list[int | None]) -> tuple[list[int], int]:
    """One request that holds the only slot, then the others queued behind it in the given order (each
    a little after the one before); the order they finish in, and the first one's finish position."""
    done: list[int] = []

    async def one(client: httpx.AsyncClient, i: int, prio: int | None, tokens: int) -> None:
        body = {"messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": tokens, "ignore_eos": True}
        if prio is not None:
            body["priority"] = prio
        r = await client.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        done.append(i)

    async with httpx.AsyncClient() as client:
        tasks = [asyncio.create_task(one(client, 0, None, 100))]
        await asyncio.sleep(0.3)  # the first runs
        for i, prio in enumerate(priorities, 1):
            tasks.append(asyncio.create_task(one(client, i, prio, 8)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    return done, done.index(0)


def test_a_higher_priority_request_runs_before_those_waiting_and_never_preempts_the_running_one() -> None:
    with start_sim("--max-running-requests", "1", "--enable-priority-scheduling", "--disable-priority-preemption",
                   env=ENV) as sim:
        done, first = asyncio.run(_order(sim.url, [None, None, None, 5, None]))
        rec = sim.observed()
    assert first == 0  # the running one was not preempted
    assert done[1:] == [4, 1, 2, 3, 5]  # priority 5 first, then arrival order
    assert rec["aborted_total"] == 0


def test_without_priority_scheduling_a_priority_is_ignored_or_refused_as_asked() -> None:
    with start_sim("--max-running-requests", "1", env=ENV) as sim:
        done, _ = asyncio.run(_order(sim.url, [None, 5, None]))
    assert done == [0, 1, 2, 3]
    with start_sim("--abort-on-priority-when-disabled", env=ENV) as sim:
        r = httpx.post(sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "max_tokens": 2, "priority": 1}, timeout=30)
    assert r.status_code == 503 and "Using priority is disabled for this server" in r.text
