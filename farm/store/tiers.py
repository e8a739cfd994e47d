"""A store's tiers as a reader walks them, named ``local`` or ``remote``.

Readers that must load a binary before a front tier keeps a copy of it (the loader, the
program hook: a binary the device refuses is never copied forward) walk the tiers
themselves rather than through :meth:`TieredStore.get`, which copies on read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from farm.store.base import ArtifactStore
from farm.store.memory import MemoryStore
from farm.store.signing import SigningStore
from farm.store.sqlite import SQLiteStore
from farm.store.tiered import TieredStore

TierName = Literal["local", "remote"]



@dataclass(frozen=True)
class Tier:
    """One store tier as the loader walks it: a name for summaries, and the store."""

    name: TierName
    store: ArtifactStore


def tiers_of(store: ArtifactStore) -> list[Tier]:
    """The tiers of ``store`` front to back, each named ``local`` or ``remote``.

    In a :class:`~farm.store.TieredStore` the last tier is the shared truth (MinIO in a
    cluster) and is named remote, the ones in front of it local. A plain store is one
    tier: local when it lives on this machine (SQLite file, memory), else remote.
    """
    if isinstance(store, SigningStore):  # the signing rules apply to every tier
        return [Tier(t.name, SigningStore(t.store, store.signer, store.verifier))
                for t in tiers_of(store.inner)]
    if isinstance(store, TieredStore) and len(store.tiers) > 1:
        return [Tier("local", s) for s in store.tiers[:-1]] + [Tier("remote", store.tiers[-1])]
    single = store.tiers[0] if isinstance(store, TieredStore) else store
    return [Tier("local" if isinstance(single, SQLiteStore | MemoryStore) else "remote",
                 single)]
