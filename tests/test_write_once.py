"""The store is write-once for a pool (issue 33 item 2), against a real MinIO whose users
and policies ``farm.cluster.access.apply`` made:

* a pool may create an artifact in its namespace, and may delete nothing: MinIO refuses
  its delete of an object and of any version of one;
* MinIO cannot refuse a pool's plain overwrite of a name it may create (no policy
  condition says "only if absent", which this test shows too): the versioned bucket
  keeps the original as an older version no pool can remove, and readers verify;
* the store's own deletes under a pool's credentials empty the object (a tombstone) and
  keep every fault-healing path working: quarantine, repair, a put over a deleted key;
* the repair role removes an object with every version, ``farm gc`` included.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from minio import Minio
from minio.error import MinioAdminException, S3Error

from farm.cluster.access import Grant, apply
from farm.core.keys import Namespace, artifact_object
from farm.core.model import Artifact, Key
from farm.store.base import PutResult
from farm.store.minio import MinioStore, Retry
from farm.store.s3_failures import ClientOptions

pytestmark = pytest.mark.integration

FP = "pocl-write-once-0123456789ab"
NS = Namespace.for_fingerprint(FP)


def _pair() -> tuple[str, str]:
    return "w" + secrets.token_hex(6), secrets.token_urlsafe(18)


@pytest.fixture(scope="module")
def bucket(minio_server: Any) -> dict[str, Any]:
    """A bucket set up as the chart and ``farm cluster up`` do: a pool, a repair role."""
    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    name = f"wo-{uuid.uuid4().hex[:12]}"
    made = {"pool": _pair(), "repair": _pair()}
    admin = MinioAdmin(endpoint=minio_server.endpoint, secure=False,
                       credentials=StaticProvider(minio_server.access_key,
                                                  minio_server.secret_key))
    root = Minio(minio_server.endpoint, access_key=minio_server.access_key,
                 secret_key=minio_server.secret_key, secure=False)
    done = apply(admin, root, name, [
        Grant(access_key=made["pool"][0], secret_key=made["pool"][1], fingerprint=FP),
        Grant(access_key=made["repair"][0], secret_key=made["repair"][1], repair=True)])
    assert f"bucket {name}: versioning on" in done
    return {"bucket": name, "endpoint": minio_server.endpoint, "root": root,
            "admin": admin, **made}


def raw(bucket: dict[str, Any], who: str) -> Minio:
    access, secret = bucket[who]
    return Minio(bucket["endpoint"], access_key=access, secret_key=secret, secure=False)


def store(bucket: dict[str, Any], who: str, *, repair: bool = False) -> MinioStore:
    access, secret = bucket[who]
    return MinioStore(bucket["endpoint"], access, secret, bucket["bucket"],
                      retry=Retry(attempts=1),
                      client=ClientOptions(repair=bucket["repair"] if repair else None))


def art(tag: str, size: int = 65_000) -> Artifact:
    return Artifact.create(Key(id_hash=uuid.uuid4().hex, build_id="b" * 24), "fam",
                           (tag.encode() * size)[:size], "5" * 64)


def versions(bucket: dict[str, Any], name: str) -> list[tuple[int, bool]]:
    """(size, is the latest) of every version of ``name``, newest first."""
    return [(o.size or 0, o.is_latest == "true") for o in bucket["root"].list_objects(
        bucket["bucket"], prefix=name, include_version=True) if o.object_name == name]


def test_a_pool_creates_but_may_not_delete_and_its_overwrite_keeps_the_original(
        bucket: dict[str, Any]) -> None:
    pool = store(bucket, "pool")
    a = art("original")
    assert pool.put(NS, a) is PutResult.STORED  # a first write is allowed
    name = artifact_object(NS, a.meta.key)
    hand = raw(bucket, "pool")
    with pytest.raises(S3Error) as refused:
        hand.remove_object(bucket["bucket"], name)
    assert refused.value.code == "AccessDenied"
    (original,) = [o.version_id for o in bucket["root"].list_objects(
        bucket["bucket"], prefix=name, include_version=True)]
    with pytest.raises(S3Error) as refused:
        hand.remove_object(bucket["bucket"], name, version_id=original)
    assert refused.value.code == "AccessDenied"
    # MinIO takes a plain overwrite from whoever may create the name ...
    hand.put_object(bucket["bucket"], name, io.BytesIO(b"evil"), 4)
    # ... but the original stays, as an older version no pool may remove
    sizes = versions(bucket, name)
    assert sizes[0] == (4, True) and sizes[1][0] > 65_000 and not sizes[1][1]
    kept = bucket["root"].get_object(bucket["bucket"], name, version_id=original)
    try:
        assert kept.read().endswith(a.binary)
    finally:
        kept.close()
        kept.release_conn()
    # and no reader takes the 4 bytes for the artifact
    assert pool.get(NS, a.meta.key) is None
    assert pool.stats.corrupt == 1
    # a pool that finds it damaged repairs it (a conditional write over what it read)
    assert pool.put(NS, a) is PutResult.STORED
    assert pool.get(NS, a.meta.key) == a
    pool.close()


@pytest.mark.parametrize("condition, refused", [
    ({"Null": {"s3:if-none-match": "true"}}, "invalid condition key"),
    # the other way a policy could see that a name exists: a tag every stored object
    # carries, denied on the existing object (AWS evaluates it for reads, not writes)
    ({"StringEquals": {"s3:ExistingObjectTag/farm": "stored"}},
     "unsupported condition keys .* for action 's3:PutObject'"),
])
def test_minio_has_no_policy_condition_that_refuses_an_overwrite(
        bucket: dict[str, Any], condition: dict[str, Any], refused: str) -> None:
    """Why the overwrite is not refused: MinIO's policies know no ``s3:if-none-match``
    (AWS's way to require conditional writes), and take no condition on the existing
    object's tags for a ``PutObject``. When a MinIO learns either, this fails, and the
    pool policy should require it."""
    document = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Action": ["s3:PutObject"],
        "Resource": [f"arn:aws:s3:::{bucket['bucket']}/*"], "Condition": condition}]}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
        json.dump(document, fh)
        fh.flush()
        with pytest.raises(MinioAdminException, match=refused):
            bucket["admin"].policy_add("farm-conditional-" + secrets.token_hex(3), fh.name)


def test_a_pool_stores_deletes_and_quarantines_by_emptying(bucket: dict[str, Any]) -> None:
    pool = store(bucket, "pool")
    a, b = art("moved"), art("refused by the device")
    assert pool.put(NS, a) is PutResult.STORED
    pool.delete(NS, a.meta.key)  # refused by MinIO, done by a tombstone
    assert pool.get(NS, a.meta.key) is None and pool.stats.corrupt == 0
    assert pool.existing(NS, [a.meta.key]) == set()
    assert a.meta.key not in set(pool.keys(NS))
    name = artifact_object(NS, a.meta.key)
    (empty, _), (kept, _) = versions(bucket, name)  # the original kept below
    assert empty == 0 and kept > 65_000
    assert pool.put(NS, a) is PutResult.STORED  # a put over a deleted key
    assert pool.get(NS, a.meta.key) == a
    # the quarantine of a binary the device refused, and its repair, with no delete
    assert pool.put(NS, b) is PutResult.STORED
    assert pool.quarantine(NS, b.meta.key, b.meta.digest, "the device refused it")
    assert pool.get(NS, b.meta.key) is None
    assert [q.artifact.binary for q in pool.quarantined(NS)] == [b.binary]
    repaired = Artifact.create(b.meta.key, "fam", b"the repair", "5" * 64)
    assert pool.put(NS, repaired) is PutResult.STORED
    assert pool.get(NS, b.meta.key) == repaired
    pool.close()


def test_the_repair_role_removes_every_version(bucket: dict[str, Any]) -> None:
    pool, repair = store(bucket, "pool"), store(bucket, "repair", repair=True)
    a = art("collected")
    assert pool.put(NS, a) is PutResult.STORED
    name = artifact_object(NS, a.meta.key)
    raw(bucket, "pool").put_object(bucket["bucket"], name, io.BytesIO(b"evil"), 4)
    assert len(versions(bucket, name)) == 2
    repair.delete(NS, a.meta.key)
    assert versions(bucket, name) == []
    assert pool.put(NS, a) is PutResult.STORED  # and the key is free again
    assert repair.get(NS, a.meta.key) == a
    for s in (pool, repair):
        s.close()


def test_farm_gc_removes_every_version_through_the_repair_role(
        bucket: dict[str, Any], tmp_path: Path) -> None:
    """``farm gc`` with a pool's credentials only can empty a stale artifact (its
    versions stay); with the repair role's beside them it removes every version."""
    pool = store(bucket, "pool")
    stale = [Artifact.create(Key(id_hash=uuid.uuid4().hex, build_id="0" * 24), "reduce",
                             b"an earlier build" * 100, "5" * 64) for _ in range(2)]
    for a in stale:
        assert pool.put(NS, a) is PutResult.STORED
    pool.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_MINIO_ENDPOINT=bucket["endpoint"],
               FARM_MINIO_BUCKET=bucket["bucket"], FARM_MINIO_ACCESS_KEY=bucket["pool"][0],
               FARM_MINIO_SECRET_KEY=bucket["pool"][1])

    def gc(**extra: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "farm", "gc", "--namespace", str(NS),
                               "--json"], env={**env, **extra}, text=True,
                              capture_output=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert bucket["repair"][1] not in proc.stdout + proc.stderr
        return [s["key"] for s in json.loads(proc.stdout)["stale"]]

    first, second = (artifact_object(NS, a.meta.key) for a in stale)
    assert sorted(gc()) == sorted(str(a.meta.key) for a in stale)  # a pool: emptied only
    for name in (first, second):  # the newest version empty, the artifact below it
        (empty, _), (kept, _) = versions(bucket, name)
        assert empty == 0 and kept > 1000
    repair = store(bucket, "repair", repair=True)
    for a in stale:  # put back, then collected by the repair role
        assert repair.put(NS, a) is PutResult.STORED
    repair.close()
    assert sorted(gc(FARM_MINIO_REPAIR_ACCESS_KEY=bucket["repair"][0],
                     FARM_MINIO_REPAIR_SECRET_KEY=bucket["repair"][1])) == \
        sorted(str(a.meta.key) for a in stale)
    assert versions(bucket, first) == versions(bucket, second) == []


