"""A local cluster runs with the chart's credentials (issue 33 items 2 and 3), for real:
Redis, MinIO, ``farm worker`` and ``farm cluster up`` as separate processes.

* ``farm cluster up``'s ``cluster.env`` holds what a client needs (a build client's
  credentials, the verify key), never the signing key, the root user or the repair
  role; its workers run with their pool's credentials and the signing key, given in
  their own environment: MinIO refuses those credentials another pool's namespace, and
  every delete;
* a client without a verify key still reads and checks what it counts as Loaded: an
  artifact replaced by 4 bytes is rebuilt, not Loaded.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import build_json, farm, namespace, next_redis_db, write_manifest
from minio import Minio
from minio.credentials import StaticProvider
from minio.error import MinioAdminException, S3Error
from minio.minioadmin import MinioAdmin

from farm.core.keys import Namespace, artifact_object
from farm.core.model import Key
from farm.core.settings import Settings
from farm.devservices.cluster import LocalCluster, local_cluster, local_fingerprint
from farm.families import Registry
from farm.manifest import expand, load_manifest
from farm.store.open import open_store

pytestmark = pytest.mark.integration

OTHER = Namespace.for_fingerprint("nvidia-another-pool-0123456789ab")


@pytest.fixture(scope="module")
def cluster(redis_server: Any, minio_server: Any,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    work = tmp_path_factory.mktemp("access-cluster")
    with local_cluster(work, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       FARM_CHUNK_SIZE="2") as c:
        c.set_access(local_fingerprint())
        c.start_worker()
        c.wait_ready()
        yield c


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process was started with (``/proc/<pid>/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def minio_as(endpoint: str, access: str, secret: str) -> Minio:
    return Minio(endpoint, access_key=access, secret_key=secret, secure=False)


def refused(call: Any) -> str:
    """The S3 error code of ``call``, which must fail."""
    with pytest.raises(S3Error) as info:
        call()
    return str(info.value.code)


def _keys(manifest: Path) -> list[Key]:
    registry = Registry.load([])
    return [Key(id_hash=e.artifact.id_hash, build_id=registry.get(e.family).build_id)
            for e in expand(load_manifest(manifest), registry)]


def test_clients_get_no_signing_key_and_workers_their_pools_credentials(
        cluster: LocalCluster, minio_server: Any) -> None:
    access = cluster.access
    assert access is not None
    shared = cluster.shared()
    assert "FARM_SIGNING_KEY" not in shared
    assert not {k for k in shared if k.startswith("FARM_MINIO_REPAIR")}
    assert shared["FARM_MINIO_ACCESS_KEY"] == access.client[0] != minio_server.access_key
    assert shared["FARM_VERIFY_KEY"] == access.verify_key
    worker = environ_of(cluster.workers[0].pid)
    assert worker["FARM_MINIO_ACCESS_KEY"] == access.pool[0]
    assert worker["FARM_SIGNING_KEY"] == access.signing_key
    assert worker["FARM_MINIO_ACCESS_KEY"] != minio_server.access_key
    as_worker = minio_as(cluster.minio_endpoint, worker["FARM_MINIO_ACCESS_KEY"],
                         worker["FARM_MINIO_SECRET_KEY"])
    elsewhere = f"{artifact_object(OTHER, Key(id_hash='0' * 32, build_id='b' * 24))}"
    assert refused(lambda: as_worker.put_object(
        cluster.bucket, elsewhere, io.BytesIO(b"x"), 1)) == "AccessDenied"
    as_client = minio_as(cluster.minio_endpoint, *access.client)
    assert refused(lambda: as_client.put_object(
        cluster.bucket, elsewhere, io.BytesIO(b"x"), 1)) == "AccessDenied"


def test_a_replaced_artifact_is_not_loaded_without_a_verify_key(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 33 item 2: a pool's 4 bytes over a 65 KB artifact were counted Loaded by a
    ``farm build --cluster`` without ``FARM_VERIFY_KEY`` (it trusted the listing)."""
    access = cluster.access
    assert access is not None
    manifest = write_manifest(tmp_path / "m.toml", salt=43, count=3)
    env = cluster.env(tmp_path / "client")
    env.pop("FARM_VERIFY_KEY")
    first = build_json(env, str(manifest))
    assert first["summary"]["compiled"] == 3, first["summary"]
    ns = namespace(first["fingerprint"])
    victim = _keys(manifest)[0]
    pool = minio_as(cluster.minio_endpoint, *access.pool)
    pool.put_object(cluster.bucket, artifact_object(ns, victim), io.BytesIO(b"evil"), 4)
    assert refused(lambda: pool.remove_object(cluster.bucket,
                                              artifact_object(ns, victim))) == "AccessDenied"

    again = build_json(cluster.env(tmp_path / "client-2", FARM_VERIFY_KEY=""), str(manifest))
    assert again["summary"]["loaded"] == 2, again["summary"]
    assert again["summary"]["compiled"] + again["summary"]["rekeyed"] == 1, again["summary"]
    store = open_store(Settings(minio_endpoint=cluster.minio_endpoint,
                                minio_access_key=access.client[0],
                                minio_secret_key=access.client[1],
                                minio_bucket=cluster.bucket), shared=True, signed=False)
    repaired = store.get(ns, victim)
    assert repaired is not None and len(repaired.binary) > 4  # the pool repaired it
    store.close()


