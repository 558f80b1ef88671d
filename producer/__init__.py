"""The producer: turns a JSONL file of prompts into RQ jobs, collects results, exports them.

    parse.py    one input line -> (custom_id, url, body) or a Reject with the reason
    store.py    the SQLite results store on the producer host (prompts, results)
    enqueue.py  stream a file, batch, one Lua call per batch (idempotent by custom_id)
    collect.py  drain the workers' results stream into the store, then trim Redis
    status.py   queue depths, fleet tokens/s, ETA
    export.py   the OpenAI batch output file, in input order
    cli.py      the `producer` command
"""
