"""Issue 9, hostile input: one regression test per numbered finding, each failing before
its fix. The property tests of every surface are in ``tests/test_properties.py``.

1. a bundle whose metadata lies about its source hash cannot repoint another kernel's
   source-index entry (unit and end to end through ``farm build``);
2. a family whose OpenCL C lives in a ``.cl`` data file gets a new build id when that
   file changes, so the rebuild compiles instead of serving the old binary;
3. poison records stream entries never stop the ingester, and an old session entry with
   ``keep_sessions=0`` does not delete newer sessions;
4. Infinity and NaN are refused where they enter (records, bundles, payloads);
5. memory bounds: a huge manifest vocab, sparse tar members;
6. one line and an exit status, never a traceback (plugins, damaged stores, settings);
7. settings that used to be accepted and then did the wrong thing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from farm.core.keys import Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.store import MemoryStore, SQLiteStore
from farm.store.bundle import export_bundle, import_bundle

FARM = Path(sys.executable).with_name("farm")
NS = Namespace.for_fingerprint("pocl-test-device-0123456789ab")


def farm_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env.update(FARM_HOME=str(home), PYOPENCL_NO_CACHE="1", POCL_KERNEL_CACHE="0",
               CUDA_CACHE_DISABLE="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def farm(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FARM), *args], env=farm_env(home, **env), capture_output=True,
                          text=True, timeout=300, check=False)


def build(home: Path, manifest: Path, **env: str) -> dict[str, Any]:
    proc = farm(home, "build", str(manifest), "--workers", "0", "--json", **env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def outcomes(report: dict[str, Any]) -> tuple[int, int, int, int]:
    s = report["summary"]
    return s["loaded"], s["rekeyed"], s["compiled"], s["failed"]


def one_line_refusal(proc: subprocess.CompletedProcess[str], *words: str) -> str:
    """A refusal as the standards want it: non-zero, no traceback, one line naming it."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# -- 1. the source index is never taken from imported metadata ------------------------------
def lowered(text: str) -> Lowered:
    return Lowered(source=text, kernel_names=("k",))


@pytest.mark.parametrize("make", [lambda p: SQLiteStore(p / "s.sqlite"), lambda p: MemoryStore()])
def test_a_lying_bundle_cannot_repoint_the_source_index(tmp_path: Path, make: Any) -> None:
    store = make(tmp_path)
    k_low = lowered("__kernel void k(__global float *x) { x[0] = 2.0f; }")
    k = Key(id_hash="a" * 32, build_id="1" * 24)
    store.put(NS, Artifact.create(k, "scale", b"K's binary", k_low.source_hash),
              source=k_low)
    # a bundle of one new key X whose metadata claims K's source hash
    x = Key(id_hash="b" * 32, build_id="1" * 24)
    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    scratch.put(NS, Artifact.create(x, "evil", b"X's binary", k_low.source_hash))
    export_bundle(scratch, None, tmp_path / "x.bundle")
    report = import_bundle(tmp_path / "x.bundle", store)
    assert report.imported == 1
    assert store.find_source(NS, k_low.source_hash) == k
    store.delete(NS, k)  # K's key goes (an upgrade, gc): the index must not name X
    assert store.find_source(NS, k_low.source_hash) is None


MANIFEST_ONE = 'format = 1\nname = "one"\n\n[[kernels]]\nfamily = "elementwise_unary"\n' \
               'params = { op = "relu" }\n'


def test_a_lying_bundle_never_makes_farm_build_serve_its_binary(tmp_path: Path) -> None:
    home = tmp_path / "home"
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    assert outcomes(build(home, manifest)) == (0, 0, 1, 0)
    path = home / "envs" / "default" / "store.sqlite"
    conn = sqlite3.connect(path)
    (ns_text, id_hash, build_id, meta_text), = conn.execute(
        "SELECT namespace, id_hash, build_id, meta FROM artifacts").fetchall()
    conn.close()
    ns = Namespace.parse(ns_text)
    k_meta = json.loads(meta_text)

    x = Key(id_hash="c" * 32, build_id=build_id)
    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    scratch.put(ns, Artifact.create(x, "elementwise_unary", b"not a program",
                                    k_meta["source_hash"]))
    scratch.close()
    export_bundle(SQLiteStore(tmp_path / "scratch.sqlite"), None, tmp_path / "x.bundle")
    # not validated at import (a device here would refuse "not a program" outright,
    # issue 19): the index rule alone must keep it from being served as K
    proc = farm(home, "bundle", "import", "--no-validate", str(tmp_path / "x.bundle"))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    store = SQLiteStore(path)
    store.delete(ns, Key(id_hash=id_hash, build_id=build_id))  # K's key goes
    store.close()
    again = build(home, manifest)
    assert outcomes(again) == (0, 0, 1, 0)  # compiled from its source, not "Rekeyed"
    store = SQLiteStore(path)
    got = store.get(ns, Key(id_hash=id_hash, build_id=build_id))
    assert got is not None and got.binary != b"not a program"
    store.close()


