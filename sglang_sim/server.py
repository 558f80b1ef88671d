"""The HTTP face of the simulator: SGLang's native endpoints (aiohttp), plus `/sim/observed`.

OpenAI-compatible routes live in openai_api.py; both go through `SimServer.submit_and_wait`.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from .embedding import embedding_json
from .engine import Engine, QueueFullError, Request, embedding_request
from .info import model_cards, model_info, server_info
from .lora import Adapter, LoraSettings, Registry
from .lora_api import RequestAdapters
from .memory import MemoryPlan
from .model_kind import ModelKind
from .parallel import Layout
from .profiles import Profile
from .record import Recorder
from .textgen import ACCEPTED_SAMPLING_KEYS, count_tokens, generate, token_ids

__all__ = ["RequestError", "ServerState", "SimServer", "error_response", "set_priority", "submit_all", "wait_any"]

EOS_TOKEN_ID = 151645
# How often SGLang checks whether the client of a non-streaming request is still there (4 s in 0.5.23);
# default 0 here: a client that leaves aborts its request at once (see `submit_and_wait`).
DISCONNECT_CHECK_S = float(os.environ.get("SGLANG_SIM_DISCONNECT_CHECK_S", "0") or 0)


class RequestError(Exception):
    """A request the server refuses before scheduling it (status + message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class ServerState:
    version: str
    legacy: bool
    flags: dict[str, Any]
    profile: Profile
    plan: MemoryPlan
    strategy: str
    overlap: bool
    time_scale: float
    model_name: str
    layout: Layout = field(default_factory=Layout)
    kind: ModelKind = field(default_factory=ModelKind)
    lora_settings: LoraSettings = field(default_factory=lambda: LoraSettings(enabled=False))
    lora: Registry | None = None  # LoRA on: the adapters


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    """SGLang's body for a failed `/generate`: a ValueError (400) is `{"error": {"message"}}`
    (`_create_error_response`); a scheduler abort with a 5xx status becomes an HTTPException, which
    its handler answers as an OpenAI ErrorResponse whose type is the status (upstream:
    srt/entrypoints/http_server.py, srt/managers/tokenizer_manager.py `_handle_abort_finish_reason`)."""
    if status >= 500:
        return _json({"object": "error", "message": message, "type": str(status), "param": None, "code": status},
                     status)
    return _json({"error": {"message": message}}, status)


SICK_MESSAGE = "Internal server error: the scheduler failed this request (SGLANG_SIM_SICK_AFTER)."


def set_priority(srv: SimServer, reqs: list[Request], value: Any) -> None:
    """A request's `priority` (an int; anything else is left out). Used only with
    --enable-priority-scheduling; without it, --abort-on-priority-when-disabled refuses it with
    0.5.23's abort (503), else it is ignored (`Scheduler._set_or_validate_priority`)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return
    if not srv.engine.cfg.priority_scheduling:
        if srv.state.flags.get("abort_on_priority_when_disabled"):
            raise RequestError(503, "Using priority is disabled for this server. Please send a new request "
                                    "without a priority.")
        return
    for r in reqs:
        r.priority = value


class SimServer:
    def __init__(self, state: ServerState, engine: Engine, recorder: Recorder) -> None:
        self.state, self.engine, self.recorder = state, engine, recorder
        self.adapters = RequestAdapters(state)  # the LoRA adapters requests name
        self.ready = False
        self.created = int(time.time())

    # ---- request life ------------------------------------------------------------------------
    def validate_length(self, prompt_tokens: int, max_new: int | None, *, openai: bool) -> None:
        ctx = self.state.plan.context_len
        if prompt_tokens >= ctx:
            raise RequestError(400, f"The input ({prompt_tokens} tokens) is longer than the model's context "
                                    f"length ({ctx} tokens).")
        if max_new is not None and prompt_tokens + max_new > ctx and not self.state.flags.get("allow_auto_truncate"):
            raise RequestError(
                400,
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {prompt_tokens + max_new} tokens: {prompt_tokens} tokens from the "
                f"input messages and {max_new} tokens for the completion. Please reduce the number of tokens "
                "in the input messages or the completion to fit within the limit.",
            )

    def make_request(self, prompt: str, params: dict[str, Any], *, rid: str, endpoint: str,
                     index: int = 0, internal: bool = False, openai: bool = False,
                     adapter: Adapter | None = None) -> Request:
        words = prompt.split()
        max_new = params.get("max_new_tokens")
        self.validate_length(max(1, len(words)), max_new, openai=openai)
        name = adapter.name if adapter else None
        lora_id = adapter.lora_id if adapter else None
        if self.state.kind.is_embedding:
            # no guard in 0.5.23: the request is prefilled through the pooler; one that would decode
            # kills the scheduler at its first decode step (engine.py); max_new_tokens <= 1 finishes
            decodes = (128 if max_new is None else int(max_new)) > 1
            return Request(rid=rid, prompt_words=words, output_words=[], finish_reason="length", matched_stop=None,
                           endpoint=endpoint, internal=internal, adapter=name, lora_id=lora_id, embedding=True,
                           crash_on_decode=decodes)
        if max_new is None:  # "until EOS or the context is full"
            params = {**params, "max_new_tokens": self.state.plan.context_len - count_tokens(prompt)}
        out, finish, matched = generate(prompt, params, index=index, adapter=name)
        return Request(rid=rid, prompt_words=words, output_words=out, finish_reason=finish,
                       matched_stop=matched, endpoint=endpoint, internal=internal, adapter=name, lora_id=lora_id)

    async def submit_and_wait(self, reqs: list[Request]) -> None:
        """Queue the requests and wait; a client that goes away aborts them (handler cancellation).

        SGLang 0.5.23 notices that the client of a non-streaming request left only when its wait times
        out, every 4 s (`TokenizerManager._wait_one_response`: `wait_for(state.event.wait(), timeout=4)`,
        then `request.is_disconnected()` -> `abort_request(rid)`). SGLANG_SIM_DISCONNECT_CHECK_S sets
        that period (default 0: at once); `POST /abort_request` aborts at once either way."""
        submit_all(self.engine, reqs)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            for r in reqs:
                await r.done.wait()
        except asyncio.CancelledError:
            period = DISCONNECT_CHECK_S
            if period > 0:
                loop.call_later(period - (loop.time() - started) % period, self._client_left, reqs)
            else:
                self._client_left(reqs)
            raise

    def _client_left(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.engine.finish_abort(r, "The client disconnected.")

    def check_generation_fault(self, prompts: list[Any] | None = None) -> None:
        if self.engine.faults.on_generation_request():
            raise RequestError(500, SICK_MESSAGE)
        if self.engine.faults.draw_error(prompts):
            raise RequestError(500, "Internal server error (SGLANG_SIM_ERROR_RATE / SGLANG_SIM_ERROR_MARKER).")

    def finish_reason(self, r: Request) -> dict[str, Any]:
        if r.state == "aborted":
            return {"type": "abort", "message": r.abort_message, "status_code": r.abort_status}
        if r.finish_reason == "stop":
            return {"type": "stop", "matched": r.matched_stop if r.matched_stop is not None else EOS_TOKEN_ID}
        return {"type": "length", "length": r.generated}

    def meta_info(self, r: Request) -> dict[str, Any]:
        end = r.finish_model if r.finish_model is not None else self.engine.model_now()
        return {
            "id": r.rid,
            "finish_reason": self.finish_reason(r) if r.state in ("finished", "aborted") else None,
            "prompt_tokens": r.prompt_tokens,
            "weight_version": "default",
            "completion_tokens": r.generated,
            "cached_tokens": r.cached_tokens,
            "e2e_latency": round(end - r.arrival_model, 6),
            "queue_time": round((r.admitted_model or end) - r.arrival_model, 6),
            "num_retractions": r.retractions,
        }

    def native_output(self, r: Request) -> dict[str, Any]:
        if r.embedding:  # a generation request an embedding server finished in its prefill
            return _embedding_output(self, r)
        words = r.output_words[: r.generated]
        return {"text": " ".join(words), "output_ids": token_ids(words), "meta_info": self.meta_info(r)}

    # ---- native endpoints ---------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return _json({"error": {"message": "Invalid JSON body."}}, 400)
        params = body.get("sampling_params") or {}
        unknown = sorted(set(params) - ACCEPTED_SAMPLING_KEYS)
        if unknown:
            return _json({"error": f"unknown field {unknown[0]!r} in sampling_params"}, 400)
        text = body.get("text")
        if text is None:
            return _json({"error": {"message": "Either text or input_ids should be provided."}}, 400)
        batch = isinstance(text, list)
        prompts = text if batch else [text]
        n = int(params.get("n") or 1)
        rid = body.get("rid")
        self.recorder.count_request("/generate")
        try:
            self.check_generation_fault(prompts)
            try:
                names = self.adapters.names(None, body.get("lora_path"), len(prompts), single=not batch)
                adapters = self.adapters.resolve(names)
            except ValueError as e:
                raise RequestError(400, str(e)) from None
            reqs = []
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    if isinstance(rid, list):
                        base = rid[i]
                    else:
                        base = rid if (rid and not batch and n == 1) else f"{rid or uuid.uuid4().hex}_{i}_{j}"
                    reqs.append(self.make_request(prompt, params, rid=base, endpoint="/generate", index=j,
                                                  adapter=adapters[i]))
            set_priority(self, reqs, body.get("priority"))
            self.adapters.hold(reqs)
            if body.get("stream"):
                return await self._stream_native(request, reqs)
            await self.submit_and_wait(reqs)
        except RequestError as e:
            return error_response(e.status, e.message)
        for r in reqs:
            if r.state == "aborted" and r.abort_status >= 500:
                return error_response(r.abort_status, r.abort_message or "aborted")
        outs = [self.native_output(r) for r in reqs]
        return _json(outs if (batch or n > 1) else outs[0])

    async def _stream_native(self, request: web.Request, reqs: list[Request]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        submit_all(self.engine, reqs)
        await resp.prepare(request)
        try:
            pending = list(enumerate(reqs))
            while pending:
                await wait_any([r.changed for _, r in pending])
                still = []
                for i, r in pending:
                    if not r.changed.is_set():
                        still.append((i, r))
                        continue
                    r.changed.clear()
                    chunk = self.native_output(r)
                    if len(reqs) > 1:
                        chunk["index"] = i
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                    if not r.done.is_set():
                        still.append((i, r))
                pending = still
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            for r in reqs:
                self.engine.finish_abort(r, "The client disconnected.")
            raise
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.Response(status=503)
        if self.engine.faults.sick:
            # What a route whose handler raises answers in SGLang's FastAPI app (Starlette's default).
            self.engine.faults.sick_answers += 1
            return web.Response(status=500, text="Internal Server Error")
        rid = f"HEALTH_CHECK_{uuid.uuid4().hex[:8]}"
        if self.state.kind.is_embedding:  # an EmbeddingReqInput of input_ids [0] on an embedding server
            req = embedding_request(["0"], rid=rid, endpoint="health", internal=True)
        else:
            req = self.make_request("health", {"max_new_tokens": 1, "ignore_eos": True}, rid=rid,
                                    endpoint="health", internal=True)
        # As SGLang does: any output of the scheduler after the check began proves it healthy (a full
        # server queues the probe behind its running requests; it is not hung for that). 503 only when
        # nothing at all came out for HEALTH_CHECK_TIMEOUT (20 s).
        metrics = self.engine.metrics
        progress = metrics.generation_tokens + metrics.requests
        self.engine.submit(req)
        timeout = max(1.0, 20.0 / self.state.time_scale)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                self.engine.finish_abort(req, "health check timed out")
                return web.Response(status=503)
            try:
                await asyncio.wait_for(req.done.wait(), min(left, max(0.05, 1.0 / self.state.time_scale)))
                return web.Response(status=200 if req.state == "finished" else 503)
            except TimeoutError:
                if metrics.generation_tokens + metrics.requests > progress:
                    self.engine.finish_abort(req, "health check answered by progress")
                    return web.Response(status=200)

    async def ready_route(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def server_info_route(self, request: web.Request) -> web.Response:
        return _json(server_info(self))

    async def model_info_route(self, request: web.Request) -> web.Response:
        return _json(model_info(self.state))

    async def models(self, request: web.Request) -> web.Response:
        return _json(model_cards(self.state, self.created))

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.engine.metrics.render(self.engine, self.state.model_name)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json(loads=orjson.loads) if request.can_read_body else {}
        self.recorder.abort_calls += 1
        n = self.engine.abort(body.get("rid"), abort_all=bool(body.get("abort_all")))
        return _json({"success": True, "aborted": n})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                     "(When there are running or waiting requests, the operation will not be "
                                     "performed.)\n")
        return web.Response(status=400, text="Cache not flushed. Please check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will "
                                             "not be performed.)\n")

    async def freeze_gc(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def observed(self, request: web.Request) -> web.Response:
        return _json(self.recorder.snapshot())

    # ---- app ----------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        from .embed_api import EmbeddingRoutes
        from .lora_api import LoraRoutes
        from .openai_api import OpenAIRoutes

        api_key = self.state.flags.get("api_key")

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            path = request.path
            open_path = path.startswith("/health") or path == "/metrics" or path.startswith("/sim/")
            if api_key and not open_path and request.headers.get("Authorization") != f"Bearer {api_key}":
                return _json({"error": "Unauthorized"}, 401)
            return await handler(request)

        app = web.Application(middlewares=[auth], client_max_size=1 << 30)
        oa = OpenAIRoutes(self)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ready", self.ready_route)
        info_paths = ["/get_server_info"] if self.state.legacy else ["/server_info", "/get_server_info"]
        model_paths = ["/get_model_info"] if self.state.legacy else ["/model_info", "/get_model_info"]
        for p in info_paths:
            r.add_get(p, self.server_info_route)
        for p in model_paths:
            r.add_get(p, self.model_info_route)
        r.add_get("/v1/models", self.models)
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", oa.completions)
        r.add_post("/v1/chat/completions", oa.chat_completions)
        embed, lora = EmbeddingRoutes(self), LoraRoutes(self)
        r.add_post("/v1/embeddings", embed.v1_embeddings)
        r.add_post("/encode", embed.encode)
        r.add_put("/encode", embed.encode)
        r.add_post("/load_lora_adapter", lora.load)
        r.add_post("/unload_lora_adapter", lora.unload)
        if self.state.flags.get("enable_metrics"):
            r.add_get("/metrics", self.metrics)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/freeze_gc", self.freeze_gc)
        r.add_get("/sim/observed", self.observed)
        return app


def _embedding_output(server: SimServer, r: Request) -> dict[str, Any]:
    """`{"embedding", "meta_info"}`, as the tokenizer manager returns an embedding request's output."""
    meta = {"id": r.rid, "finish_reason": server.finish_reason(r) if r.state == "aborted" else
            {"type": "length", "length": 0}, "prompt_tokens": r.prompt_tokens, "weight_version": "default",
            "num_retractions": r.retractions, "e2e_latency": server.meta_info(r)["e2e_latency"]}
    vector = embedding_json(r.prompt_words, server.state.kind.hidden_size, r.adapter)
    return {"embedding": orjson.Fragment(vector), "meta_info": meta}


async def wait_any(events: list[asyncio.Event]) -> None:
    """Return once any of the events is set (used by the streaming loops)."""
    tasks = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def submit_all(engine: Engine, reqs: list[Request]) -> None:
    try:
        for r in reqs:
            engine.submit(r)
    except QueueFullError as e:
        for r in reqs:
            engine.finish_abort(r, str(e))
        raise RequestError(503, str(e)) from None
