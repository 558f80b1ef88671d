"""RQ serializer backed by orjson: jobs travel as JSON, never pickle.

Pickle would let anyone who can write to Redis run code in a worker. JSON alone is not enough
(a JSON job can still name any importable function), so workers also check `jobs.ALLOWED`.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["OrjsonSerializer"]


class OrjsonSerializer:
    """`dumps`/`loads` in the shape RQ expects (`rq.serializers.Serializer`)."""

    @staticmethod
    def dumps(obj: Any, /) -> bytes:
        # RQ serializes (func_name, instance, args, kwargs) as a tuple: orjson writes it as a list.
        return orjson.dumps(obj)

    @staticmethod
    def loads(data: bytes | str, /) -> Any:
        return orjson.loads(data)
