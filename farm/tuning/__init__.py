"""Tuning: which candidate of a problem to launch, measured on the device it is for.

A model build compiles every tuning candidate of a manifest; tuning times them and
keeps the answer. The design, by module:

* :mod:`~farm.tuning.keys`: a family with a tuning space names its tuning parameters
  (matmul: the tile shape); the other parameters, launch and variant are the
  *problem*. A key is family + problem + the digest of the candidate list + the
  family's build id, in the device fingerprint's namespace like any artifact: a new
  driver is a new fingerprint and so a new tuning, changed family code a new build id,
  another candidate list another key. An old winner is never served for anything else.
* :mod:`~farm.tuning.measure`: honest timing. Every candidate is checked against the
  family's reference first (wrong values: ``wrong``, never a winner; a kernel the device
  cannot run: ``unsupported``), buffers are made once, then warm-ups and rounds in which
  the candidates take turns, timed by the device's profiling events, until each has
  enough launches and kernel time; median and spread are kept for every candidate. All
  candidates of one key run on one device in one process.
* :mod:`farm.core.isolation` (beside the compile path, which takes its slots): while a
  CPU device is measured no compile runs on the host's cores, and no two processes
  measure one device at once: host-wide file locks, so a worker pool, a ``farm build``
  and a ``farm tune`` on one host keep out of each other's way without talking.
* :mod:`~farm.tuning.model`: the measurement policy and the stored result (every
  candidate's figures and the winner: nothing measured is thrown away).
* :mod:`~farm.tuning.store`: results are artifacts of a data family, so they go to the
  local tier and MinIO, into bundles, are digest-checked and signed like binaries; a
  result that does not check out is a miss, never a crash. The problem's latest result
  is indexed for readers that know the problem only (``KernelLoader.tuned``).
* :mod:`~farm.tuning.runner`: one key on this process's device: reuse, or check, time,
  record (a Changed ``tune`` record) and store. ``farm tune`` and the loader use it here;
  :mod:`~farm.tuning.cluster` sends one key per task to the fingerprint's pool, where
  ``worker.tune`` runs the same runner on the worker's device.
* :mod:`~farm.tuning.report`: the ``--json`` document and the table's figures.

docs/TUNING.md is the user's page: how to tune, what is measured and how, isolation,
how to read a tuning table.
"""

# ruff: noqa: F401 - the TYPE_CHECKING block is the list of public names (farm.core.lazy)
from __future__ import annotations

from typing import TYPE_CHECKING

from farm.core.lazy import public_names

# The public names, imported on first use (this block is their one list: farm.core.lazy)
if TYPE_CHECKING:
    from farm.tuning.keys import TuningSpec, plan, spec_for
    from farm.tuning.model import Figures, MeasurePolicy, TuningResult
    from farm.tuning.runner import TuneOutcome, Tuner

__getattr__, __dir__ = public_names(__name__)
