"""Tuning results in the artifact store: stored like artifacts, trusted like them.

A result is an artifact of family :data:`~farm.core.keys.TUNING_FAMILY` whose bytes are
its JSON (:class:`~farm.tuning.model.TuningResult`), under the spec's key in the
device's namespace, so it gets what every artifact gets: the local tier and MinIO
(:func:`farm.store.open_store`), bundles, a digest checked on every read and, with
``FARM_SIGNING_KEY`` / ``FARM_VERIFY_KEY``, a signature that binds it to its key and
namespace. Beside it the problem's latest result is kept under the problem's index key
(family :data:`~farm.core.keys.TUNING_INDEX_FAMILY`), for readers that know the problem
only.

Reading never fails on a bad entry: a result that is corrupt, unsigned where signatures
are verified, not JSON, or that does not describe exactly the key it is stored under
(another problem, candidate list, build or device) is a miss, with a warning, and a
tuning writes a good one in its place.

Writing: the key's result is first-writer-wins like any artifact (two processes tuning
one key at once: the first result stays, and both report it); ``replace`` (``farm tune
--retune``) deletes the old one first. The index always takes the newest result.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from farm.core.errors import one_line
from farm.core.hashing import sha256_hex
from farm.core.keys import TUNING_FAMILY, TUNING_INDEX_FAMILY, Namespace
from farm.core.model import Artifact, Key
from farm.store.base import ArtifactStore, PutResult
from farm.tuning.keys import TuningSpec
from farm.tuning.model import TuningResult

log = logging.getLogger(__name__)

#: the largest result a reader parses (a thousand candidates take about 300 KB)
MAX_RESULT_BYTES = 4 * 1024 * 1024


def encode(result: TuningResult) -> bytes:
    return result.model_dump_json().encode()


def _artifact(key: Key, family: str, result: TuningResult) -> Artifact:
    data = encode(result)
    return Artifact.create(key, family, data, sha256_hex(data), host=result.host,
                           worker=result.worker, work_s=result.wall_s)


def decode(art: Artifact, ns: Namespace, want: TuningSpec, *, index: bool) -> TuningResult | None:
    """The result ``art`` holds, if it is one of ``want`` (its exact candidate list, or
    with ``index`` any list of the same problem) measured on ``ns``'s device; else
    ``None`` with a warning."""
    why = ""
    family = TUNING_INDEX_FAMILY if index else TUNING_FAMILY
    if art.meta.family != family:
        why = f"it is of family {art.meta.family!r}, not {family!r}"
    elif len(art.binary) > MAX_RESULT_BYTES:
        why = f"{len(art.binary)} bytes, over {MAX_RESULT_BYTES}"
    else:
        try:
            result = TuningResult.model_validate_json(art.binary)
        except (ValidationError, ValueError) as exc:
            why = f"not a tuning result ({one_line(exc)[:200]})"
        else:
            if result.fingerprint != ns.fingerprint:
                why = f"measured on {result.fingerprint}, not this device"
            elif not (want.same_problem(result.spec) if index else result.spec == want):
                why = "it describes another key"
            else:
                return result
    log.warning("tuning: the result stored for %s in %s is refused (%s); a miss",
                art.meta.key, ns, why)
    return None


def read(store: ArtifactStore, ns: Namespace, spec: TuningSpec) -> TuningResult | None:
    """The result of exactly ``spec`` (its candidate list), or ``None``."""
    art = store.get(ns, spec.key())
    return None if art is None else decode(art, ns, spec, index=False)


def read_latest(store: ArtifactStore, ns: Namespace, spec: TuningSpec) -> TuningResult | None:
    """The latest result of ``spec``'s problem, whatever its candidates, or ``None``."""
    art = store.get(ns, spec.index_key())
    return None if art is None else decode(art, ns, spec, index=True)


def write(store: ArtifactStore, ns: Namespace, result: TuningResult, *,
          replace: bool = False) -> TuningResult:
    """Store ``result`` under its key (``replace``: instead of what is there) and as its
    problem's latest; returns the result the key holds afterwards (another writer's,
    when it came first)."""
    spec = result.spec
    key = spec.key()
    if replace:
        store.delete(ns, key)
    kept = result
    if store.put(ns, _artifact(key, TUNING_FAMILY, result)) is PutResult.REFUSED:
        there = read(store, ns, spec)
        if there is not None:
            kept = there
        else:  # what is there is no result (damaged, unsigned): ours takes its place
            store.delete(ns, key)
            store.put(ns, _artifact(key, TUNING_FAMILY, result))
    latest = _artifact(spec.index_key(), TUNING_INDEX_FAMILY, kept)
    if store.put(ns, latest) is PutResult.REFUSED:  # an older tuning of the problem
        store.delete(ns, spec.index_key())
        store.put(ns, latest)
    return kept