# -- 2. the build id covers data files --------------------------------------------------------
FAMILY_READING_A_CL_FILE = '''\
"""A family that keeps its OpenCL C in a data file next to it."""

from __future__ import annotations

from importlib import resources

import numpy as np

from farm.core.device import DeviceInfo
from farm.families.base import Example, KernelFamily, Params
from farm.core.model import LaunchSettings, Lowered


class ScaleParams(Params):
    n: int = 16


class ClScale(KernelFamily[ScaleParams]):
    name = "cl_scale"
    params_model = ScaleParams

    def lower(self, params: ScaleParams, launch: LaunchSettings,
              device: DeviceInfo) -> Lowered:
        source = resources.files("clkernels").joinpath("scale.cl").read_text()
        return Lowered(source=source, kernel_names=("cl_scale",))

    def example(self, params: ScaleParams, launch: LaunchSettings,
                rng: np.random.Generator) -> Example:
        raise NotImplementedError


FAMILIES = [ClScale]
'''

CL_SOURCE = """\
__kernel void cl_scale(__global float *x, const uint n)
{
    const size_t i = get_global_id(0);
    if (i < n) x[i] = x[i] * FACTOR;
}
"""


def test_a_changed_cl_data_file_gives_a_new_build_id_and_a_compile(tmp_path: Path) -> None:
    pkgs, home = tmp_path / "pkgs", tmp_path / "home"
    pkg = pkgs / "clkernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Kernels kept in .cl files."""\n')
    (pkg / "family.py").write_text(FAMILY_READING_A_CL_FILE)
    (pkg / "scale.cl").write_text(CL_SOURCE.replace("FACTOR", "2.0f"))
    manifest = tmp_path / "cl.toml"
    manifest.write_text('format = 1\nname = "cl"\n\n[[kernels]]\nfamily = "cl_scale"\n')
    env = {"FARM_FAMILY_MODULES": json.dumps(["clkernels.family"]), "PYTHONPATH": str(pkgs)}

    assert outcomes(build(home, manifest, **env)) == (0, 0, 1, 0)
    assert outcomes(build(home, manifest, **env)) == (1, 0, 0, 0)
    (pkg / "scale.cl").write_text(CL_SOURCE.replace("FACTOR", "3.0f"))  # same size
    assert outcomes(build(home, manifest, **env)) == (0, 0, 1, 0)  # not "Loaded"
    conn = sqlite3.connect(home / "envs" / "default" / "store.sqlite")
    build_ids = {r[0] for r in conn.execute("SELECT build_id FROM artifacts")}
    conn.close()
    assert len(build_ids) == 2
    # a file the family never reads changes the id too (the package is the unit)
    (pkg / "notes.txt").write_text("anything")
    assert outcomes(build(home, manifest, **env)) == (0, 1, 0, 0)


def test_the_build_id_skips_byte_code_caches(tmp_path: Path) -> None:
    from farm.families.buildid import _root_digest

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    before = _root_digest(str(pkg))
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    _root_digest.cache_clear()
    assert _root_digest(str(pkg)) == before
    (pkg / "data.cl").write_text("x")
    _root_digest.cache_clear()
    assert _root_digest(str(pkg)) != before



# -- 3. poison records entries never stop the ingester ----------------------------------------
def _poison_entries(good: dict[str, str]) -> list[dict[Any, Any]]:
    record = json.loads(good["record"])

    def with_record(**stamp: Any) -> dict[str, str]:
        return {**good, "record": json.dumps({**record, "stamp": {**record["stamp"], **stamp}})}

    return [
        {**good, "record": b"\xff\xfe not utf-8"},           # non-UTF-8 bytes in a field
        {b"v\xff": b"1", **good},                           # ... in a field name
        {**good, "v": "²"},                                  # a digit that int() refuses
        {**good, "v": "9" * 5000},                           # int() refuses 5000 digits
        with_record(seq=2**63),                              # SQLite OverflowError before
        with_record(session=2**70),
        {**good, "record": json.dumps({**record, "requested_by": {"session": 2**70,
                                                                  "batch": 1}})},
        {**good, "kind": "records/v9/compilation"},          # unknown kind: was pending
        {**good, "record": json.dumps({**record, "work_s": "Infinity"})},
    ]


