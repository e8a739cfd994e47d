"""Which blobs a bundle must carry for the programs it carries.

A program artifact's ``source_hash`` names its spec's blob
(:meth:`~farm.programs.spec.ProgramSpec.to_blob`), and the spec names its source and
headers; a bundle with that artifact carries all three, so the machine that imports it
can build the program for its own devices too (``farm build`` reads them by digest).
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from farm.core.keys import PROGRAM_FAMILY
from farm.core.model import Artifact
from farm.programs.spec import ProgramSpec
from farm.store.base import ArtifactStore


def blobs_of(store: ArtifactStore) -> Callable[[Artifact], list[str]]:
    """For :func:`farm.store.bundle.export_bundle`: the digests of a program artifact's
    spec, source and headers (nothing for a family's artifact, or a spec that is missing
    or unreadable in ``store``)."""
    def of(art: Artifact) -> list[str]:
        if art.meta.family != PROGRAM_FAMILY:
            return []
        raw = store.get_blob(art.meta.source_hash)
        if raw is None:
            return []
        try:
            spec = ProgramSpec.model_validate_json(raw)
        except ValidationError:
            return []
        return [art.meta.source_hash, *spec.digests()]
    return of
