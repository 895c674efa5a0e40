"""Our small Kubernetes runtime: the API client, list+watch informers, the reconcile
scheduler, the call coalescer and the Event poster.

We wrote these because kopf's own machinery cost too much at scale: its per-object
handlers and timers took ~1.5 ms of CPU per watch event and a daemon per cache, most of a
core at 10,000 caches (README "Sizing"). kopf still runs the process: log-in, probes,
start-up and clean-up.

May import: ``dscache_contract`` only. Nothing here knows what a DatasetCache is.
"""
