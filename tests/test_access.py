"""Least privilege in MinIO (issue 19 item 5), with real MinIO users and policies.

* a pool's credentials write only its own fingerprint's namespace: another pool's
  namespace refuses its writes and deletes (``AccessDenied``, a one-line StoreError);
* a loader with read-only credentials compiles on a miss, keeps the kernel in its local
  tier, and says so once (one log line, not one per kernel).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from farm.cluster.access import Grant, apply, pool_policy, read_policy
from farm.core.errors import StoreAccessDenied, StoreError
from farm.core.keys import Namespace
from farm.core.model import Artifact, Key
from farm.store.minio import MinioStore, Retry

pytestmark = pytest.mark.integration

FP_A = "pocl-pool-a-0123456789ab"
FP_B = "nvidia-pool-b-0123456789ab"
NS_A, NS_B = Namespace.for_fingerprint(FP_A), Namespace.for_fingerprint(FP_B)


def credentials() -> tuple[str, str]:
    return "u" + secrets.token_hex(6), secrets.token_urlsafe(18)


@pytest.fixture(scope="module")
def users(minio_server: Any) -> dict[str, Any]:
    """A bucket with pool users for A and B and a reader, made by ``access.apply``."""
    from minio import Minio
    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    bucket = f"t-{uuid.uuid4().hex[:12]}"
    made = {name: credentials() for name in ("a", "b", "reader")}
    grants = [Grant(access_key=made["a"][0], secret_key=made["a"][1], fingerprint=FP_A),
              Grant(access_key=made["b"][0], secret_key=made["b"][1], fingerprint=FP_B),
              Grant(access_key=made["reader"][0], secret_key=made["reader"][1], reader=True)]
    admin = MinioAdmin(endpoint=minio_server.endpoint, secure=False,
                       credentials=StaticProvider(minio_server.access_key,
                                                  minio_server.secret_key))
    root = Minio(minio_server.endpoint, access_key=minio_server.access_key,
                 secret_key=minio_server.secret_key, secure=False)
    done = apply(admin, root, bucket, grants)
    assert any("kernel-farm-pool-" + FP_A in line for line in done)
    again = apply(admin, root, bucket, grants)  # idempotent
    assert not any("bucket" in line for line in again)
    return {"bucket": bucket, "endpoint": minio_server.endpoint, **made}


def store_as(users: dict[str, Any], who: str) -> MinioStore:
    access, secret = users[who]
    return MinioStore(users["endpoint"], access, secret, users["bucket"],
                      retry=Retry(attempts=1))


def art(i: int) -> Artifact:
    return Artifact.create(Key(id_hash=f"{i:032x}", build_id="b" * 24), "fam",
                           f"binary {i}".encode(), "5" * 64)


def test_the_policies_name_the_namespace_prefix() -> None:
    writes = pool_policy("bkt", FP_A)["Statement"][-1]
    assert writes["Action"] == ["s3:PutObject"]  # create; no delete (write-once)
    assert writes["Resource"] == [f"arn:aws:s3:::bkt/opencl/v1/{FP_A}/*"]
    assert all("Put" not in a for s in read_policy("bkt")["Statement"] for a in s["Action"])


def test_a_pool_cannot_write_another_pools_namespace(users: dict[str, Any]) -> None:
    pool_a, pool_b = store_as(users, "a"), store_as(users, "b")
    assert pool_a.put(NS_A, art(1)).value == "stored"
    assert pool_b.put(NS_B, art(2)).value == "stored"
    assert pool_a.get(NS_B, art(2).meta.key) is not None  # reading is fine
    with pytest.raises(StoreAccessDenied, match="AccessDenied"):
        pool_a.put(NS_B, art(3))
    with pytest.raises(StoreAccessDenied):
        pool_a.delete(NS_B, art(2).meta.key)
    with pytest.raises(StoreError):
        pool_a.quarantine(NS_B, art(2).meta.key, art(2).meta.digest, "hostile")
    assert pool_b.get(NS_B, art(2).meta.key) is not None  # B's binary untouched
    assert pool_b.get(NS_B, art(3).meta.key) is None
    reader = store_as(users, "reader")
    with pytest.raises(StoreAccessDenied):
        reader.put(NS_A, art(4))
    for s in (pool_a, pool_b, reader):
        s.close()


def test_a_read_only_loader_compiles_locally_and_says_so_once(
        users: dict[str, Any], tmp_path: Path) -> None:
    manifest = tmp_path / "m.toml"
    manifest.write_text('format = 1\nname = "ro"\n\n'
                        '[[kernels]]\nfamily = "elementwise_unary"\nparams = { op = "neg" }\n\n'
                        '[[kernels]]\nfamily = "elementwise_unary"\nparams = { op = "silu" }\n')
    access, secret = users["reader"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_WORKERS="0",
               FARM_MINIO_ENDPOINT=users["endpoint"], FARM_MINIO_ACCESS_KEY=access,
               FARM_MINIO_SECRET_KEY=secret, FARM_MINIO_BUCKET=users["bucket"],
               PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    def stored() -> dict[Namespace, set[Key]]:
        """Every key of the shared bucket, whatever the other tests of the file wrote."""
        view = store_as(users, "a")  # any user may read
        try:
            return {ns: set(view.keys(ns)) for ns in view.namespaces()}
        finally:
            view.close()

    before = stored()
    warm = subprocess.run([sys.executable, "-m", "farm", "warm", str(manifest), "--json"],
                          env=env, text=True, capture_output=True, timeout=300, check=False)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert json.loads(warm.stdout)["summary"]["compiled"] == 2
    said = [line for line in warm.stderr.splitlines() if "read-only" in line]
    assert len(said) == 1, warm.stderr
    assert access not in warm.stderr and secret not in warm.stderr
    again = subprocess.run([sys.executable, "-m", "farm", "warm", str(manifest), "--json"],
                           env=env, text=True, capture_output=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["summary"]["local"] == 2
    assert stored() == before  # the reader compiled into its local tier, not the bucket
    logging.getLogger(__name__).info("read-only warm: %s", said[0])


@pytest.mark.parametrize("grants, said", [
    ("[1]", "0: Input should be an object"),
    ('[{"access_key_env": "A"}]', "0.secret_key_env: Field required"),
    ("not json", "Invalid JSON"),
    ('[{"access_key_env": "A", "secret_key_env": "B", "evil": 1}]', "0.evil: unknown field"),
    ('[{"access_key_env": "A", "secret_key_env": "B"}]',
     "0.access_key: String should have at least 3 characters"),
    ('{"grants": []}', "Input should be a valid array"),
])
def test_malformed_grants_are_one_line_naming_the_entry(
        grants: str, said: str, tmp_path: Path) -> None:
    """The set-up Job's ``FARM_ACCESS_GRANTS`` malformed or hostile: one line naming the
    entry and the field, exit 2, no traceback, nothing asked of MinIO (``[1]`` was a
    ``TypeError`` traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(tmp_path / "home"), FARM_ACCESS_GRANTS=grants,
               FARM_MINIO_ENDPOINT="127.0.0.1:1")
    proc = subprocess.run([sys.executable, "-m", "farm.cluster.access"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("access: FARM_ACCESS_GRANTS: ") and said in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
