"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions (SGLang's shapes).

Both map onto the same generation rule as /generate: completions use the prompt as given, chat
renders the messages with textgen.render_chat first; `max_tokens` becomes max_new_tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from .server import RequestError, _json, set_priority, submit_all, wait_any

if TYPE_CHECKING:
    from .engine import Request
    from .server import SimServer

__all__ = ["OpenAIRoutes"]

# OpenAI request field -> SGLang sampling parameter
_PARAM_MAP = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
    "seed": "sampling_seed", "stop_token_ids": "stop_token_ids", "regex": "regex",
}


def _error(status: int, message: str, kind: str | None = None) -> web.Response:
    """SGLang's OpenAI ErrorResponse. A 5xx comes from a scheduler abort (an HTTPException), whose type
    is the status itself (upstream: srt/entrypoints/openai/serving_base.py `handle_request`)."""
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
    kind = kind or (str(status) if status >= 500 else kinds.get(status, "BadRequestError"))
    return _json({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)


class OpenAIRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def _params(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        params = {v: body[k] for k, v in _PARAM_MAP.items() if body.get(k) is not None}
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
        if max_tokens is None and not chat:
            max_tokens = 16  # the OpenAI completions default
        params["max_new_tokens"] = max_tokens
        return params

    def _usage(self, reqs: list[Request]) -> dict[str, Any]:
        prompt = sum(r.prompt_tokens for r in reqs[:1]) if reqs else 0
        completion = sum(r.generated for r in reqs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": None}

    async def _run(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        srv = self.server
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return _error(400, "Invalid JSON body.")
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        srv.recorder.count_request(endpoint)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list")
            from .textgen import render_chat

            prompts = [render_chat(messages)]
        else:
            prompt = body.get("prompt")
            if prompt is None:
                return _error(400, "prompt is required")
            prompts = prompt if isinstance(prompt, list) else [prompt]
        params = self._params(body, chat=chat)
        n = int(body.get("n") or 1)
        base = body.get("rid") or uuid.uuid4().hex
        model = body.get("model") or srv.state.model_name
        try:
            srv.check_generation_fault(prompts)
            try:  # the adapter: `model: "<base>:<adapter>"`, else `lora_path` (OpenAIServingBase._resolve_lora_path)
                names = srv.adapters.names(body.get("model"), body.get("lora_path"), len(prompts),
                                          single=chat or not isinstance(body.get("prompt"), list))
                adapters = srv.adapters.resolve(names)
            except ValueError as e:
                return _error(400, str(e))
            reqs = [srv.make_request(p, params, rid=f"{base}" if len(prompts) * n == 1 else f"{base}_{i}_{j}",
                                     endpoint=endpoint, index=j, openai=True, adapter=adapters[i])
                    for i, p in enumerate(prompts) for j in range(n)]
            set_priority(srv, reqs, body.get("priority"))
            srv.adapters.hold(reqs)
            if body.get("stream"):
                return await self._stream(request, reqs, chat=chat, model=model, base=base)
            await srv.submit_and_wait(reqs)
        except RequestError as e:
            return _error(e.status, e.message)
        for r in reqs:
            if r.state == "aborted" and r.abort_status >= 500:
                return _error(r.abort_status, r.abort_message or "aborted")
        if srv.state.kind.is_embedding:  # the handler reads ret["text"] of an embedding output
            return _error(500, "Internal server error: 'text'", "InternalServerError")
        choices = []
        for i, r in enumerate(reqs):
            text = " ".join(r.output_words[: r.generated])
            finish = "abort" if r.state == "aborted" else r.finish_reason
            matched = r.matched_stop if r.matched_stop is not None else (151645 if finish == "stop" else None)
            choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
            if chat:
                choice["message"] = {"role": "assistant", "content": text, "reasoning_content": None,
                                     "tool_calls": None}
            else:
                choice["text"] = text
            choices.append(choice)
        usage = self._usage(reqs) if chat else {
            "prompt_tokens": sum(r.prompt_tokens for r in reqs[::n]),
            "completion_tokens": sum(r.generated for r in reqs),
        }
        usage.setdefault("prompt_tokens_details", None)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return _json({"id": base, "object": "chat.completion" if chat else "text_completion",
                      "created": int(time.time()), "model": model, "choices": choices, "usage": usage})

    async def _stream(self, request: web.Request, reqs: list[Request], *, chat: bool, model: str,
                      base: str) -> web.StreamResponse:
        srv = self.server
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        submit_all(srv.engine, reqs)
        await resp.prepare(request)
        sent = [0] * len(reqs)
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            pending = set(range(len(reqs)))
            while pending:
                await wait_any([reqs[i].changed for i in pending])
                for i in sorted(pending):
                    r = reqs[i]
                    if not r.changed.is_set():
                        continue
                    r.changed.clear()
                    new = r.output_words[sent[i] : r.generated]
                    delta = (" " if sent[i] and new else "") + " ".join(new)
                    sent[i] = r.generated
                    finish = None
                    if r.done.is_set():
                        finish = "abort" if r.state == "aborted" else r.finish_reason
                        pending.discard(i)
                    choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": finish}
                    if chat:
                        choice["delta"] = {"role": "assistant", "content": delta}
                    else:
                        choice["text"] = delta
                    chunk = {"id": base, "object": obj, "created": int(time.time()), "model": model,
                             "choices": [choice]}
                    await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            for r in reqs:
                srv.engine.finish_abort(r, "The client disconnected.")
            raise
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=True)
