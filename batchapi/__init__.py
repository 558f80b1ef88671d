"""`batchfleet serve`: the OpenAI Batch API (Files and Batches) in front of a batchfleet run.

    auth.py      bearer keys (their SHA-256 only), who owns what, each key's tenant
    tenants.py   the tenants file (keys as SHA-256, weights, quotas, priorities); metadata.priority
    quota.py     a tenant's queued requests and prompt tokens against its quotas, at batch creation
    objects.py   FileObject and Batch as OpenAI documents them, and their records
    registry.py  the records and the files' bytes on disk (0600), held in memory for the API
    validate.py  a batch's input file into the run's store: whole, in one transaction, or failed
    engine.py    the batches' lives: validating -> in_progress -> finalizing -> completed, failed,
                 cancelling -> cancelled, expired; their output and error files
    tenancy.py   the tenants as the engine's thread applies them: weights into the store, figures
    fleet.py     what GET /v1/fleet and the screen show; each running batch's ETA and its warning
    metrics.py   GET /metrics: one series per tenant
    app.py       the HTTP endpoints (aiohttp)
    server.py    the store made ready, the engine's thread and the API until SIGINT/SIGTERM;
                 SIGHUP reads the tenants file again

It stands beside `fleetrun` (which starts the fleet's processes and calls `serve_api`) and builds on
`producer.api` (store, enqueue_whole, export, cancel) and `batchfleet`; nothing but fleetrun's CLI
imports it.
See docs/api.md.
"""

from .auth import ApiKeys, AuthError, check_exposure
from .server import ServeError, ServeOptions, prepare_store, serve_api

__all__ = ["ApiKeys", "AuthError", "ServeError", "ServeOptions", "check_exposure", "prepare_store", "serve_api"]
