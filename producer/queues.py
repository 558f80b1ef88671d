"""Which queues `producer enqueue` spreads prompts over (`--queues`, default BATCHFLEET_QUEUES).

    hosta.gpu0,hosta.gpu1        names, comma-separated
    hosta.gpu[0-7],hostb.gpu[0-7]  one `[A-B]` range per name (16 queues)
    live                         the queues of this run's live workers, as their status records say
                                 (every host's, whatever it is called); mixes with names: `live,spare.gpu0`

`live` needs the workers started first; a worker whose server is down is left out (its queue would
only wait for the others to steal from it).
"""

from __future__ import annotations

import redis

from batchfleet.config import expand_queues, gpu_index_for_queue, queue_host
from batchfleet.errors import ConfigError
from batchfleet.fleetview import read_fleet_view
from batchfleet.keys import Keys
from batchfleet.records import WorkerState

__all__ = ["LIVE", "live_queues", "resolve_queues"]

LIVE = "live"


def live_queues(r: redis.Redis, keys: Keys) -> list[str]:
    """The queues of the run's live workers (`batchfleet.fleetview`) whose server is not down, ordered
    by host then GPU index."""
    queues = {w.queue for w in read_fleet_view(r, keys).live if w.state != WorkerState.DOWN}
    return sorted(queues, key=lambda q: (queue_host(q), gpu_index_for_queue(q) or 0, q))


def resolve_queues(text: str, r: redis.Redis, keys: Keys) -> tuple[str, ...]:
    """The queue list `text` names (see the module docstring). Raises ConfigError when it names none."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part == LIVE:
            live = live_queues(r, keys)
            if not live:
                raise ConfigError(f"no live worker of run {keys.run!r} reports a queue: start the workers first, "
                                  "or name the queues (e.g. hosta.gpu[0-7],hostb.gpu[0-7])")
            out += live
        elif part:
            out += expand_queues(part)
    if not out:
        raise ConfigError(f"--queues {text!r} names no queue")
    return tuple(dict.fromkeys(out))
