"""The server keeper at the worker's exit: a keeper whose task outlives its cancellation (redis-py may
swallow one that lands inside a command) must not take the server the worker stops for a death and
start another. Seen in a loaded `make test`: a worker told to stop waited 10 s for its keeper, stopped
its server, and the keeper started a new one, which overwrote the first one's observation record."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from batchfleet.config import Config
from batchfleet.errors import ServerDied
from batchfleet.records import ServerSpec, WorkerState
from worker.eventloop import where_it_waits
from worker.keeper import ServerKeeper


class _Server:
    """An SGLangServer's face to the keeper: counts starts; `stop` ends the server."""

    url = "http://127.0.0.1:9"
    facts = None
    gpus = (0,)

    def __init__(self) -> None:
        self.starts = 0
        self.stops = 0
        self.dead = asyncio.Event()

    async def start(self, spec: ServerSpec) -> int:
        self.starts += 1
        self.dead = asyncio.Event()
        return 4

    @property
    def running(self) -> bool:
        return not self.dead.is_set()

    async def stop(self, *, grace_s: float = 30.0) -> None:
        self.stops += 1
        self.dead.set()

    def kill(self) -> None:
        self.dead.set()

    def log_tail(self) -> str:
        return ""


class _StubbornWatch:
    """Waits for the server's end, through its first cancellation too (as a swallowed one leaves it; a
    second ends it), then says the server is gone, as the real watch does when its process exits."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.cancelled = 0

    async def until_change(self, http: object) -> None:
        while True:
            try:
                await self.server.dead.wait()
                break
            except asyncio.CancelledError:
                self.cancelled += 1
                if self.cancelled > 1:
                    raise
        raise ServerDied("no server process")


def test_a_keeper_that_outlives_its_cancellation_does_not_restart_the_server_the_worker_stopped(caplog):
    async def nothing(*args: object, **kwargs: object) -> None:
        return None

    async def desired() -> ServerSpec:
        return ServerSpec()

    async def go() -> tuple[_Server, ServerKeeper, bool]:
        server = _Server()
        gate = SimpleNamespace(resume=lambda: None, pause=lambda: None)
        dispatcher = SimpleNamespace(judge=SimpleNamespace(breaker=SimpleNamespace(reset=lambda: None, open=False)),
                                     limit=SimpleNamespace(set_capacity=lambda *a, **k: None), gate=gate,
                                     takeback=SimpleNamespace(server_lost=nothing))
        keeper = ServerKeeper(Config(run="t"), server, dispatcher, SimpleNamespace(desired=desired, queue="gpu0"),
                              SimpleNamespace(emit=nothing), gpu=0, publish=nothing)
        watch = keeper.watch = _StubbornWatch(server)
        task = asyncio.create_task(keeper.run())
        for _ in range(100):
            if keeper.state is WorkerState.SERVING:
                break
            await asyncio.sleep(0.01)
        assert keeper.state is WorkerState.SERVING and server.starts == 1
        # the worker's exit (service.run): cancel, wait (bounded), then close
        task.cancel()
        await asyncio.wait([task], timeout=0.2)
        assert not task.done() and watch.cancelled == 1  # it outlived its cancellation
        # what the worker's exit logs then: where it waits, innermost last
        where = [step.split()[-1] for step in where_it_waits(task).split(" > ")]
        assert where[-3:] == ["_serve", "until_change", "wait"], where
        await keeper.close()
        await asyncio.wait([task], timeout=2)
        ended = task.done() and not task.cancelled() and task.exception() is None
        task.cancel()
        return server, keeper, ended

    caplog.set_level(logging.INFO, logger="batchfleet.worker")
    server, keeper, ended = asyncio.run(go())
    assert ended  # the keeper ended on its own
    assert (server.starts, server.stops) == (1, 1)  # one server, stopped once, none started after
    assert keeper.deaths == 0 and keeper.state is WorkerState.DOWN
    assert not [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