@pytest.mark.integration
def test_poison_entries_never_stop_farm_ingest(client: Any, redis_url: str,
                                               tmp_path: Path) -> None:
    from test_records_stream import drain, pending_total, service_env

    from farm.core.keys import RECORDS_DEAD_STREAM, records_stream_for
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, SessionStorage, Stamp
    from farm.records.stream import encode_record

    stream = records_stream_for(CompilationRecord.KIND)
    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    record = CompilationRecord(stamp=Stamp(session=1, seq=1, offset_s=0.1), family="axpy",
                               key="0" * 32 + "." + "1" * 24, outcome=Outcome.COMPILED,
                               work_s=0.01)
    good = encode_record(record)
    poison = _poison_entries(good)
    for fields in poison:
        client.xadd(stream, fields)
    client.xadd(stream, good)
    env = service_env(redis_url, url, tmp_path)
    counts = drain(env, tmp_path / "ingest.log")
    assert counts["records"] == 1
    assert counts["dead"] + counts["deferred"] == len(poison)
    assert pending_total(client) == 0
    assert client.xlen(RECORDS_DEAD_STREAM) == len(poison)
    with SessionStorage(url) as storage:
        assert storage.records(1) == [record]
    # and a restart finds nothing left to choke on
    assert drain(env, tmp_path / "again.log")["records"] == 0


@pytest.mark.integration
def test_an_old_session_entry_with_keep_zero_spares_newer_sessions(
        client: Any, redis_url: str, tmp_path: Path) -> None:
    from test_records_stream import drain, service_env

    from farm.records import SessionStorage
    from farm.records.model import Session
    from farm.records.stream import encode_session

    url = f"sqlite:///{tmp_path / 'records.sqlite'}"
    newer = Session.start("newer")
    older = newer.model_copy(update={"id": newer.id - 10**9, "label": "older"})
    client.xadd("farm:records:sessions", encode_session(newer, None))
    client.xadd("farm:records:sessions", encode_session(older, 0))  # same batch, last
    drain(service_env(redis_url, url, tmp_path), tmp_path / "ingest.log")
    with SessionStorage(url) as storage:
        assert {s.id for s in storage.sessions()} == {newer.id, older.id}


@pytest.mark.integration
def test_an_entry_the_storage_cannot_hold_is_set_aside_not_retried_for_ever(
        client: Any) -> None:
    """Defence in depth behind the models: a value that validates but that the storage
    refuses for its data sets that entry aside; the rest of the batch is written."""
    from farm.core.keys import RECORDS_DEAD_STREAM, records_stream_for
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, SessionStorage, Stamp
    from farm.records.ingest import Ingester, Pacing
    from farm.records.stream import encode_record

    class Picky(SessionStorage):
        def write_batch(self, sessions: Any, records: Any) -> int:
            if any(r.family == "unstorable" for r in records):
                raise OverflowError("Python int too large to convert to SQLite INTEGER")
            return super().write_batch(sessions, records)

    stream = records_stream_for(CompilationRecord.KIND)
    good = [CompilationRecord(stamp=Stamp(session=1, seq=i, offset_s=0.0), family="axpy",
                              key="k", outcome=Outcome.COMPILED, work_s=0.0)
            for i in (1, 3)]
    bad = good[0].model_copy(update={"family": "unstorable",
                                     "stamp": Stamp(session=1, seq=2, offset_s=0.0)})
    for record in (good[0], bad, good[1]):
        client.xadd(stream, encode_record(record))
    storage = Picky("sqlite://")
    ingester = Ingester(client, storage, pacing=Pacing(block_ms=10, claim_idle_ms=0))
    stats = ingester.run(drain=True)
    assert storage.records(1) == good
    assert stats.dead == 1 and client.xlen(RECORDS_DEAD_STREAM) == 1
    (entry,) = client.xrange(RECORDS_DEAD_STREAM)
    assert b"cannot hold it" in entry[1][b"dead:error"]
    storage.close()


