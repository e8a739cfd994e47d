"""The cluster's client side and the state it shares with the workers.

:mod:`.build` sends a build's misses to the fingerprint's queue and gathers the results;
:mod:`.celery_app` makes the (JSON-only) Celery application both sides use;
:mod:`.payloads` are the task payloads; :mod:`.workers` the registry of who serves which
fingerprint; :mod:`.queues` the depth of each queue; :mod:`.lease` the in-flight
deduplication; :mod:`.health` and :mod:`.metrics` what operators and the chart's probes
read. The worker processes themselves live in the top-level ``worker`` package.
"""