def test_a_capture_build_counts_a_replaced_program_as_a_miss(bucket: dict[str, Any]) -> None:
    """``farm build CAPTURE`` (here or on the cluster) counted a held program Loaded from
    the listing: 4 bytes over it were Loaded. Now it is read and checked: a miss."""
    from farm.core.hashing import sha256_hex
    from farm.programs.prebuild import _results
    from farm.programs.spec import ProgramSpec

    pool = store(bucket, "pool")
    specs = [ProgramSpec(source=sha256_hex(f"kernel {i} {uuid.uuid4()}".encode()),
                         source_size=20) for i in range(2)]
    for spec in specs:
        assert pool.put(NS, Artifact.create(spec.key, "program", b"a binary" * 100,
                                            sha256_hex(spec.to_blob()))) is PutResult.STORED
    raw(bucket, "pool").put_object(bucket["bucket"], artifact_object(NS, specs[0].key),
                                   io.BytesIO(b"evil"), 4)
    results, misses = _results(pool, NS, specs, lambda _: None)
    assert [spec.key for _, spec in misses] == [specs[0].key]
    assert results[0].outcome is None and results[1].outcome is not None
    pool.close()


def test_the_set_up_job_makes_the_repair_role_when_its_keys_are_given(
        minio_server: Any, bucket: dict[str, Any], tmp_path: Path) -> None:
    """``python -m farm.cluster.access`` as the chart's Job runs it (root credentials,
    grants naming variables): with the repair keys, the repair user is made and may
    delete a version a pool may not; without them (an existingSecret made before the
    role), it is left out in one line and the rest is made. No secret is printed."""
    # the module's bucket: MinIO's policy names are the server's, not a bucket's, so the
    # same grants for another bucket would re-point this module's pool and repair users
    name = bucket["bucket"]
    pool, repair = _pair(), _pair()
    grants = [{"fingerprint": FP, "access_key_env": "P_KEY", "secret_key_env": "P_SECRET"},
              {"repair": True, "optional": True, "access_key_env": "R_KEY",
               "secret_key_env": "R_SECRET"}]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_MINIO_ENDPOINT=minio_server.endpoint,
               FARM_MINIO_BUCKET=name, FARM_MINIO_ACCESS_KEY=minio_server.access_key,
               FARM_MINIO_SECRET_KEY=minio_server.secret_key,
               FARM_ACCESS_GRANTS=json.dumps(grants), P_KEY=pool[0], P_SECRET=pool[1])

    def job(**extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "farm.cluster.access"],
                              env={**env, **extra}, text=True, capture_output=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        for secret in (pool[1], repair[1], minio_server.secret_key):
            assert secret not in proc.stdout + proc.stderr
        return proc.stdout

    out = job()
    assert "access: repair user not made: R_KEY and R_SECRET are empty" in out
    assert f"user {pool[0]}: kernel-farm-pool-{FP}" in out
    out = job(R_KEY=repair[0], R_SECRET=repair[1])
    assert f"user {repair[0]}: kernel-farm-repair" in out and "not made" not in out

    made = {"bucket": name, "endpoint": minio_server.endpoint, "pool": pool,
            "repair": repair}
    a = art("job")
    writer = store(made, "pool")
    assert writer.put(NS, a) is PutResult.STORED
    writer.close()
    obj = artifact_object(NS, a.meta.key)
    with pytest.raises(S3Error, match="AccessDenied"):
        raw(made, "pool").remove_object(name, obj)
    raw(made, "repair").remove_object(name, obj)
    assert not [o for o in raw(made, "repair").list_objects(name, prefix=obj)]
