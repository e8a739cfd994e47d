"""Trust in the cluster (issue 19), for real: Redis, MinIO and a ``farm worker``.

* ``farm build --cluster`` with ``FARM_VERIFY_KEY`` trusts nothing it has not verified:
  a tampered (unsigned) artifact in MinIO is not counted as Loaded, it is rebuilt.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import build_json, minio_store, namespace, next_redis_db, write_manifest

from farm.core.model import Artifact, Key
from farm.devservices.cluster import LocalCluster, local_cluster
from farm.families import Registry
from farm.manifest import expand, load_manifest
from farm.store.signing import Verifier, generate_keypair

pytestmark = pytest.mark.integration

KEYS = generate_keypair()


@pytest.fixture(scope="module")
def cluster(redis_server: Any, minio_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("trust-cluster")
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       FARM_CHUNK_SIZE="2") as c:
        c.start_worker(FARM_SIGNING_KEY=KEYS[0])
        c.wait_ready()
        yield c


def _keys(manifest: Path) -> list[Key]:
    registry = Registry.load([])
    return [Key(id_hash=e.artifact.id_hash, build_id=registry.get(e.family).build_id)
            for e in expand(load_manifest(manifest), registry)]


def test_a_cluster_build_with_a_verify_key_counts_nothing_unverified_as_loaded(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 19 item 4: three tampered artifacts (right digest, no signature) were
    reported Loaded by ``farm build --cluster`` unless ``--verify`` was given."""
    manifest = write_manifest(tmp_path / "m.toml", salt=41, count=3)
    env = cluster.env(tmp_path / "client", FARM_VERIFY_KEY=KEYS[1])
    first = build_json(env, str(manifest))
    assert first["summary"]["compiled"] == 3, first["summary"]
    store = minio_store(cluster)
    ns = namespace(first["fingerprint"])
    for key in _keys(manifest):
        signed = store.get(ns, key)
        assert signed is not None and Verifier(KEYS[1]).verify(signed.meta, ns)
        store.delete(ns, key)  # a store writer without the signing key
        store.put(ns, Artifact.create(key, signed.meta.family, b"tampered " + key.id_hash.encode(),
                                      signed.meta.source_hash))

    again = build_json(env, str(manifest))
    assert again["summary"]["loaded"] == 0, again["summary"]
    assert again["summary"]["compiled"] + again["summary"]["rekeyed"] == 3, again["summary"]
    for key in _keys(manifest):
        repaired = store.get(ns, key)
        assert repaired is not None and Verifier(KEYS[1]).verify(repaired.meta, ns)
    store.close()