@pytest.mark.integration
def test_a_record_of_a_pack_the_storage_cannot_hold_is_set_aside_alone(client: Any) -> None:
    """The same defence for packs: the pack is not set aside whole, only the record the
    storage refuses, as a one-record entry; the pack's other records are written."""
    from farm.core.keys import RECORDS_DEAD_STREAM
    from farm.core.outcomes import Outcome
    from farm.records import CompilationRecord, SessionStorage, Stamp
    from farm.records.ingest import Ingester, Pacing
    from farm.records.stream import RedisStreamSink, decode_record

    class Picky(SessionStorage):
        def write_batch(self, sessions: Any, records: Any) -> int:
            if any(r.family == "unstorable" for r in records):
                raise OverflowError("Python int too large to convert to SQLite INTEGER")
            return super().write_batch(sessions, records)

    records = [CompilationRecord(stamp=Stamp(session=1, seq=i, offset_s=0.0),
                                 family="unstorable" if i == 2 else "axpy", key="k",
                                 outcome=Outcome.COMPILED, work_s=0.0) for i in (1, 2, 3)]
    RedisStreamSink(client).write_records(records)  # one pack of three
    storage = Picky("sqlite://")
    stats = Ingester(client, storage, pacing=Pacing(block_ms=10, claim_idle_ms=0)).run(drain=True)
    assert storage.records(1) == [records[0], records[2]]
    assert (stats.records, stats.dead) == (2, 1)
    (entry,) = client.xrange(RECORDS_DEAD_STREAM)
    fields = entry[1]
    assert b"cannot hold it" in fields[b"dead:error"] and fields[b"dead:index"] == b"1"
    resend = {k: v for k, v in fields.items() if not k.startswith(b"dead:")}
    assert decode_record(resend) == records[1]  # can be sent again by itself
    storage.close()


def test_a_worker_refuses_a_payload_whose_integers_no_storage_holds() -> None:
    from pydantic import ValidationError

    from farm.cluster.payloads import CompileRequest

    raw = {"fingerprint": NS.fingerprint, "requested_by": {"session": 2**70, "batch": 1},
           "kernels": [{"artifact": {"kernel": {"family": "elementwise_unary",
                                                "params": {"op": "relu"}}},
                        "build_id": "1" * 24}]}
    with pytest.raises(ValidationError):
        CompileRequest.model_validate(raw)
    raw["requested_by"] = {"session": 1, "batch": 1}
    assert CompileRequest.model_validate(raw).requested_by is not None


# -- 4. Infinity and NaN ---------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_floats_are_refused_where_they_enter(bad: float) -> None:
    from pydantic import ValidationError

    from farm.core.model import ArtifactMeta, KernelId
    from farm.records import CompilationRecord, Stamp

    with pytest.raises(ValidationError):
        CompilationRecord(stamp=Stamp(session=1, seq=1, offset_s=0.0), family="f",
                          key="k", outcome="Compiled", work_s=bad)
    with pytest.raises(ValidationError):
        Stamp(session=1, seq=1, offset_s=bad)
    with pytest.raises(ValidationError):
        ArtifactMeta(key=Key(id_hash="a" * 32, build_id="1" * 24), family="f",
                     digest="0" * 64, size=0, source_hash="0" * 64, work_s=bad)
    with pytest.raises(ValidationError):
        KernelId(family="f", params={"eps": bad})


def test_a_bundle_with_infinity_in_its_metadata_is_refused_and_nothing_stored(
        tmp_path: Path) -> None:
    from farm.core.errors import BundleError
    from farm.store.bundle import MANIFEST_MEMBER

    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    scratch.put(NS, Artifact.create(Key(id_hash="a" * 32, build_id="1" * 24), "f", b"bin",
                                    "0" * 64, work_s=0.5))
    export_bundle(scratch, None, tmp_path / "good.bundle")
    import tarfile

    with tarfile.open(tmp_path / "good.bundle") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    manifest = json.loads(members[0][1])
    manifest["artifacts"][0]["meta"]["work_s"] = float("inf")
    raw = json.dumps(manifest).encode()  # writes Infinity, as a hostile writer would
    assert b"Infinity" in raw
    out = tmp_path / "inf.bundle"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_MEMBER)
        info.size = len(raw)
        import io

        tar.addfile(info, io.BytesIO(raw))
        for member, data in members[1:]:
            tar.addfile(member, io.BytesIO(data))
    target = SQLiteStore(tmp_path / "target.sqlite")
    with pytest.raises(BundleError) as caught:
        import_bundle(out, target)
    assert "work_s" in str(caught.value) and "\n" not in str(caught.value)
    assert list(target.keys(NS)) == []


