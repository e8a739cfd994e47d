"""Trust in the cluster (issue 19), for real: Redis, MinIO and a ``farm worker``.

* ``farm build --cluster`` with ``FARM_VERIFY_KEY`` trusts nothing it has not verified:
  a tampered (unsigned) artifact in MinIO is not counted as Loaded, it is rebuilt.
* a worker's metrics tell the truth (item 8): one store miss per compiled kernel, a
  ``kind`` label on failures; its listener binds loopback unless told otherwise, and its
  socket is not inherited by the pool's processes.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import (
    build_json,
    farm,
    minio_store,
    namespace,
    next_redis_db,
    write_manifest,
)

from farm.core.model import Artifact, Key
from farm.devservices.cluster import LocalCluster, local_cluster
from farm.devservices.ports import free_port
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


def test_a_client_verifying_with_another_key_counts_what_it_refused_as_failed(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 33 item 1: the cluster signs with one key, the client verifies with another:
    every kernel was "wrongly signed ... refused" and still counted Loaded (the workers,
    verifying with their own key, answered Loaded), exit 0. Whatever the workers
    answered (Compiled on a first build, Loaded on the next), the client trusts only
    what it verified: failed, with the reason, exit 1; the right key then loads all."""
    manifest = write_manifest(tmp_path / "m.toml", salt=43, count=3)
    other_key = generate_keypair()[1]
    wrong = cluster.env(tmp_path / "wrong", FARM_VERIFY_KEY=other_key)
    for answered in ("Compiled", "Loaded"):  # nothing stored yet; then all stored
        proc = farm(wrong, "build", str(manifest), "--cluster", "--json")
        assert proc.returncode == 1, proc.stderr
        report = json.loads(proc.stdout)
        s = report["summary"]
        assert s["failed"] == 3 and s["loaded"] + s["compiled"] + s["rekeyed"] == 0, s
        for failure in report["failures"]:
            assert failure["kind"] == "untrusted", failure
            assert f"a worker answered {answered}" in failure["message"], failure
            assert "wrongly signed" in failure["message"], failure
        summed = [line for line in proc.stderr.splitlines()
                  if "refused by this client's FARM_VERIFY_KEY" in line]
        assert len(summed) == 1 and summed[0].startswith("3 kernel(s)"), proc.stderr
        assert "Traceback" not in proc.stderr
    right = build_json(cluster.env(tmp_path / "right", FARM_VERIFY_KEY=KEYS[1]),
                       str(manifest))
    assert right["summary"]["loaded"] == 3 and right["summary"]["failed"] == 0, right
    # the refusals changed nothing stored: still the cluster's, signed with its key
    store = minio_store(cluster)
    ns = namespace(right["fingerprint"])
    for key in _keys(manifest):
        held = store.get(ns, key)
        assert held is not None and Verifier(KEYS[1]).verify(held.meta, ns)
    store.close()


def test_a_capture_built_by_a_client_verifying_with_another_key_fails_what_it_refused(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 33 item 1, for an application's programs (``farm build CAPTURE --cluster``):
    a held program counted Loaded unread, and one the workers built was never read back
    either. With another key: failed (``untrusted``), exit 1; with the right key, the
    programs the workers stored are counted Loaded."""
    from test_capture_trust import _capture

    fp = json.loads(farm(cluster.env(), "workers", "--json").stdout)
    [fingerprint] = list(fp)
    sources = [f"__kernel void f(__global int *a) {{ a[0] = {4300 + i}; }}\n"
               for i in range(2)]
    path = _capture(tmp_path / "c.json", fingerprint, sources)
    wrong = cluster.env(tmp_path / "wrong", FARM_VERIFY_KEY=generate_keypair()[1])
    for answered in ("Compiled", "Loaded"):
        proc = farm(wrong, "build", str(path), "--cluster", "--json")
        assert proc.returncode == 1, proc.stderr
        [built] = json.loads(proc.stdout)["builds"]
        s = built["summary"]
        assert s["failed"] == 2 and s["loaded"] + s["compiled"] == 0, (answered, s)
        assert {f["kind"] for f in built["failures"]} == {"untrusted"}, built
        if answered == "Compiled":
            assert all("a worker answered Compiled" in f["message"]
                       for f in built["failures"]), built
    right = farm(cluster.env(tmp_path / "right", FARM_VERIFY_KEY=KEYS[1]), "build",
                 str(path), "--cluster", "--json")
    assert right.returncode == 0, right.stderr
    [built] = json.loads(right.stdout)["builds"]
    assert built["summary"]["loaded"] == 2 and built["summary"]["failed"] == 0, built


BROKEN_FAMILY = '''
"""A family whose source no compiler takes (the metrics test's compile failure)."""
from farm.families.base import KernelFamily, Params
from farm.core.model import Lowered


class BrokenParams(Params):
    n: int = 1


class Broken(KernelFamily[BrokenParams]):
    name = "broken_metrics"
    params_model = BrokenParams

    def lower(self, params, launch, device):
        return Lowered(source="__kernel void broken(__global float *x) { x[0] = ; }",
                       kernel_names=("broken",))


FAMILIES = [Broken]
'''


def _listener(port: int) -> tuple[str, str]:
    """(local address in /proc/net/tcp's hex, socket inode) of the LISTEN socket on port."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if int(hex_port, 16) == port and fields[3] == "0A":
            return address, fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _holds(pid: int, inode: str) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if fd.readlink().as_posix() == f"socket:[{inode}]":
                return True
        except OSError:
            continue
    return False


def _samples(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {labels: float(value) for labels, value in
            re.findall(rf"^{name}{{(.*?)}} ([0-9.e+-]+)$", text, re.MULTILINE)}


def test_worker_metrics_tell_the_truth(redis_server: Any, minio_server: Any,
                                       tmp_path: Path) -> None:
    """Issue 19 item 8: each compiled kernel counted two store misses; failures had no
    kind; the listener bound every address and its socket was inherited by the pool."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "brokenfam.py").write_text(BROKEN_FAMILY)
    port = free_port()
    with local_cluster(tmp_path, redis=redis_server, minio=minio_server,
                       bucket=f"t-{uuid.uuid4().hex[:12]}", redis_db=next_redis_db(),
                       PYTHONPATH=str(code), FARM_FAMILY_MODULES='["brokenfam"]') as c:
        worker = c.start_worker(concurrency=2, FARM_METRICS_PORT=str(port))
        c.wait_ready()
        address, inode = _listener(port)
        assert address == "0100007F", "the metrics listener binds loopback by default"
        pool = _children(worker.pid)
        assert len(pool) >= 2
        assert [pid for pid in pool if _holds(pid, inode)] == []
        assert _holds(worker.pid, inode)

        manifest = write_manifest(tmp_path / "m.toml", salt=47, count=3)
        with manifest.open("a") as fh:
            fh.write('[[kernels]]\nfamily = "broken_metrics"\n')
        built = build_json(c.env(tmp_path / "client"), str(manifest))
        assert built["summary"]["compiled"] == 3 and built["summary"]["failed"] == 1
        requests = _samples(port, "farm_store_requests_total")
        misses = sum(v for k, v in requests.items() if 'result="miss"' in k)
        assert misses == 4, requests  # one per kernel asked for, none twice
        kernels = _samples(port, "farm_kernels_total")
        failed = {k: v for k, v in kernels.items() if 'outcome="failed"' in k}
        assert list(failed.values()) == [1.0] and 'kind="compile"' in next(iter(failed)), kernels
