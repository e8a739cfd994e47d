"""``farm tune --cluster``: one key per task on two real Celery workers, against a local
tune of the same manifest.

On two shared cores timings are noisy, so the shapes are chosen for candidates that
differ a lot (a 4x4 tile is several times slower than the others on a CPU), and winners
are compared only for keys whose two best candidates differ by more than the noise both
runs measured: there, a farm that measured honestly must agree with a local tune.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import minio_store, namespace, next_redis_db

from farm.devservices.cluster import local_cluster
from farm.families import Registry
from farm.manifest import expand, load_manifest
from farm.tuning import store as results
from farm.tuning.keys import plan

pytestmark = pytest.mark.integration

TILES = ("tile_m = 4, tile_n = 4, tile_k = 4",
         "tile_m = 16, tile_n = 16, tile_k = 16",
         "tile_m = 64, tile_n = 64, tile_k = 16, wpt_m = 4, wpt_n = 4")
SHAPES = ((128, 128, 128), (96, 160, 64), (64, 256, 96))
FAST = ("--min-launches", "5", "--min-ms", "3", "--budget", "20")


def write_manifest(path: Path) -> Path:
    lines = ["format = 1", 'name = "cluster-tiles"', ""]
    for m, n, k in SHAPES:
        for tiles in TILES:
            lines += ["[[kernels]]", 'family = "matmul"',
                      f"params = {{ m = {m}, n = {n}, k = {k}, {tiles} }}", ""]
    path.write_text("\n".join(lines))
    return path


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], env=env, text=True,
                          capture_output=True, timeout=900, check=False)


def tune_json(env: dict[str, str], out: Path, *args: str) -> dict[str, Any]:
    proc = run(env, "tune", *args, "--json", str(out), *FAST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def clear_gap(key: dict[str, Any]) -> bool:
    """Whether the two fastest right candidates differ by more than their spreads."""
    ok = sorted((c for c in key["candidates"] if c["status"] == "ok"), key=lambda c: c["ms"])
    a, b = ok[0], ok[1]
    return b["ms"] / a["ms"] - 1 > a["spread"] + b["spread"]


def test_the_pool_chooses_what_a_local_tune_chooses(tmp_path: Path,
                                                    redis_server: Any,
                                                    minio_server: Any) -> None:
    manifest = write_manifest(tmp_path / "tiles.toml")
    isolation = str(tmp_path / "isolation")
    with local_cluster(tmp_path / "cluster", redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       FARM_ISOLATION_DIR=isolation) as cluster:
        cluster.start_worker()
        cluster.start_worker()
        cluster.wait_ready()
        env = cluster.env(tmp_path / "client")
        farm = tune_json(env, tmp_path / "farm.json", str(manifest), "--cluster")
        assert (farm["timed"], farm["reused"]) == (len(SHAPES), 0)
        again = tune_json(env, tmp_path / "again.json", str(manifest), "--cluster")
        assert (again["timed"], again["reused"]) == (0, len(SHAPES))
        logs = "".join(w.log.read_text(errors="replace") for w in cluster.workers)
        assert logs.count("measured, winner") == len(SHAPES)
        # every key measured with the pool paused around it, and stored in MinIO
        registry = Registry.load()
        store = minio_store(cluster)
        ns = namespace(farm["fingerprint"])
        for spec in plan([e.artifact for e in expand(load_manifest(manifest), registry)],
                         registry):
            stored = results.read(store, ns, spec)
            assert stored is not None and stored.isolated and stored.worker
    local_env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    local_env.update(FARM_HOME=str(tmp_path / "local"), FARM_ISOLATION_DIR=isolation,
                     PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0")
    local = tune_json(local_env, tmp_path / "local.json", str(manifest), "--local")
    assert local["fingerprint"] == farm["fingerprint"]
    compared = 0
    for mine, theirs in zip(local["keys"], farm["keys"], strict=True):
        assert mine["problem"] == theirs["problem"]
        for key in (mine, theirs):  # the 4x4 tile: never chosen, clearly slowest
            assert key["winner"]["tile_m"] != 4
        if clear_gap(mine) and clear_gap(theirs):
            compared += 1
            assert mine["winner"] == theirs["winner"], (mine, theirs)
    assert compared >= 1
