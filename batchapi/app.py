"""The HTTP API (aiohttp): OpenAI's Files and Batches endpoints, as the `openai` client calls them.

    POST   /v1/files                   multipart: file, purpose=batch        -> FileObject
    GET    /v1/files                   ?purpose, limit (<= 10000), order, after -> list
    GET    /v1/files/{id}                                                   -> FileObject
    GET    /v1/files/{id}/content                                           -> the bytes
    DELETE /v1/files/{id}                                                   -> {id, object, deleted}
    POST   /v1/batches                 input_file_id, endpoint, completion_window, metadata -> Batch
    GET    /v1/batches                 ?limit (<= 100), after: newest first -> list
    GET    /v1/batches/{id}                                                 -> Batch
    POST   /v1/batches/{id}/cancel                                          -> Batch
    GET    /v1/fleet                   the tenants' shares, this key's batches  -> {"object": "fleet", ...}
    GET    /metrics                    Prometheus text: one series per tenant (batchapi/metrics.py)
    GET    /health                     no key needed                        -> {"status": "ok"}

A batch's `metadata.priority` (high, normal, low; batchfleet's extension) must be one its key's tenant may
use, and the batch must fit the tenant's quotas (batchapi/quota.py): else 400, and nothing is made. So
is a batch whose endpoint the fleet cannot serve, once its live workers said what their servers are
(`/model_info` is_generation): `/v1/embeddings` on generation servers, a chat or completions batch on
embedding servers, as `producer enqueue` refuses such a file. Before any worker said, it is accepted,
and the head fails its requests once (`wrong_endpoint_kind`).

Every error is OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 401 without a valid
key, 404 for an object that does not exist or belongs to another key (the two are not told apart),
400 for a bad request, 413 for an upload over the limit. A read (a poll) is answered from the
registry's memory: no query, no store access.

Nothing that waits on the disk runs on the event loop: an upload's writes and fsync and every commit
of the registry (synchronous=FULL) run in a thread (`asyncio.to_thread`), and a handler answers once
its thread is done, so what it acknowledged is on disk. A 100 MB upload stalls no other client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import redis
from aiohttp import BodyPartReader, web
from prometheus_client import CONTENT_TYPE_LATEST

from batchfleet.fleetview import read_fleet_view
from batchfleet.prompts import kind_mismatch

from .auth import ApiKeys
from .engine import Engine, Limits
from .objects import BATCH_PURPOSE, ENDPOINTS, WINDOWS, BatchRecord, BatchStatus, FileRecord, new_batch_id, new_file_id
from .quota import Queued, count_file, queued_of, quota_problem
from .registry import Registry, Upload
from .tenants import PRIORITY_NAMES, priority_of

__all__ = ["MB", "make_app"]

MB = 1_000_000
CHUNK = 1 << 20
MAX_HELD = 16 << 20  # an upload's bytes held in memory while its thread writes the ones before
MAX_METADATA = 16  # pairs; keys up to 64 characters, values up to 512 (OpenAI's limits)
OWNER = web.RequestKey("owner", str)  # the hash of the request's API key (set by the auth middleware)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error(status: int, message: str, *, code: str | None = None, param: str | None = None,
          kind: str = "invalid_request_error") -> web.Response:
    return _json({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _not_found(what: str, oid: str) -> web.Response:
    return error(404, f"No such {what} object: {oid}", param="id")


def _page(items: list[Any], after: str | None, limit: int) -> dict[str, Any]:
    """A cursor page: the items after the one whose id is `after` (in the list's order)."""
    if after:
        ids = [x.id for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    data = [x.to_api() for x in page]
    return {"object": "list", "data": data, "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(items) > limit}


def _int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(reason=f"{name} must be an integer") from None
    if not lo <= value <= hi:
        raise web.HTTPBadRequest(reason=f"{name} must be between {lo} and {hi}")
    return value


class Api:
    def __init__(self, registry: Registry, engine: Engine, limits: Limits, *, max_upload_bytes: int) -> None:
        self.registry = registry
        self.engine = engine
        self.tenancy = engine.tenancy
        self.limits = limits
        self.max_upload_bytes = max_upload_bytes
        self.creating = asyncio.Lock()  # one batch created at a time: a quota is checked against all before it

    @property
    def keys(self) -> ApiKeys:
        """The keys in force (a SIGHUP may replace them: `Tenancy.use`)."""
        return self.tenancy.api_keys

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/health":
            owner = self.keys.owner(request.headers.get("Authorization"))
            if owner is None:
                return error(401, "Incorrect API key provided (give it as `Authorization: Bearer KEY`).",
                             code="invalid_api_key")
            request[OWNER] = owner
        try:
            return await handler(request)
        except web.HTTPException as exc:  # the router's 404 and 405, our 400s: in OpenAI's shape
            if exc.status < 400:
                raise
            return error(exc.status, exc.reason or str(exc), code=None)

    # --- files --------------------------------------------------------------------------------------
    async def create_file(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > self.max_upload_bytes + CHUNK:
            return self._too_big()
        if not request.content_type.startswith("multipart/"):
            return error(400, "upload the file as multipart/form-data with the fields `file` and `purpose`")
        purpose: str | None = None
        rec: FileRecord | None = None
        fid = new_file_id()
        upload: Upload | None = None
        try:
            async for part in await request.multipart():
                if part.name == "purpose":
                    purpose = (await part.read_chunk(1024)).decode(errors="replace").strip()  # type: ignore[union-attr]
                elif part.name == "file" and rec is None:
                    upload = await asyncio.to_thread(Upload, self.registry, fid)
                    size = await self._receive(part, upload)  # type: ignore[arg-type]
                    if size is None:
                        return self._too_big()
                    rec = FileRecord(id=fid, owner=request[OWNER], filename=part.filename or "upload.jsonl",
                                     bytes=size, purpose="", created_at=int(time.time()))
            if rec is None or upload is None:
                return error(400, "the upload has no `file` field", param="file")
            if purpose != BATCH_PURPOSE:
                return error(400, f"purpose {purpose!r}: batchfleet serve keeps files for the Batch API only "
                                  "(purpose=batch)", param="purpose")
            rec = replace(rec, purpose=purpose)
            rec = await asyncio.to_thread(upload.keep, rec)  # synced, in place, committed: then acknowledged
        finally:
            if upload is not None:
                await asyncio.to_thread(upload.discard)
        return _json(rec.to_api())

    async def _receive(self, part: BodyPartReader, upload: Upload) -> int | None:
        """The part's bytes into `upload`, written in a thread while the next ones arrive: each write takes
        all that came during the one before (at most MAX_HELD waits in memory; then the loop waits for
        the write). Their size, or None past the upload limit."""
        size, held = 0, bytearray()
        writing: asyncio.Task[None] | None = None  # the write under way while more bytes are read
        try:
            while chunk := await part.read_chunk(CHUNK):
                size += len(chunk)
                if size > self.max_upload_bytes:
                    return None
                held += chunk
                if writing is not None and (writing.done() or len(held) >= MAX_HELD):
                    await writing  # done (its error raised here), or too much held: wait for it
                    writing = None
                if writing is None:
                    data, held = held, bytearray()
                    writing = asyncio.ensure_future(asyncio.to_thread(upload.write, data))
            if writing is not None:
                await writing
            writing = None
            await asyncio.to_thread(upload.write, held)
            return size
        finally:
            if writing is not None:  # left early: the write ends in its thread (`discard` waits for it)
                writing.add_done_callback(_retrieved)

    def _too_big(self) -> web.Response:
        return error(413, f"the file is larger than the upload limit of {self.max_upload_bytes:,} bytes "
                          "(batchfleet serve --max-upload-mb)", code="file_too_large", param="file")

    async def list_files(self, request: web.Request) -> web.Response:
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise web.HTTPBadRequest(reason="order must be asc or desc")
        files = self.registry.list_files(request[OWNER], purpose=request.query.get("purpose"), order=order)
        return _json(_page(files, request.query.get("after"), _int(request, "limit", 10_000, 1, 10_000)))

    async def get_file(self, request: web.Request) -> web.Response:
        fid = request.match_info["file_id"]
        rec = self.registry.file(fid, request[OWNER])
        return _not_found("File", fid) if rec is None else _json(rec.to_api())

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        fid = request.match_info["file_id"]
        if self.registry.file(fid, request[OWNER]) is None:
            return _not_found("File", fid)
        return web.FileResponse(self.registry.file_path(fid), headers={"Content-Type": "application/octet-stream"})

    async def delete_file(self, request: web.Request) -> web.Response:
        fid = request.match_info["file_id"]
        if self.registry.file(fid, request[OWNER]) is None:
            return _not_found("File", fid)
        await asyncio.to_thread(self.registry.delete_file, fid)
        return _json({"id": fid, "object": "file", "deleted": True})

    # --- batches ------------------------------------------------------------------------------------
    async def create_batch(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the request body is not a JSON object")
        fid, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if not isinstance(fid, str):
            return error(400, "input_file_id is required", param="input_file_id", code="missing_required_parameter")
        if endpoint not in ENDPOINTS:
            return error(400, f"endpoint {endpoint!r}: batchfleet serve runs batches of {' and '.join(ENDPOINTS)}",
                         param="endpoint", code="invalid_value")
        if window not in WINDOWS:
            return error(400, f"completion_window {window!r}: only {WINDOWS[0]!r} is supported",
                         param="completion_window", code="invalid_value")
        metadata = body.get("metadata")
        problem = _metadata_problem(metadata)
        if problem:
            return error(400, problem, param="metadata", code="invalid_value")
        priority = priority_of(metadata)
        if priority not in PRIORITY_NAMES:
            return error(400, f"metadata.priority {priority[:32]!r}: one of {', '.join(PRIORITY_NAMES)} (batchfleet's "
                              "extension; absent: normal)", param="metadata", code="invalid_value")
        tenant = self.keys.tenant_of(request[OWNER])
        if priority not in tenant.priorities:
            return error(400, f"metadata.priority {priority!r}: tenant {tenant.name} may submit "
                              f"{' and '.join(p for p in PRIORITY_NAMES if p in tenant.priorities)} batches only "
                              "(the tenants file says which priorities each tenant may use)",
                         param="metadata", code="invalid_value")
        f = self.registry.file(fid, request[OWNER])
        if f is None:
            return error(400, f"No such File object: {fid}", param="input_file_id", code="invalid_value")
        if f.purpose != BATCH_PURPOSE:
            return error(400, f"file {fid} has purpose {f.purpose!r}, not 'batch'", param="input_file_id",
                         code="invalid_value")
        wrong = kind_mismatch(endpoint, await asyncio.to_thread(self._fleet_generates))
        if wrong:
            return error(400, f"this fleet cannot run the batch: {wrong} (its live workers' servers said so)",
                         param="endpoint", code="invalid_value")
        if f.requests is None:  # uploaded before uploads were counted: count it now, off the loop
            f = await asyncio.to_thread(self._counted, f)
        async with self.creating:
            refused = quota_problem(tenant, queued_of(self.registry.unfinished(), self.registry.files, tenant.name),
                                    Queued(f.requests or 0, f.prompt_bytes or 0), self.tenancy.ratio)
            if refused:
                return error(400, refused[1], param="input_file_id", code=refused[0])
            now = int(time.time())
            rec = BatchRecord(id=new_batch_id(), owner=request[OWNER], input_file_id=fid, endpoint=endpoint,
                              completion_window=window, created_at=now, expires_at=now + int(self.limits.window_s),
                              metadata=metadata or None, tenant=tenant.name)
            await asyncio.to_thread(self.registry.put_batch, rec)
        self.engine.wake()
        return _json(rec.to_api())

    def _fleet_generates(self) -> bool | None:
        """What the run's live workers' servers are (`/model_info` is_generation, in their status records):
        True generation, False embedding; None while none said, when they disagree, or when Redis does not
        answer (then the head fails a batch of the other kind once)."""
        try:
            return read_fleet_view(self.engine.r, self.engine.keys).is_generation
        except (redis.RedisError, OSError):
            return None

    def _counted(self, f: FileRecord) -> FileRecord:
        requests, size = count_file(self.registry.file_path(f.id))
        rec = replace(f, requests=requests, prompt_bytes=size)
        self.registry.add_file(rec)
        return rec

    async def list_batches(self, request: web.Request) -> web.Response:
        batches = self.registry.list_batches(request[OWNER])
        return _json(_page(batches, request.query.get("after"), _int(request, "limit", 20, 1, 100)))

    async def get_batch(self, request: web.Request) -> web.Response:
        bid = request.match_info["batch_id"]
        rec = self.registry.batch(bid, request[OWNER])
        return _not_found("Batch", bid) if rec is None else _json(rec.to_api())

    async def cancel_batch(self, request: web.Request) -> web.Response:
        bid = request.match_info["batch_id"]
        if self.registry.batch(bid, request[OWNER]) is None:
            return _not_found("Batch", bid)
        now = int(time.time())

        def cancelling(cur: BatchRecord) -> BatchRecord | None:
            if cur.final or cur.status is BatchStatus.CANCELLING:
                return None
            return replace(cur, status=BatchStatus.CANCELLING, cancelling_at=now)

        rec = await asyncio.to_thread(self.registry.update, bid, cancelling)
        if rec.final and rec.status is not BatchStatus.CANCELLED:
            return error(400, f"Cannot cancel a batch with status {rec.status!s}.", param="id")
        self.engine.wake()
        return _json(rec.to_api())

    # --- the fleet: tenants and their shares ------------------------------------------------------------
    async def fleet(self, request: web.Request) -> web.Response:
        book = self.tenancy.book
        mine = [b.to_api() for b in book.batches.values() if b.owner == request[OWNER]]
        return _json({"object": "fleet", "tenants": [t.to_api() for t in book.tenants], "batches": mine})

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.tenancy.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, _request: web.Request) -> web.Response:
        return _json({"status": "ok"})


def _retrieved(task: asyncio.Task[None]) -> None:
    """A task nobody awaits any more: its error, if any, is read (and so not reported as unread)."""
    if not task.cancelled():
        task.exception()


def _metadata_problem(metadata: object) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return "metadata must be an object of strings"
    if len(metadata) > MAX_METADATA:
        return f"metadata holds {len(metadata)} pairs: at most {MAX_METADATA}"
    for k, v in metadata.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            return f"metadata {k[:64]!r}: keys are strings of up to 64 characters, values strings of up to 512"
    return None


def make_app(registry: Registry, engine: Engine, limits: Limits, *, max_upload_bytes: int) -> web.Application:
    """The API; its keys are the engine's (`Engine.tenancy`)."""
    api = Api(registry, engine, limits, max_upload_bytes=max_upload_bytes)
    app = web.Application(middlewares=[api.guard], client_max_size=CHUNK)
    app.add_routes([
        web.post("/v1/files", api.create_file),
        web.get("/v1/files", api.list_files),
        web.get("/v1/files/{file_id}", api.get_file),
        web.get("/v1/files/{file_id}/content", api.file_content),
        web.delete("/v1/files/{file_id}", api.delete_file),
        web.post("/v1/batches", api.create_batch),
        web.get("/v1/batches", api.list_batches),
        web.get("/v1/batches/{batch_id}", api.get_batch),
        web.post("/v1/batches/{batch_id}/cancel", api.cancel_batch),
        web.get("/v1/fleet", api.fleet),
        web.get("/metrics", api.metrics),
        web.get("/health", api.health),
    ])
    return app
