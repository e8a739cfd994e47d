"""Defaults that commands show in their ``--help``, in a module that imports nothing.

They belong to the modules that use them (``farm.store.bundle``, ``farm.records.ingest``,
which import them from here, and whose docs say why each value); they live here so
that ``farm --help`` and every command's options are built without importing pydantic,
the stores or the records.
"""

#: default cap on a bundle file (and on the sum of its artifacts): it is held in memory
#: while it is verified, because nothing may be written before everything is verified
BUNDLE_MAX_BYTES = 4 * 1024 * 1024 * 1024

#: stream entries an ingester reads per stream per round (see farm.records.ingest)
INGEST_BATCH = 500
#: longest wait of an ingester for new entries in one read, in ms
INGEST_BLOCK_MS = 1000
#: how long an entry must have been pending before another ingester takes it over, in ms
INGEST_CLAIM_IDLE_MS = 60_000
