"""Artifact stores: the interface, the embedded SQLite store; MinIO and tiers join here."""

from farm.store.base import ArtifactStore, PutResult, StoreStats
from farm.store.sqlite import SQLiteStore

__all__ = ["ArtifactStore", "PutResult", "SQLiteStore", "StoreStats"]
