"""The shared core: what every process and every other package of ``farm`` builds on.

The data model (:mod:`.model`), the names of all shared state (:mod:`.keys`), stable
hashes, the exception hierarchy (:mod:`.errors`), settings, environments and their
generation, devices and fingerprints (:mod:`.device`), and the outage waiter. Nothing here
imports the compile path, the cluster, the stores or the CLI (a contract in
``pyproject.toml``), so any layer may import it.
"""
