"""Shared helpers for the cluster integration tests (real Redis, MinIO, Celery workers)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from farm.core.keys import Namespace
from farm.core.settings import Settings
from farm.store.base import ArtifactStore
from farm.store.open import open_store

_db = itertools.count(1)


def next_redis_db() -> int:
    """A Redis database of its own for each cluster of the test session."""
    return next(_db)


def write_manifest(path: Path, salt: int, count: int) -> Path:
    """``count`` cheap kernels whose sources are unique to ``salt``."""
    lines = ["format = 1", f'name = "salted-{salt}"', ""]
    for i in range(count):
        lines += ["[[kernels]]", 'family = "reduce"',
                  f'params = {{ op = "sum", cols = {salt * 100 + i + 1} }}', ""]
    path.write_text("\n".join(lines))
    return path


def farm(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def build_json(env: dict[str, str], *args: str, timeout: float = 300) -> dict[str, Any]:
    proc = farm(env, "build", *args, "--cluster", "--json", timeout=timeout)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def minio_store(cluster: Any) -> ArtifactStore:
    settings = Settings(minio_endpoint=cluster.minio_endpoint,
                        minio_access_key=cluster.minio_access_key,
                        minio_secret_key=cluster.minio_secret_key,
                        minio_bucket=cluster.bucket)
    return open_store(settings, shared=True, signed=False)


def namespace(fingerprint: str) -> Namespace:
    return Namespace.for_fingerprint(fingerprint)


def read_only_user(cluster: Any) -> tuple[str, str]:
    """A MinIO user of ``cluster`` that may list and read but not write (a worker given
    the wrong, least-privilege credentials): its access and secret key."""
    import secrets

    from minio.credentials import StaticProvider
    from minio.minioadmin import MinioAdmin

    admin = MinioAdmin(endpoint=cluster.minio_endpoint, secure=False,
                       credentials=StaticProvider(cluster.minio_access_key,
                                                  cluster.minio_secret_key))
    access, secret = f"reader-{secrets.token_hex(4)}", secrets.token_urlsafe(18)
    admin.user_add(access, secret)
    name = f"reads-only-{secrets.token_hex(4)}"
    admin.policy_add(name, policy={"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Resource": ["arn:aws:s3:::*"],
        "Action": ["s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation"]}]})
    admin.attach_policy([name], user=access)
    return access, secret
