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
from farm.store.minio import MinioStore

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


def minio_store(cluster: Any) -> MinioStore:
    settings = Settings(minio_endpoint=cluster.minio_endpoint,
                        minio_access_key=cluster.minio_access_key,
                        minio_secret_key=cluster.minio_secret_key,
                        minio_bucket=cluster.bucket)
    return MinioStore.from_settings(settings)


def namespace(fingerprint: str) -> Namespace:
    return Namespace.for_fingerprint(fingerprint)
