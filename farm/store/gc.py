"""Removing artifacts no build can be served again: keys of an earlier build of a family.

A changed family gets a new build id, so its old keys are never served again. The rekey
rule moves an old artifact when a new key reuses its source, but when several kernels of
a family share one source only one of them is moved (the source index names one key),
and kernels dropped from every manifest are never looked up at all. ``farm gc`` deletes
those: a key whose family is registered here and whose build id is not that family's
current one. A family this process does not know is left alone (another deployment's
kernel package may own it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from farm.core.keys import Namespace
from farm.families import Registry
from farm.store import ArtifactStore


@dataclass(frozen=True)
class Stale:
    namespace: Namespace
    key: str
    family: str
    build_id: str
    current_build_id: str


def find_stale(store: ArtifactStore, registry: Registry,
               namespaces: list[Namespace] | None = None) -> Iterator[Stale]:
    """Every stored key of an earlier build of a registered family."""
    current = {f.name: f.build_id for f in registry}
    for ns in namespaces if namespaces is not None else store.namespaces():
        for key in list(store.keys(ns)):
            art = store.get(ns, key)
            if art is None:
                continue  # corrupt entries are repaired, not collected
            family = art.meta.family
            if family in current and key.build_id != current[family]:
                yield Stale(ns, str(key), family, key.build_id, current[family])


def collect(store: ArtifactStore, registry: Registry, *, dry_run: bool = False,
            namespaces: list[Namespace] | None = None) -> list[Stale]:
    """Delete (unless ``dry_run``) and return the stale keys."""
    from farm.core.model import Key

    stale = list(find_stale(store, registry, namespaces))
    if not dry_run:
        for item in stale:
            store.delete(item.namespace, Key.parse(item.key))
    return stale
