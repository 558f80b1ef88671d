"""The LoRA adapters a request names, and `POST /load_lora_adapter` and `/unload_lora_adapter`, with
SGLang 0.5.23's shapes.

(upstream, under sglang/srt/: `entrypoints/openai/serving_base.py` `_parse_model_parameter`,
`_resolve_lora_path` (the `model` suffix wins over `lora_path`); `managers/io_struct.py`
`_normalize_lora_paths`; `managers/tokenizer_manager.py` `_validate_and_resolve_lora`.)

(upstream, under sglang/srt/: `entrypoints/http_server.py` `load_lora_adapter`, `unload_lora_adapter`
(200 on success, else 400); `managers/tokenizer_control_mixin.py` `load_lora_adapter` (the
`--max-loaded-loras` LRU unload), `unload_lora_adapter`, `_unload_lora_adapter_locked` (unregister, then
wait for the adapter's requests in flight); `managers/io_struct.py` `LoadLoRAAdapterReqInput`,
`UnloadLoRAAdapterReqInput`, `LoRAUpdateOutput` (`rid`, `http_worker_ipc`, `success`, `error_message`,
`loaded_adapters`).)
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from .logs import log
from .lora import AdapterError

if TYPE_CHECKING:
    from .engine import Request
    from .lora import Adapter, Registry
    from .server import ServerState, SimServer

__all__ = ["LoraRoutes", "RequestAdapters"]

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


def _result(success: bool, error: str | None, loaded: dict[str, str] | None) -> web.Response:
    body = {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error,
            "loaded_adapters": loaded}
    return web.Response(body=orjson.dumps(body), status=200 if success else 400, content_type="application/json")


def _missing(field: str) -> web.Response:
    body = {"object": "error", "message": f"1 validation error: [{{'type': 'missing', 'loc': ('body', '{field}'), "
            "'msg': 'Field required'}]", "type": "Bad Request", "param": None, "code": 400}
    return web.Response(body=orjson.dumps(body), status=400, content_type="application/json")


class RequestAdapters:
    """Which adapter each item of a request runs on (ValueError: SGLang's 400s)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def parse_model(self, model: str | None) -> str | None:
        """The adapter a `model` names: `<served>:<adapter>`, else split at the first colon (the base part
        unchecked); no colon or an empty adapter: none (a bare adapter name runs the base model)."""
        if not model or ":" not in model:
            return None
        served = self.state.model_name
        if model == served:
            return None
        adapter = model[len(served) + 1:] if model.startswith(f"{served}:") else model.split(":", 1)[1]
        return adapter.strip() or None

    def names(self, model: str | None, lora_path: Any, n: int, *, single: bool) -> list[str | None]:
        """Each item's adapter name: the `model` suffix wins over `lora_path` (str, or a list per item)."""
        named = self.parse_model(model)
        if named is not None:
            return [named] * n
        if isinstance(lora_path, list):
            if single:
                lora_path = next((p for p in lora_path if p), None)
            elif len(lora_path) != n:
                raise ValueError(f"lora_path list length ({len(lora_path)}) must match batch size ({n})")
            else:
                return [p or None for p in lora_path]
        return [lora_path or None] * n

    def resolve(self, names: list[str | None]) -> list[Adapter | None]:
        """The adapters, reloading an evicted one implicitly."""
        if all(n is None for n in names):
            return [None] * len(names)
        if self.state.lora is None:
            first = next(n for n in names if n is not None)
            raise ValueError(f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the "
                             "server with --enable-lora flag and preload adapters using --lora-paths or "
                             "/load_lora_adapter endpoint.")
        adapters, reloaded = self.state.lora.resolve(names)
        for name in reloaded:
            log(f"Reloading evicted adapter: {name}")
        return adapters

    def hold(self, reqs: list[Request]) -> None:
        """The requests are about to enter the scheduler: an unload of their adapter waits for them."""
        if self.state.lora is not None:
            for r in reqs:
                self.state.lora.hold(r.lora_id)


class LoraRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def _loaded(self, reg: Registry) -> dict[str, str]:
        return {a.name: a.path for a in reg.registry.values()}

    async def _body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def _retire(self, reg: Registry, lora_id: str) -> None:
        """After unregistering: wait for the adapter's requests in flight, then free its GPU slots."""
        while reg.in_flight.get(lora_id):
            await asyncio.sleep(0.01)
        for rank in self.server.engine.ranks:
            if rank.slots is not None:
                rank.slots.drop(lora_id)

    async def load(self, request: web.Request) -> web.Response:
        srv = self.server
        body = await self._body(request)
        if body is None or "lora_name" not in body or "lora_path" not in body:
            return _missing("lora_name" if body is None or "lora_name" not in body else "lora_path")
        reg = srv.state.lora
        if reg is None:
            return _result(False, NOT_ENABLED, None)
        if srv.state.layout.dp > 1:  # an assert, not caught: FastAPI answers 500
            return web.Response(status=500, text="Internal Server Error")
        try:
            evicted = reg.load(str(body["lora_name"]), str(body["lora_path"]), pinned=bool(body.get("pinned")))
        except AdapterError as e:
            return _result(False, str(e), self._loaded(reg))
        for victim in evicted:
            await self._retire(reg, reg.ever[victim].lora_id)
        return _result(True, "", self._loaded(reg))

    async def unload(self, request: web.Request) -> web.Response:
        srv = self.server
        body = await self._body(request)
        if body is None or "lora_name" not in body:
            return _missing("lora_name")
        reg = srv.state.lora
        if reg is None:
            return _result(False, NOT_ENABLED, None)
        if srv.state.layout.dp > 1:
            return web.Response(status=500, text="Internal Server Error")
        name = str(body["lora_name"])
        log(f"Start unload Lora adapter. Lora name={name}")
        try:
            adapter = reg.unregister(name)
        except AdapterError as e:
            return _result(False, str(e), None)
        await self._retire(reg, adapter.lora_id)
        return _result(True, "", self._loaded(reg))