# -- 5. memory bounds -----------------------------------------------------------------------
def test_a_huge_vocab_is_refused_before_anything_is_planned(tmp_path: Path) -> None:
    import resource

    from farm.core.errors import ManifestError
    from farm.families import Registry
    from farm.manifest import expand, load_manifest

    path = tmp_path / "huge.toml"
    path.write_text(textwrap.dedent(f"""\
        format = 1
        [model]
        name = "huge"
        hidden = 64
        heads = 4
        head_dim = 16
        intermediate = 128
        vocab = {2**50}
        tokens = [1]
        """))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ManifestError) as caught:
        expand(load_manifest(path), Registry.load())
    message = str(caught.value)
    assert f"{path}:8: model.vocab" in message and "\n" not in message
    # planning 2**34 matmul parts took gigabytes; a refusal takes next to nothing
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000


def _sparse_bundle(tmp_path: Path) -> Path:
    """A GNU sparse member: a few stored bytes that expand to 200 MB when read."""
    import io
    import tarfile

    from farm.store.bundle import MANIFEST_MEMBER

    k = Key(id_hash="a" * 32, build_id="1" * 24)
    size = 200 * 1024 * 1024
    meta = Artifact.create(k, "f", b"", "0" * 64).meta.model_copy(
        update={"size": size, "digest": "0" * 64})
    member = f"{NS}/artifacts/{k.id_hash}/{k.build_id}"
    manifest = {"format": "kernel-farm-bundle", "version": 1, "farm_version": "0",
                "created_at": "2026-01-01T00:00:00Z",
                "namespaces": [{"namespace": str(NS), "fingerprint": NS.fingerprint,
                                "artifacts": 1, "bytes": size}],
                "artifacts": [{"namespace": str(NS), "key": k.model_dump(), "member": member,
                               "size": size, "digest": "0" * 64,
                               "meta": json.loads(meta.model_dump_json())}],
                "total_bytes": size}
    raw = json.dumps(manifest).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_MEMBER)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
    head = buf.getvalue()[:-2 * tarfile.BLOCKSIZE].rstrip(b"\0")
    head += b"\0" * (-len(head) % tarfile.BLOCKSIZE)
    info = tarfile.TarInfo(member)
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = 512  # stored bytes
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    # GNU sparse header: one map entry (offset 0, 512 bytes), real size in `realsize`
    header[386:398] = b"%011o\0" % 0
    header[398:410] = b"%011o\0" % 512
    header[483:495] = b"%011o\0" % size
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header[:512])
    out = tmp_path / "sparse.bundle"
    out.write_bytes(head + bytes(header[:512]) + b"\0" * 512 + b"\0" * 1024)
    return out


def test_sparse_members_are_refused_without_expanding_them(tmp_path: Path) -> None:
    from farm.core.errors import BundleError

    path = _sparse_bundle(tmp_path)
    assert path.stat().st_size < 8192
    target = SQLiteStore(tmp_path / "target.sqlite")
    with pytest.raises(BundleError) as caught:
        import_bundle(path, target)
    message = str(caught.value)
    # refused for what it declares, before reading (it was a digest mismatch found
    # after expanding 200 MB of zeros)
    assert "what the file holds" in message and "\n" not in message, message
    assert list(target.keys(NS)) == []
    proc = farm(tmp_path / "home", "bundle", "show", str(path))
    one_line_refusal(proc, "sparse.bundle")


def test_a_sparse_member_header_is_refused_whatever_it_declares(tmp_path: Path) -> None:
    import tarfile

    from farm.core.errors import BundleError
    from farm.store.bundle_read import check_member as _check_member

    for kind in (tarfile.GNUTYPE_SPARSE,):
        info = tarfile.TarInfo("opencl/v1/x/artifacts/a/b")
        info.type = kind
        info.size = 10
        with pytest.raises(BundleError, match="sparse"):
            _check_member(tmp_path / "b", info, 1000)
    pax_sparse = tarfile.TarInfo("opencl/v1/x/artifacts/a/b")
    pax_sparse.sparse = [(0, 10)]  # what tarfile sets for PAX sparse formats
    with pytest.raises(BundleError, match="sparse"):
        _check_member(tmp_path / "b", pax_sparse, 1000)


