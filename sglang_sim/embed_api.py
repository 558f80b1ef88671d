"""Embedding servers (`--is-embedding`): what kind of server a profile makes, `/v1/embeddings`, `/encode`.

As SGLang 0.5.23 does it (upstream, under sglang/srt/): `configs/model_config.py`
`is_generation_model` (is_generation = not --is-embedding for the profiles' *ForCausalLM
architectures), `configs/embedding_model_spec.py` `resolve_embedding_model_spec`,
`resolved_embedding_plan` (the `/model_info` "embedding" block); `entrypoints/openai/
serving_embedding.py` `_validate_request` (messages), `_build_embedding_response` (shape, `model` =
the --model-path), `_serialize_embedding` (base64: little-endian float32); `entrypoints/http_server.py`
`encode_request`, `validate_json_request`, the RequestValidationError handler (400, type "Bad Request");
`managers/io_struct.py` `EmbeddingReqInput.normalize_batch_and_arguments`; `managers/tokenizer_manager.py`
`_validate_one_request` (context length, "not an embedding model"), `_validate_for_matryoshka_dim`.

The server's kind: model_kind.py; the vectors: embedding.py; scheduling: the engine's, every request
prefill-only (engine.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from .embedding import embedding_base64, embedding_json, embedding_tokens
from .engine import embedding_request
from .server import RequestError, error_response

if TYPE_CHECKING:
    from .engine import Request
    from .server import SimServer

__all__ = ["EmbeddingRoutes"]

NOT_EMBEDDING = ("This model does not appear to be an embedding model by default. Please add `--is-embedding` when "
                 "launching the server or try another model.")

def _validation_error(message: str) -> web.Response:
    """FastAPI's RequestValidationError as SGLang answers it (400, not 422)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.Response(body=orjson.dumps(body), status=400, content_type="application/json")


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _native_error(message: str, status: int = 400) -> web.Response:
    return web.Response(body=orjson.dumps({"error": {"message": message}}), status=status,
                        content_type="application/json")


def _schema_error(value: Any) -> str | None:
    """Does `input` fit `List[int] | List[List[int]] | str | List[str] | List[MultimodalEmbeddingInput]`?"""
    if isinstance(value, str):
        return None
    if isinstance(value, list):
        kinds = {_item_kind(v) for v in value}
        if len(kinds) <= 1 and None not in kinds:
            return None
    return (f"1 validation error: [{{'type': 'union_tag_invalid', 'loc': ('body', 'input'), 'msg': 'Input should "
            f"be a valid string or a valid list of integers, lists of integers, strings or multimodal inputs', "
            f"'input': {value!r}}}]")


def _item_kind(v: Any) -> str | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return "int"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return "ids"
    if isinstance(v, dict) and set(v) <= {"text", "image", "video"}:
        return "mm"
    return None


def _validate_input(body: dict[str, Any]) -> str | None:
    """OpenAIServingEmbedding._validate_request, in its order and words."""
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        return f"encoding_format must be either 'float' or 'base64', got {fmt!r}"
    value = body.get("input")
    if not value:
        return "Input cannot be empty"
    if isinstance(value, str):
        return None if value.strip() else "Input cannot be empty or whitespace only"
    if isinstance(value[0], str):
        for i, item in enumerate(value):
            if not isinstance(item, str):
                return "All items in input list must be strings"
            if not item.strip():
                return f"Input at index {i} cannot be empty or whitespace only"
    elif isinstance(value[0], int):
        for i, item in enumerate(value):
            if not isinstance(item, int):
                return "All items in input list must be integers"
            if item < 0:
                return f"Token ID at index {i} must be non-negative"
    return None


def _items(value: Any) -> tuple[list[list[str]], bool]:
    """(tokens of each item, a single input?) of `input`, as it becomes `text` or `input_ids`."""
    if isinstance(value, str):
        return [embedding_tokens(value)], True
    first = value[0]
    if isinstance(first, int):
        return [embedding_tokens(value)], True
    if isinstance(first, dict):  # text-only multimodal items: their text ("padding" without one)
        texts = [v.get("text") if v.get("text") is not None else "padding" for v in value]
        return [embedding_tokens(t) for t in texts], len(texts) == 1
    return [embedding_tokens(v) for v in value], False


