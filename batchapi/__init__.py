"""`batchfleet serve`: the OpenAI Batch API (Files and Batches) in front of a batchfleet run.

    auth.py      bearer keys (their SHA-256 only), who owns what
    objects.py   FileObject and Batch as OpenAI documents them, and their records
    registry.py  the records and the files' bytes on disk (0600), held in memory for the API
    validate.py  a batch's input file into the run's store: whole, in one transaction, or failed
    engine.py    the batches' lives: validating -> in_progress -> finalizing -> completed, failed,
                 cancelling -> cancelled, expired; their output and error files
    app.py       the HTTP endpoints (aiohttp)
    server.py    the store made ready, the engine's thread and the API until SIGINT/SIGTERM

It stands beside `fleetrun` (which starts the fleet's processes and calls `serve_api`) and builds on
`producer.api` (store, enqueue_whole, export, cancel) and `batchfleet`; nothing but fleetrun's CLI
imports it.
See docs/api.md.
"""

from .auth import ApiKeys, AuthError, check_exposure
from .server import ServeError, ServeOptions, prepare_store, serve_api

__all__ = ["ApiKeys", "AuthError", "ServeError", "ServeOptions", "check_exposure", "prepare_store", "serve_api"]