# -- 6. one line and an exit status, never a traceback ------------------------------------------
def _broken_plugin(tmp_path: Path, target: str) -> dict[str, str]:
    """A distribution whose family entry point names ``target`` (PYTHONPATH env)."""
    pkg = tmp_path / "brokenplugin"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""\
        from farm.families.base import KernelFamily


        def a_function():
            return 1


        class Nameless(KernelFamily):  # no `name`
            pass


        class Raises(KernelFamily):
            name = "raises"

            def __init__(self):
                raise RuntimeError("a plugin that cannot be made")
        """))
    dist = tmp_path / "brokenplugin-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[kernel_farm.families]\nbroken = {target}\n")
    return {"PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("target", ["no_such_module:X", "brokenplugin:missing",
                                    "brokenplugin", "brokenplugin:a_function",
                                    "brokenplugin:Nameless", "brokenplugin:Raises"])
def test_a_broken_plugin_is_one_warning_and_other_manifests_still_build(
        tmp_path: Path, target: str) -> None:
    env = _broken_plugin(tmp_path, target)
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    proc = farm(tmp_path / "home", "build", str(manifest), "--workers", "0", "--json", **env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "broken" in line]
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr
    # asking for a family that is not there says which plugin failed
    other = tmp_path / "other.toml"
    other.write_text('format = 1\n\n[[kernels]]\nfamily = "from_the_plugin"\n')
    proc = farm(tmp_path / "home", "build", str(other), "--workers", "0", **env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "from_the_plugin" in proc.stderr and "'broken'" in proc.stderr


RAISING_FAMILY = '''\
import numpy as np
from farm.families.base import KernelFamily, Params
from farm.core.model import Lowered


class P(Params):
    pass


class Raises(KernelFamily[P]):
    name = "user_raises"
    params_model = P

    def lower(self, params, launch, device):
        return {}["a key a buggy plugin forgot"]

    def example(self, params, launch, rng):
        raise NotImplementedError


FAMILIES = [Raises]
'''


def test_an_exception_in_a_plugins_lower_fails_that_kernel_only(tmp_path: Path) -> None:
    (tmp_path / "raising.py").write_text(RAISING_FAMILY)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST_ONE + '\n[[kernels]]\nfamily = "user_raises"\n')
    proc = farm(tmp_path / "home", "build", str(manifest), "--workers", "0", "--json",
                FARM_FAMILY_MODULES='["raising"]', PYTHONPATH=str(tmp_path))
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a failed kernel
    report = json.loads(proc.stdout)
    assert outcomes(report) == (0, 0, 1, 1)
    assert "KeyError" in proc.stdout


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    if how == "zeroed page":
        data[page * 2:page * 4] = bytes(page * 2)
    elif how == "truncated":
        data = data[:-1]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["zeroed page", "rollback-journal file, zeroed page",
                                 "truncated", "bad row"])
def test_a_damaged_store_is_one_line_and_never_rewritten_first(tmp_path: Path,
                                                                how: str) -> None:
    home = tmp_path / "home"
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    build(home, manifest)
    path = home / "envs" / "default" / "store.sqlite"
    if how.startswith("rollback"):
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.close()
        _damage(path, "zeroed page")
    elif how == "bad row":
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO artifacts VALUES ('x', 'NOT HEX', 'b', 'd', 1, '{', x'00')")
        conn.execute("UPDATE artifacts SET meta = '{' WHERE namespace != 'x'")
        conn.commit()
        conn.close()
    else:
        _damage(path, how)
    before = path.read_bytes()
    proc = farm(home, "build", str(manifest), "--workers", "0", "--json")
    assert "Traceback" not in proc.stderr, proc.stderr
    if how == "truncated":  # still readable: loaded, or a miss that a compile repairs
        assert proc.returncode == 0, proc.stderr
        assert outcomes(json.loads(proc.stdout))[3] == 0
    elif how == "bad row":  # the unreadable row is a miss; the foreign one is skipped
        assert proc.returncode == 0, proc.stderr
        assert outcomes(json.loads(proc.stdout)) == (0, 0, 1, 0)
    else:
        one_line_refusal(proc, str(path))
        assert path.read_bytes() == before  # refused before anything was written


BAD_SETTINGS = {
    "FARM_ENVIRONMENT": [".."],                     # 7: wrote into FARM_HOME itself
    "FARM_HOME": ["", "/dev/null"],                 # 7: "" meant the current folder
    "FARM_LEASE_TTL": ["inf", "1e-9", "nan"],       # 7: every lease then failed
    "FARM_WORKERS": ["100000000"],                  # 7: no upper bound
    "FARM_REDIS_URL": ["redis://h:port/0", "::::"],
    "FARM_RECORDS_URL": ["postgresql://u@h:port/db"],
    "FARM_FAMILY_MODULES": ['[""]', '["a b"]'],
    "FARM_MINIO_ENDPOINT": ["http://user:s3cret@host:9000"],
}


@pytest.mark.parametrize("name,value", [(n, v) for n, vs in BAD_SETTINGS.items() for v in vs])
def test_bad_settings_are_one_line_naming_the_variable(tmp_path: Path, name: str,
                                                       value: str) -> None:
    proc = farm(tmp_path / "home", "records", "sessions", **{name: value})
    line = one_line_refusal(proc, name)
    assert proc.returncode == 2
    assert "s3cret" not in line  # a credential is never echoed


def test_an_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    """An unreachable Redis is an outage: waited out (one progress line says so, see
    docs/RELIABILITY.md), then one error line and exit 1."""
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    proc = farm(tmp_path / "home", "build", str(manifest),
                FARM_REDIS_URL="redis://127.0.0.1:1/0", FARM_OUTAGE_LIMIT="1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Redis" in errors[0], proc.stderr
    assert all(line.startswith("waiting for Redis") for line in lines if line not in errors)


def test_a_home_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    proc = farm(tmp_path / "file" / "home", "build", str(manifest), "--workers", "0")
    one_line_refusal(proc, "home")


def test_records_sessions_never_migrates_what_it_only_reads(tmp_path: Path) -> None:
    path = tmp_path / "home" / "envs" / "default" / "records.sqlite"
    path.parent.mkdir(parents=True)
    sqlite3.connect(path).close()  # an empty SQLite file: schema version 0
    before = path.read_bytes()
    proc = farm(tmp_path / "home", "records", "sessions")
    one_line_refusal(proc, "schema version 0")
    assert path.read_bytes() == before


@pytest.mark.parametrize("command", [["bundle", "export", "--all", "--force"], ["keygen"]])
def test_unusable_output_paths_are_one_line(tmp_path: Path, command: list[str]) -> None:
    home = tmp_path / "home"
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    build(home, manifest)
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file" / "x", Path("/proc/version/x"), tmp_path):
        proc = farm(home, *command, str(out))
        one_line_refusal(proc)


# -- 7. accepted but wrong ---------------------------------------------------------------------
@pytest.mark.parametrize("text", ["pocl-abc\n", "pocl-abc\r", "\npocl-abc", "pocl abc"])
def test_a_namespace_with_a_trailing_newline_is_not_valid(text: str) -> None:
    with pytest.raises(ValueError, match="not a device fingerprint"):
        Namespace.for_fingerprint(text)
    with pytest.raises(ValueError):
        Namespace.parse(f"opencl/v1/{text}")


def _bundle_with_source_hash(tmp_path: Path, source_hash: str) -> Path:
    import io
    import tarfile

    from farm.store.bundle import MANIFEST_MEMBER

    scratch = SQLiteStore(tmp_path / "scratch.sqlite")
    for i in range(3):
        scratch.put(NS, Artifact.create(Key(id_hash=f"{i:032x}", build_id="1" * 24), "f",
                                        bytes([i]) * 8, "0" * 64))
    export_bundle(scratch, None, tmp_path / "ok.bundle")
    with tarfile.open(tmp_path / "ok.bundle") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    manifest = json.loads(members[0][1])
    manifest["artifacts"][2]["meta"]["source_hash"] = source_hash  # the last one only
    raw = json.dumps(manifest).encode()
    out = tmp_path / "bad.bundle"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(MANIFEST_MEMBER)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        for member, data in members[1:]:
            tar.addfile(member, io.BytesIO(data))
    return out


@pytest.mark.integration
@pytest.mark.parametrize("source_hash", ["a" * 2000, "../../../x", "A" * 64, "0" * 64 + "\n"])
def test_a_bundle_with_a_bad_source_hash_writes_nothing_to_minio(
        tmp_path: Path, minio_server: Any, source_hash: str) -> None:
    import uuid

    from farm.core.errors import BundleError
    from farm.store.minio import MinioStore

    bucket = f"hostile-{uuid.uuid4().hex[:12]}"
    store = MinioStore(minio_server.endpoint, minio_server.access_key,
                       minio_server.secret_key, bucket, secure=minio_server.secure)
    path = _bundle_with_source_hash(tmp_path, source_hash)
    with pytest.raises(BundleError) as caught:
        import_bundle(path, store)
    assert "source_hash" in str(caught.value) and "\n" not in str(caught.value)
    assert store.namespaces() == [] and list(store.keys(NS)) == []
    store.close()


def test_env_file_values_are_quoted_so_sourcing_runs_nothing(tmp_path: Path) -> None:
    from farm.devservices import export_lines

    marker = tmp_path / "ran"
    hostile = f"redis://h:1/0$(touch {marker})`touch {marker}`'\"; touch {marker}"
    env_file = tmp_path / "cluster.env"
    env_file.write_text("\n".join(export_lines({"FARM_REDIS_URL": hostile})) + "\n")
    proc = subprocess.run(["bash", "-c", f'source {env_file} && printf %s "$FARM_REDIS_URL"'],
                          capture_output=True, text=True, check=True)
    assert proc.stdout == hostile
    assert not marker.exists()
    with pytest.raises(ValueError):
        export_lines({"FARM_X; touch y": "v"})


def test_a_bad_task_payload_is_one_line_that_survives_celerys_json() -> None:
    from farm.cluster.payloads import PayloadError, parse_request
    from farm.programs.request import ChunkRequest

    with pytest.raises(PayloadError) as caught:
        parse_request({"fingerprint": "pocl-x", "kernels": [{"artifact": {"kernel": {
            "family": "f", "params": {}}}, "build_id": "not hex"}]}, ChunkRequest)
    exc = caught.value
    # Celery's JSON sends type, module and args: the args carry the whole message
    rebuilt = type(exc)(*json.loads(json.dumps(list(exc.args))))
    assert "kernels.0.build_id" in str(rebuilt) and "\n" not in str(rebuilt)


def test_session_values_that_validate_always_fit_the_storage_columns() -> None:
    """PostgreSQL keeps pid in a 32-bit column and os/arch/farm_version in 64
    characters; a start time must convert to UTC. Each once validated and then failed
    every write of its batch (found by tests/test_properties.py)."""
    from pydantic import ValidationError

    from farm.records.model import Session

    base = {"id": 5, "started_at": "2026-01-01T00:00:00Z"}
    for bad in ({"pid": 2**40}, {"os": "x" * 65}, {"farm_version": "9" * 65},
                {"host": "a\x00b"}, {"started_at": "9999-12-31T23:59:59-23:59"},
                {"started_at": "0001-01-01T00:00:00+23:59"}):
        with pytest.raises(ValidationError):
            Session.model_validate({**base, **bad})
    assert Session.model_validate({**base, "pid": 2**31 - 1}).pid == 2**31 - 1


def test_a_manifest_number_of_5000_digits_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text('format = 1\n\n[[kernels]]\nfamily = "matmul"\n'
                    f'params = {{ m = {"9" * 5000} }}\n')
    proc = farm(tmp_path / "home", "manifest", "show", str(path))
    one_line_refusal(proc, str(path), "out of range")


def test_bundle_export_force_never_replaces_what_is_not_a_regular_file(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    manifest = tmp_path / "one.toml"
    manifest.write_text(MANIFEST_ONE)
    build(home, manifest)
    fifo = tmp_path / "a-pipe"
    os.mkfifo(fifo)
    link = tmp_path / "a-link"
    link.symlink_to(tmp_path / "elsewhere")
    for out in (fifo, link):
        proc = farm(home, "bundle", "export", "--all", "--force", str(out))
        one_line_refusal(proc, "not a regular file")
    assert fifo.is_fifo() and link.is_symlink() and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("heartbeat", ["Infinity", "NaN", "-1", "1e400"])
def test_a_worker_entry_in_redis_with_a_non_finite_heartbeat_is_not_a_worker(
        heartbeat: str) -> None:
    from pydantic import ValidationError

    from farm.cluster.workers import WorkerInfo

    raw = ('{"host": "h", "pid": 1, "fingerprint": "pocl-x", "device_name": "d", '
           f'"processes": 1, "version": "0", "queues": [], "heartbeat": {heartbeat}}}')
    with pytest.raises(ValidationError):
        WorkerInfo.model_validate_json(raw)