class EmbeddingRoutes:
    def __init__(self, server: SimServer) -> None:
        self.server = server

    def check_dimensions(self, dims: Any) -> None:
        """_validate_for_matryoshka_dim (ValueError -> 400)."""
        if dims is None:
            return
        kind, path = self.server.state.kind, self.server.state.flags["model_path"]
        if not kind.is_matryoshka:
            raise ValueError(f"Model '{path}' does not support matryoshka representation, changing output "
                             "dimensions will lead to poor results.")
        if dims < 1:
            raise ValueError("Requested dimensions must be greater than 0")
        if kind.matryoshka_dimensions and dims not in kind.matryoshka_dimensions:
            raise ValueError(f"Model '{path}' only supports {list(kind.matryoshka_dimensions)} matryoshka dimensions, "
                             "using other output dimensions will lead to poor results.")
        if dims > kind.hidden_size:
            raise ValueError(f"Provided dimensions are greater than max embedding dimension: {kind.hidden_size}")

    def build(self, items: list[list[str]], *, rid: Any, single: bool, lora: Any, model: str | None,
              dims: Any, endpoint: str) -> list[Request]:
        """The requests of one embedding call, validated as the tokenizer manager does (ValueError: 400)."""
        srv = self.server
        n = len(items)
        if single:
            rids = [rid if isinstance(rid, str) else os.urandom(16).hex()]  # uuid4().hex in SGLang: the same form
        elif rid is None:
            rids = [os.urandom(16).hex() for _ in range(n)]
        elif not isinstance(rid, list):
            raise AssertionError("The rid should be a list.")
        else:
            rids = [str(r) for r in rid]
        if not single and isinstance(rid, list) and len(set(rids)) != len(rids):
            dups = sorted({r for r in rids if rids.count(r) > 1})
            raise ValueError(f"Duplicate request IDs detected within the request: {dups}")
        names = srv.adapters.names(model, lora, n, single=single)
        adapters = srv.adapters.resolve(names)
        ctx = srv.state.plan.context_len
        for tokens in items:
            if len(tokens) >= ctx:
                raise ValueError(f"The input ({len(tokens)} tokens) is longer than the model's context length "
                                 f"({ctx} tokens).")
        if srv.state.kind.is_generation:
            raise ValueError(NOT_EMBEDDING)
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            raise ValueError(f"dimensions must be an integer, got {dims!r}")
        self.check_dimensions(dims)
        reqs = [embedding_request(tokens, rid=r, endpoint=endpoint, adapter=a)
                for tokens, r, a in zip(items, rids, adapters, strict=True)]
        srv.adapters.hold(reqs)
        return reqs

    def vector(self, r: Request, dims: int | None, fmt: str) -> bytes:
        size = dims or self.server.state.kind.hidden_size
        if fmt == "base64":
            return b'"' + embedding_base64(r.prompt_words, size, r.adapter).encode() + b'"'
        return embedding_json(r.prompt_words, size, r.adapter)

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            return _validation_error("1 validation error: [{'loc': ['header', 'content-type'], 'msg': 'Unsupported "
                                     "Media Type: Only 'application/json' is allowed', 'type': 'value_error'}]")
        try:
            body = orjson.loads(await request.read())
        except ValueError as e:
            return _validation_error(f"1 validation error: [{{'type': 'json_invalid', 'loc': ('body', 0), 'msg': "
                                     f"'JSON decode error', 'ctx': {{'error': {str(e)!r}}}}}]")
        if not isinstance(body, dict):
            return _validation_error("1 validation error: [{'type': 'model_attributes_type', 'loc': ('body',), "
                                     "'msg': 'Input should be a valid dictionary or object to extract fields from'}]")
        return body

    async def v1_embeddings(self, request: web.Request) -> web.Response:
        srv = self.server
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        srv.recorder.count_request("/v1/embeddings")
        if "input" not in body:
            return _validation_error("1 validation error: [{'type': 'missing', 'loc': ('body', 'input'), 'msg': "
                                     "'Field required'}]")
        schema = _schema_error(body["input"])
        dims = body.get("dimensions")
        if schema is None and dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            schema = (f"1 validation error: [{{'type': 'int_type', 'loc': ('body', 'dimensions'), 'msg': 'Input "
                      f"should be a valid integer', 'input': {dims!r}}}]")
        if schema is not None:
            return _validation_error(schema)
        message = _validate_input(body)
        if message:
            return _error(400, message)
        items, single = _items(body["input"])
        fmt = body.get("encoding_format", "float")
        try:
            srv.check_generation_fault([" ".join(t) for t in items])  # the faults count embeddings too
            reqs = self.build(items, rid=body.get("rid"), single=single, lora=body.get("lora_path"),
                              model=str(body.get("model", "default")), dims=dims, endpoint="/v1/embeddings")
            await srv.submit_and_wait(reqs)
        except ValueError as e:
            return _error(400, str(e))
        except AssertionError as e:
            return _error(500, f"Internal server error: {e}", "InternalServerError")
        except RequestError as e:
            return _error(e.status, e.message, str(e.status) if e.status >= 500 else "BadRequestError")
        for r in reqs:
            if r.state == "aborted":
                return _error(r.abort_status if r.abort_status >= 500 else 500, r.abort_message or "aborted",
                              str(r.abort_status if r.abort_status >= 500 else 500))
        tokens = sum(r.prompt_tokens for r in reqs)
        data = b",".join(b'{"embedding":' + self.vector(r, dims, fmt) + b',"index":%d,"object":"embedding"}' % i
                         for i, r in enumerate(reqs))
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                 "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}
        out = (b'{"data":[' + data + b'],"model":' + orjson.dumps(srv.state.flags["model_path"])
               + b',"object":"list","usage":' + orjson.dumps(usage) + b"}")
        return web.Response(body=out, content_type="application/json")

    def meta_info(self, r: Request) -> bytes:
        end = r.finish_model if r.finish_model is not None else self.server.engine.model_now()
        return orjson.dumps({"id": r.rid, "finish_reason": {"type": "length", "length": 0},
                             "prompt_tokens": r.prompt_tokens, "weight_version": "default",
                             "num_retractions": r.retractions, "e2e_latency": round(end - r.arrival_model, 6)})

    async def encode(self, request: web.Request) -> web.Response:
        srv = self.server
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return _native_error("Invalid JSON body.")
        if not isinstance(body, dict):
            return _native_error("Invalid request body.")
        srv.recorder.count_request("/encode")
        text, ids = body.get("text"), body.get("input_ids")
        if text is None and ids is None:
            return _native_error("At least one of text, input_ids, image, video, or audio should be provided")
        if text is not None and ids is not None:
            return _native_error("text and input_ids cannot be provided at the same time")
        if text is not None:
            single = not isinstance(text, list)
            items = [embedding_tokens(text)] if single else [embedding_tokens(t) for t in text]
        else:
            single = not (ids and isinstance(ids[0], list))
            items = [embedding_tokens(ids)] if single else [embedding_tokens(t) for t in ids]
        dims = body.get("dimensions")
        try:
            srv.check_generation_fault([" ".join(t) for t in items])
            reqs = self.build(items, rid=body.get("rid"), single=single, lora=body.get("lora_path"), model=None,
                              dims=dims, endpoint="/encode")
            await srv.submit_and_wait(reqs)
        except ValueError as e:
            return _native_error(str(e))
        except AssertionError:
            return web.Response(status=500, text="Internal Server Error")
        except RequestError as e:
            return error_response(e.status, e.message)
        for r in reqs:
            if r.state == "aborted" and r.abort_status >= 500:
                return error_response(r.abort_status, r.abort_message or "aborted")
        outs = [b'{"embedding":' + self.vector(r, dims, "float") + b',"meta_info":' + self.meta_info(r) + b"}"
                for r in reqs]
        out = outs[0] if single else b"[" + b",".join(outs) + b"]"
        return web.Response(body=out, content_type="application/json")
