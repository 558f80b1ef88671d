"""The producer: the run's store is the source of truth; Redis holds a window of it.

    parse.py    one input line -> (custom_id, url, body) or a Reject with the reason
    store.py    the run's SQLite store on the head host: every prompt, its state, its result
    enqueue.py  stream a file into the store (idempotent by custom_id)
    feed.py     the window per queue, and the feed pass that tops Redis up from the store
    collect.py  drain the workers' results stream into the store (only answers to enqueued prompts)
    recover.py  audit where fed prompts are in Redis; requeue the lost and the foreign-failed
    locate.py   which store is the run's (the run marker in Redis), and the marker itself
    head.py     the head process: marker check, collect, audit, feed, in a loop that rides out Redis outages
    status.py   where every prompt is (read-only)
    export.py   the OpenAI batch output file, in input order
    cli.py      the `producer` command
"""
