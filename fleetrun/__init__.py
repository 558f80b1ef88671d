"""`batchfleet run`: the whole job on one box, in one command; `batchfleet serve`: the OpenAI Batch API
on a fleet (the API itself is `batchapi`).

A launcher, not a second implementation: it starts the processes the multi-host setup runs (one
`rq worker <run>.gpuN` per GPU with `worker.GPUWorker`, `producer head`, `supervisor watch`),
enqueues, watches and exports through `producer.api` (the producer's public API), and starts a
private redis-server (`fleetrun.redisproc`) when no Redis answers.
It lives in its own package because it depends on all three processes' packages while none of
them depends on it (`batchfleet/` is the contract they share and imports none of them). Both commands
start the fleet through `fleetrun.launch`.
"""
