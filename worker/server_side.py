"""What the dispatcher needs of its server, and nothing more: the client of the server that serves
now, whether it serves, and its own probe (does it generate?). In the worker the keeper provides them
(`ServerKeeper`, through `GPUService`); tests and benchmarks give a server of their own."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["GenerationClient", "Server"]


class GenerationClient(Protocol):
    """`batchfleet.sglang.SGLangClient`: a generation (PromptError / RetryableError as the server
    answers), and aborts by request id."""

    async def complete(self, url: str, body: dict[str, Any]) -> dict[str, Any]: ...

    async def complete_raw(self, url: str, body: dict[str, Any]) -> tuple[Any, bytes]:
        """`complete`, and the reply's bytes as they came (sent for embeddings)."""
        ...

    async def abort(self, rids: list[str]) -> int: ...


class Server(Protocol):
    @property
    def client(self) -> GenerationClient | None:
        """The client of the server that serves now; None while none does (not started yet, closed)."""
        ...

    def serving(self) -> bool:
        """The server is up and the worker's keeper lets it serve."""
        ...

    async def probe(self) -> bool:
        """Does the server generate at all (the keeper's health probe)? For the breaker."""
        ...

    @property
    def is_generation(self) -> bool | None:
        """What the server serving now said it is (`/model_info` is_generation; None: not said): a
        request of the other kind is never sent to it."""
        ...