def test_cluster_up_writes_a_clients_settings_and_runs_workers_as_their_pool(
        tmp_path: Path) -> None:
    work = tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "farm", "cluster", "up", "--workers", "1",
                             "--workdir", str(work)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith("FARM_")})
    try:
        deadline = time.monotonic() + 240
        while not (work / "cluster.env").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "farm cluster up did not get ready"
            time.sleep(0.5)
        time.sleep(0.5)
        settings = {}
        for line in (work / "cluster.env").read_text().splitlines():
            name, value = line.removeprefix("export ").split("=", 1)
            settings[name] = value.strip("'")
        assert "FARM_SIGNING_KEY" not in settings and "FARM_VERIFY_KEY" in settings
        assert not {n for n in settings if n.startswith("FARM_MINIO_REPAIR")}
        assert (work / "repair.env").stat().st_mode & 0o077 == 0
        endpoint = settings["FARM_MINIO_ENDPOINT"]
        access, secret = settings["FARM_MINIO_ACCESS_KEY"], settings["FARM_MINIO_SECRET_KEY"]
        # not the root user: it may administer nothing
        admin = MinioAdmin(endpoint=endpoint, secure=False,
                           credentials=StaticProvider(access, secret))
        with pytest.raises(MinioAdminException):
            admin.user_list()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
        env.update(settings, FARM_HOME=str(tmp_path / "client"), PYOPENCL_NO_CACHE="1",
                   POCL_KERNEL_CACHE="0")
        served = json.loads(farm(env, "workers", "--json").stdout)
        (fingerprint, entry), = served.items()
        (info,) = entry["workers"]
        worker = environ_of(int(info["pid"]))
        assert worker["FARM_SIGNING_KEY"] and worker["FARM_MINIO_ACCESS_KEY"] != access
        as_worker = minio_as(endpoint, worker["FARM_MINIO_ACCESS_KEY"],
                             worker["FARM_MINIO_SECRET_KEY"])
        name = artifact_object(OTHER, Key(id_hash="1" * 32, build_id="b" * 24))
        assert refused(lambda: as_worker.put_object(
            settings["FARM_MINIO_BUCKET"], name, io.BytesIO(b"x"), 1)) == "AccessDenied"
        # and the cluster builds: the workers sign, the client verifies
        built = build_json(env, str(write_manifest(tmp_path / "m.toml", salt=44, count=2)))
        assert built["summary"]["compiled"] == 2 and built["fingerprint"] == fingerprint
        again = build_json(env, str(tmp_path / "m.toml"))
        assert again["summary"]["loaded"] == 2, again["summary"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
