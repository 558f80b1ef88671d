"""A FastAPI app served by uvicorn the way SGLang 0.5.23 serves its HTTP API (`uvicorn.run(app,
timeout_keep_alive=5, loop="uvloop")`, upstream `sglang/srt/entrypoints/http_server.py`), answering
in SGLang's reply shapes: the worker's HTTP client is tested against the server SGLang really runs.

Written from the shapes, not from SGLang's code (nothing is shared with the simulator either):
- `GET /health_generate`: empty body, 200 or 503;
- `GET /server_info`: server arguments at the top level, `internal_states` per DP rank;
- `GET /metrics`: Prometheus text (prometheus_client's ASGI app, mounted as SGLang mounts it);
- `POST /generate`: `{"text", "output_ids", "meta_info"}` (a list in, a list out); a bad request is
  400 `{"error": {"message"}}`;
- `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI shapes; errors (and FastAPI's
  validation errors, turned from 422 into 400 as SGLang does) as `{"object": "error", "message",
  "type", "param", "code"}`;
- a full queue: 503 "The request queue is full." in that error shape, on every endpoint.

Test-only paths (prefixed `/_`): set the state (`/_state`), what the server saw (`/_observed`), which
connection a request came on (`/_conn`), a slow reply (`/_slow`), a chunked one (`/_chunked`), one
with `Connection: close` (`/_close`), one cut by a TCP reset (`/_reset`).

    python -m tests.sglang_uvicorn --port P [--http httptools|h11]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, make_asgi_app
from pydantic import BaseModel
from starlette.routing import Mount

CONTEXT_LEN = 64
MODEL = "contract/model"
STATE: dict[str, Any] = {"healthy": True, "queue_full": False, "started": 0, "disconnects": 0}

app = FastAPI()

registry = CollectorRegistry()
_LABELS = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
for _name, _value in (("num_running_reqs", 3), ("num_queue_reqs", 2), ("gen_throughput", 1180.5),
                      ("token_usage", 0.61), ("cache_hit_rate", 0.25)):
    Gauge(f"sglang:{_name}", _name, list(_LABELS), registry=registry).labels(**_LABELS).set(_value)
_metrics = Mount("/metrics", make_asgi_app(registry=registry))
_metrics.path_regex = re.compile("^/metrics(?P<path>.*)$")  # /metrics itself, not only /metrics/
app.routes.append(_metrics)


class ErrorResponse(BaseModel):
    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(ErrorResponse(message=message, type=kind, code=status).model_dump(), status_code=status)


@app.exception_handler(HTTPException)
async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), str(exc.status_code))


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error(400, str(exc), "Bad Request")


def _admit(n_tokens: int) -> None:
    if STATE["queue_full"]:
        raise HTTPException(status_code=503, detail="The request queue is full.")
    if n_tokens > CONTEXT_LEN:
        raise ValueError(f"The input ({n_tokens} tokens) is longer than the model's context length "
                         f"({CONTEXT_LEN} tokens).")


# --- SGLang's endpoints ------------------------------------------------------------------------
@app.get("/health_generate")
@app.get("/health")
async def health_generate() -> Response:
    return Response(status_code=200 if STATE["healthy"] else 503)


@app.get("/server_info")
async def server_info() -> dict[str, Any]:
    return {"model_path": MODEL, "max_running_requests": 128, "mamba_radix_cache_strategy": "no_buffer",
            "status": "ready", "max_total_num_tokens": 812345, "version": "0.5.23",
            "internal_states": [{"effective_max_running_requests_per_dp": 72, "max_mamba_cache_size": 216,
                                 "last_gen_throughput": 1180.4}]}


class GenerateReq(BaseModel):
    text: str | list[str]
    sampling_params: dict[str, Any] = {}
    rid: str | None = None


@app.post("/generate")
async def generate(req: GenerateReq) -> Any:
    texts = [req.text] if isinstance(req.text, str) else req.text
    try:
        for text in texts:
            _admit(len(text.split()))
    except ValueError as exc:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
    n = int(req.sampling_params.get("max_new_tokens", 128))
    out = [{"text": " ok" * n, "output_ids": [7] * n,
            "meta_info": {"id": f"gen-{i}", "finish_reason": {"type": "length", "length": n},
                          "prompt_tokens": len(t.split()), "completion_tokens": n, "cached_tokens": 0,
                          "e2e_latency": 0.01}} for i, t in enumerate(texts)]
    return out[0] if isinstance(req.text, str) else out


class CompletionReq(BaseModel):
    model: str = MODEL
    prompt: str
    max_tokens: int = 16


class ChatReq(BaseModel):
    model: str = MODEL
    messages: list[dict[str, Any]]
    max_tokens: int = 16


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@app.post("/v1/completions")
async def completions(req: CompletionReq) -> Any:
    n_in = len(req.prompt.split())
    try:
        _admit(n_in)
    except ValueError as exc:
        return _error(400, str(exc), "BadRequestError")
    return {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": req.model,
            "choices": [{"index": 0, "text": " ok" * req.max_tokens, "logprobs": None, "finish_reason": "length",
                         "matched_stop": None}],
            "usage": _usage(n_in, req.max_tokens)}


@app.post("/v1/chat/completions")
async def chat(req: ChatReq) -> Any:
    n_in = sum(len(str(m.get("content", "")).split()) for m in req.messages)
    try:
        _admit(n_in)
    except ValueError as exc:
        return _error(400, str(exc), "BadRequestError")
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "reasoning_content": None,
                                                 "tool_calls": None},
                         "logprobs": None, "finish_reason": "stop", "matched_stop": 2}],
            "usage": _usage(n_in, 1)}


# --- test-only paths -----------------------------------------------------------------------------
@app.post("/_state")
async def set_state(change: dict[str, Any]) -> dict[str, Any]:
    STATE.update(change)
    return STATE


@app.get("/_observed")
async def observed() -> dict[str, Any]:
    return STATE


@app.api_route("/_conn", methods=["GET", "POST"])
async def conn(request: Request) -> dict[str, Any]:
    assert request.client is not None
    return {"port": request.client.port}


@app.api_route("/_close", methods=["GET", "POST"])
async def close(request: Request) -> Response:
    assert request.client is not None
    return JSONResponse({"port": request.client.port}, headers={"Connection": "close"})


@app.post("/_slow")
async def slow(request: Request, s: float) -> Any:
    """Answers after `s` seconds, unless the client leaves first (counted, as SGLang aborts it)."""
    STATE["started"] += 1
    until = time.monotonic() + s
    while time.monotonic() < until:
        await asyncio.sleep(0.02)
        if await request.is_disconnected():
            STATE["disconnects"] += 1
            return Response(status_code=499)
    return {"slept": s}


@app.post("/_chunked")
async def chunked(n: int, delay: float = 0.0) -> StreamingResponse:
    """A JSON body in n chunks (no Content-Length: uvicorn sends it chunked), `delay` s apart."""

    async def parts() -> AsyncIterator[bytes]:
        yield b'{"parts":['
        for i in range(n):
            if delay:
                await asyncio.sleep(delay)
            yield b"%s%d" % (b"," if i else b"", i)
        yield b"]}"

    return StreamingResponse(parts(), media_type="application/json")


@app.post("/_reset")
async def reset(request: Request) -> StreamingResponse:
    """The head and the first bytes of a chunked body, then a TCP reset (RST), as a server that dies
    or a route that drops mid-reply."""
    assert request.client is not None
    client = (request.client.host, request.client.port)

    async def parts() -> AsyncIterator[bytes]:
        yield b'{"text":"par'
        await asyncio.sleep(0.2)  # the client reads the head and the first chunk before the reset
        _reset_connection(client)
        await asyncio.sleep(0.1)
        yield b'tial"}'

    return StreamingResponse(parts(), media_type="application/json")


def _reset_connection(client: tuple[str, int]) -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    for obj in gc.get_objects():
        if isinstance(obj, H11Protocol | HttpToolsProtocol) and obj.client == client and obj.transport is not None:
            obj.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                              struct.pack("ii", 1, 0))
            obj.transport.abort()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--http", default="httptools", choices=("httptools", "h11"))
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, timeout_keep_alive=5, loop="uvloop", http=args.http,
                log_level="warning")


if __name__ == "__main__":
    main()
