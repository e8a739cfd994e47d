"""The quick path on PoCL's CPU drivers: a program's work-group function records merged
into its binary, and what its launches make harvested, without the program server.

:mod:`farm.programs.supplements` reads and merges the records, :mod:`farm.programs.harvest`
stores what the launches make; what the server gives them (store tiers, a harvest
store) is given here by the quick path (:mod:`farm.programs.quick`): the node's local
tier and MinIO read as the quick path reads them, as tiers that answer records as
artifacts. The records' models (pydantic) load with the first program that has records;
the server, its settings and the MinIO SDK do not load at all unless a harvest has
something to store. Whatever is not plain (a record refused, a binary not named by its
content) is the server's: the quick path declines the build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactMeta, Key
from farm.programs.harvest import Harvester
from farm.programs.prepared import Prepared
from farm.programs.program_key import PROGRAM_BUILD_ID

if TYPE_CHECKING:
    from farm.store.base import ArtifactStore

#: reads one stored artifact's (metadata JSON, binary) by namespace, key id and build id
RowReader = Callable[[str, str, str], "tuple[str | bytes, bytes] | None"]


class _Reads:
    """One tier as :class:`~farm.programs.supplements.SlotReader` walks tiers: ``get``
    answers an artifact, verified, or ``None``."""

    def __init__(self, read: RowReader) -> None:
        self._read = read

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        row = self._read(str(ns), key.id_hash, key.build_id)
        if row is None:
            return None
        try:
            art = Artifact(meta=ArtifactMeta.model_validate_json(row[0]), binary=row[1])
        except ValueError:
            return None
        return art if art.verify() and art.meta.key == key else None


@dataclass(frozen=True)
class _Tier:
    store: _Reads


class Records:
    """The records side of the quick path in one process (thread-safe where it must be:
    the harvester is)."""

    def __init__(self, tiers: list[RowReader], harvest_store: Callable[[], ArtifactStore],
                 warn: Callable[[str], None]) -> None:
        self._tiers = [_Tier(_Reads(read)) for read in tiers]
        self._harvest_store = harvest_store
        self._warn = warn
        self._harvester: Harvester | None = None

    def prepare(self, fingerprint: str, key: str, binary: bytes
                ) -> tuple[Prepared, list[tuple[int, Artifact]]] | None:
        """``binary`` with its records merged, and the records a later tier served (to
        keep in the ones in front); ``None`` to decline (see the module docstring)."""
        del fingerprint, key, binary  # records are proven first (issue 29): the server's
        return None

    def watch(self, fingerprint: str, key: str, prep: Prepared, source_hash: str,
              handle: object) -> None:
        """Harvest what ``handle``'s launches make (see :mod:`farm.programs.harvest`)."""
        if self._harvester is None:
            self._harvester = Harvester(self._harvest_store, self._warn)
        self._harvester.watch(Namespace.for_fingerprint(fingerprint),
                              Key(id_hash=key, build_id=PROGRAM_BUILD_ID), prep,
                              source_hash, handle)

    def close(self) -> None:
        """The last harvest (the process ends)."""
        harvester, self._harvester = self._harvester, None
        if harvester is not None:
            harvester.close()
