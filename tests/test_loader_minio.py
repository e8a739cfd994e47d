"""The loader against a real MinIO: a second process with an empty local tier warms the
medium manifest from MinIO without compiling anything, and leaves every artifact in its
local tier (so a third run needs no network).

The fill is the expensive part (about 200 kernels compiled on two processes), done once
per module through the farm's own batch with a tiered SQLite + MinIO store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from farm.compilation.batch import Batch
from farm.compilation.compiler import ProcessPoolCompiler
from farm.core.device import DeviceContext, probe_devices, select_device
from farm.core.keys import Namespace
from farm.core.settings import Settings
from farm.families import Registry
from farm.manifest import expand, load_manifest, resolve_manifest
from farm.store import SQLiteStore, open_store

pytestmark = pytest.mark.integration

BUCKET = "loader-medium"

#: ``farm ARGS`` through the real entry point; mounts ``warm`` if main.py does not yet
FARM = (
    "import farm.cli.main as cli\n"
    "from farm.cli.warm import warm\n"
    "if not any(c.name == 'warm' for c in cli.app.registered_commands):\n"
    "    cli.app.command('warm')(warm)\n"
    "cli.main()\n"
)


def minio_env(server: Any) -> dict[str, str]:
    return {"FARM_MINIO_ENDPOINT": server.endpoint, "FARM_MINIO_ACCESS_KEY": server.access_key,
            "FARM_MINIO_SECRET_KEY": server.secret_key, "FARM_MINIO_BUCKET": BUCKET}


@pytest.fixture(scope="module")
def medium_in_minio(minio_server: Any, tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, Any]:
    """MinIO holding every medium kernel this device supports; what was put there."""
    settings = Settings(home=tmp_path_factory.mktemp("builder"), workers=2, redis_url=None,
                        device=None, records_url=None, minio_endpoint=minio_server.endpoint,
                        minio_access_key=minio_server.access_key,
                        minio_secret_key=minio_server.secret_key, minio_bucket=BUCKET)
    registry = Registry.load()
    device = select_device(probe_devices())
    entries = expand(load_manifest(resolve_manifest("medium")), registry)
    store = open_store(settings)  # the builder's own SQLite in front of MinIO
    compiler = ProcessPoolCompiler(device, 2)
    try:
        batch = Batch(registry=registry, ctx=DeviceContext(device), store=store,
                      compiler=compiler, label="build medium")
        report = batch.run([e.artifact for e in entries])
    finally:
        compiler.close()
        store.close()
    assert report.failed == [], [r.failure for r in report.failed][:3]
    ns = Namespace.for_fingerprint(device.fingerprint)
    keys = {r.key for r in report.results if r.outcome is not None}
    remote = open_store(settings, shared=True, signed=False)
    assert set(remote.keys(ns)) >= keys
    remote.close()
    return {"ns": ns, "keys": keys, "kernels": len(entries),
            "unsupported": len(report.unsupported)}


def run_warm(home: Path, minio_server: Any, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(minio_env(minio_server), FARM_HOME=str(home), FARM_WORKERS="2",
               PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    proc = subprocess.run([sys.executable, "-c", FARM, "warm", "medium", "--json", *args],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(proc.stdout)["summary"]
    return summary


def test_second_process_warms_medium_from_minio_without_compiling(
        medium_in_minio: dict[str, Any], minio_server: Any, tmp_path: Path) -> None:
    home = tmp_path / "fresh-machine"
    supported = len(medium_in_minio["keys"])
    assert supported == medium_in_minio["kernels"] - medium_in_minio["unsupported"]

    first = run_warm(home, minio_server)
    assert first["compiled"] == 0 and first["rekeyed"] == 0
    assert first["compiler_invocations"] == 0
    assert first["remote"] == supported and first["local"] == 0
    assert first["unsupported"] == medium_in_minio["unsupported"] and first["failed"] == 0

    # the local tier of that machine now holds every artifact
    local = SQLiteStore(Settings(home=home).store_path)
    try:
        assert set(local.keys(medium_in_minio["ns"])) == medium_in_minio["keys"]
        for key in medium_in_minio["keys"]:
            assert local.get(medium_in_minio["ns"], key) is not None
    finally:
        local.close()

    # so the next process loads everything locally, with no network and no compiler
    second = run_warm(home, minio_server, "--on-miss", "fail")
    assert second["local"] == supported and second["remote"] == 0
    assert second["compiled"] == 0 and second["failed"] == 0


def test_on_miss_farm_asks_the_workers_then_loads_from_minio(
        redis_server: Any, minio_server: Any, tmp_path: Path) -> None:
    """A loader with ``on_miss="farm"`` compiles nothing itself: a worker does, stores in
    MinIO, and the loader loads from there (and keeps a local copy)."""
    import numpy as np

    from farm.core.model import LaunchSettings
    from farm.devservices.cluster import local_cluster
    from farm.families.run import check_example, run_example
    from loader import KernelLoader

    with local_cluster(tmp_path / "cluster", redis=redis_server, minio=minio_server,
                       bucket="loader-farm", redis_db=15) as cluster:
        cluster.start_worker(concurrency=1)
        cluster.wait_ready()
        settings = Settings(home=tmp_path / "client", workers=0, device=None,
                            records_url=None, redis_url=cluster.redis_url,
                            minio_endpoint=cluster.minio_endpoint,
                            minio_access_key=cluster.minio_access_key,
                            minio_secret_key=cluster.minio_secret_key,
                            minio_bucket=cluster.bucket)
        params = {"op": "sum", "cols": 77}
        with KernelLoader(settings, on_miss="farm") as loader:
            kernel = loader.kernel("reduce", params)
            family = loader.registry.get("reduce")
            example = family.example(family.validate(params), LaunchSettings(),
                                     np.random.default_rng(3))
            assert check_example(run_example(loader.queue, kernel, example), example) == []
            report = loader.warm([loader.artifact_id("reduce", {"op": "max", "cols": c})
                                  for c in (78, 79)])
            assert report.count("farm") == 2 and report.failed == []
            stats = loader.stats.snapshot()
            assert stats["farm"] == 3 and stats["compiled"] == 0
            ns, tiers = loader.namespace, loader.tiers
            key = loader.key_of(loader.artifact_id("reduce", params))
            assert tiers[0].store.get(ns, key) is not None  # the local copy
