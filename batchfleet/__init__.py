"""batchfleet's shared contract: what the producer, the workers and the supervisor must agree on.

Read by all three, owned by none: configuration (`config`), the Redis key layout (`keys`), the
records that travel through Redis (`records`), the SGLang client (`sglang`), the exception tree
(`errors`) and the JSON serializer that keeps pickle out of Redis (`serializer`).
"""

__version__ = "0.1.0"
