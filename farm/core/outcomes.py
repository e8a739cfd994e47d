"""Outcome names, written once (as Celery keeps its task states in ``celery/states.py``).

Two vocabularies:

* :class:`Outcome`: how an artifact was obtained, as a record keeps it (``Loaded``,
  ``Rekeyed``, ``Compiled``: capitalised, as stored since the first record format);
* :class:`Fate`: what became of a kernel, lower-case, as every summary counts it
  (``loaded``, ``rekeyed``, ``compiled``, ``unsupported``, ``failed``): a batch's and a
  warm's summary, ``farm build``'s and ``farm records``' columns, the workers' metrics
  label, a served application's counts.

The same words elsewhere are these: ``unsupported`` is the failure kind of a kernel the
device cannot run (:class:`~farm.core.errors.UnsupportedFeature`), ``compiled`` the
origin of an artifact its writer compiled here, ``failed`` and ``unsupported`` what
became of a tuning candidate or a family's check. Every other module takes them from
here (``tests/test_names.py`` finds one spelt out elsewhere).
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How an artifact was obtained."""

    LOADED = "Loaded"
    REKEYED = "Rekeyed"
    COMPILED = "Compiled"

    @property
    def fate(self) -> Fate:
        """What a summary counts it as (the same word, lower-case)."""
        return Fate(self.value.lower())


class Fate(StrEnum):
    """What became of a kernel, as a summary counts it."""

    LOADED = "loaded"
    REKEYED = "rekeyed"
    COMPILED = "compiled"
    UNSUPPORTED = "unsupported"
    FAILED = "failed"


#: the fates of a kernel that was obtained, in the order summaries show them
OBTAINED = (Fate.LOADED, Fate.REKEYED, Fate.COMPILED)


def fate_of(outcome: Outcome | None, failure_kind: str | None = None) -> Fate:
    """A kernel's fate from its outcome, or from its failure's kind when it has none: the
    device cannot run it (``unsupported``), else ``failed``."""
    if outcome is not None:
        return outcome.fate
    return Fate.UNSUPPORTED if failure_kind == Fate.UNSUPPORTED else Fate.FAILED
