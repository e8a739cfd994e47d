"""Bundles: the offline flow (build, export, import elsewhere, warm with no compiler),
idempotent import, first writer wins, and one test per kind of hostile bundle.

The hostile bundles are made of synthetic artifacts (random bytes): a bundle is
verified before anything is loaded, so no device is needed to refuse one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from farm.core.errors import BundleError
from farm.core.keys import Namespace, artifact_object
from farm.core.model import Artifact, Key
from farm.core.settings import Settings
from farm.store import SQLiteStore
from farm.store.bundle import (
    MANIFEST_MEMBER,
    MAX_ARTIFACT_BYTES,
    export_bundle,
    import_bundle,
    read_bundle,
)

NS1 = Namespace.for_fingerprint("pocl-test-device-0123456789ab")
NS2 = Namespace.for_fingerprint("nvidia-h200-0123456789ab")


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def key(i: int) -> Key:
    return Key(id_hash=f"{i:032x}", build_id="b1b1b1b1b1b1b1b1")


def art(k: Key, payload: bytes) -> Artifact:
    return Artifact.create(k, "fam", payload, f"{k.id_hash:0<64}"[:64])


def snapshot(path: Path) -> list[tuple[Any, ...]]:
    """Every row of a SQLite store, artifacts and source index, in a stable order."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT * FROM artifacts ORDER BY namespace, id_hash, build_id"
                            ).fetchall()
        rows += conn.execute("SELECT * FROM sources ORDER BY namespace, source_hash"
                             ).fetchall()
    finally:
        conn.close()
    return rows


def members_of(path: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of every member of a bundle we wrote ourselves (trusted here)."""
    with tarfile.open(path, mode="r:") as tar:
        out = []
        for m in tar.getmembers():
            fh = tar.extractfile(m)
            assert fh is not None
            out.append((m.name, fh.read()))
    return out


def raw_member(name: str, data: bytes, *, size: int | None = None,
               kind: bytes = tarfile.REGTYPE, linkname: str = "") -> bytes:
    """One tar member as bytes, with whatever header a hostile writer wants."""
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    info.type = kind
    info.linkname = linkname
    header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    pad = (-len(data)) % tarfile.BLOCKSIZE
    return header + data + b"\0" * pad


def write_raw(path: Path, members: list[bytes], end: bool = True) -> Path:
    path.write_bytes(b"".join(members) + (b"\0" * 2 * tarfile.BLOCKSIZE if end else b""))
    return path


def manifest_bytes(members: list[tuple[str, bytes]]) -> dict[str, Any]:
    name, raw = members[0]
    assert name == MANIFEST_MEMBER
    data: dict[str, Any] = json.loads(raw)
    return data


@pytest.fixture
def source(tmp_path: Path) -> Iterator[SQLiteStore]:
    """A store with three artifacts in each of two namespaces."""
    store = SQLiteStore(tmp_path / "source.sqlite")
    for ns in (NS1, NS2):
        for i in range(3):
            store.put(ns, art(key(i), os.urandom(200 + i) + str(ns).encode()))
    yield store
    store.close()


@pytest.fixture
def target(tmp_path: Path) -> Iterator[SQLiteStore]:
    """A target store that already holds one unrelated artifact."""
    store = SQLiteStore(tmp_path / "target.sqlite")
    store.put(NS1, art(key(99), b"already here"))
    yield store
    store.close()


@pytest.fixture
def good(source: SQLiteStore, tmp_path: Path) -> Path:
    out = tmp_path / "good.bundle"
    export_bundle(source, None, out)
    return out


def assert_refused(path: Path, target: SQLiteStore, *words: str, **kw: Any) -> str:
    """The bundle is refused with one line naming ``words``, the store is unchanged."""
    before = snapshot(target.path)
    with pytest.raises(BundleError) as caught:
        import_bundle(path, target, **kw)
    message = str(caught.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    assert snapshot(target.path) == before
    return message


# ----------------------------------------------------------------------------------------
# the happy paths
# ----------------------------------------------------------------------------------------
def test_export_import_roundtrip_keeps_namespaces_and_marks_imported(
        good: Path, source: SQLiteStore, target: SQLiteStore) -> None:
    bundle = read_bundle(good)
    m = bundle.manifest
    assert m.format == "kernel-farm-bundle" and m.version == 1
    assert {n.fingerprint: n.artifacts for n in m.namespaces} == {
        NS1.fingerprint: 3, NS2.fingerprint: 3}
    assert m.total_bytes == sum(a.size for a in m.artifacts)

    report = import_bundle(good, target)
    assert (report.imported, report.skipped, report.refused) == (6, 0, 0)
    for ns in (NS1, NS2):
        for i in range(3):
            got = target.get(ns, key(i))
            want = source.get(ns, key(i))
            assert got is not None and want is not None
            assert got.binary == want.binary and got.meta.digest == want.meta.digest
            assert got.meta.origin == "imported"
    # each artifact only in its own namespace (the payload names the namespace)
    for ns, other in ((NS1, NS2), (NS2, NS1)):
        got = target.get(ns, key(0))
        assert got is not None and str(ns).encode() in got.binary
        assert str(other).encode() not in got.binary


def test_export_one_namespace(source: SQLiteStore, tmp_path: Path) -> None:
    out = tmp_path / "one.bundle"
    report = export_bundle(source, [NS2], out)
    assert [n.namespace for n in report.manifest.namespaces] == [str(NS2)]
    assert len(read_bundle(out).artifacts) == 3


def test_reimport_is_idempotent(good: Path, target: SQLiteStore) -> None:
    import_bundle(good, target)
    after_first = snapshot(target.path)
    report = import_bundle(good, target)
    assert (report.imported, report.skipped, report.refused) == (0, 6, 0)
    assert snapshot(target.path) == after_first


def test_import_never_replaces_a_locally_compiled_artifact(good: Path,
                                                           target: SQLiteStore) -> None:
    mine = art(key(1), b"compiled on this machine")
    target.put(NS1, mine)
    report = import_bundle(good, target)
    assert (report.imported, report.skipped, report.refused) == (5, 0, 1)
    assert report.refused_keys == [f"{NS1}/{key(1)}"]
    kept = target.get(NS1, key(1))
    assert kept is not None and kept.binary == b"compiled on this machine"
    assert kept.meta.origin == "compiled"


# ----------------------------------------------------------------------------------------
# hostile bundles: each refused with one line, the target store unchanged
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["in the manifest", "in a header", "in the last binary"])
def test_truncated_file_is_refused(good: Path, target: SQLiteStore, tmp_path: Path,
                                   where: str) -> None:
    with tarfile.open(good, mode="r:") as tar:
        members = tar.getmembers()
    first, last = members[0], members[-1]
    cut_at = {"in the manifest": first.offset_data + first.size // 2,
              "in a header": members[2].offset + 100,
              "in the last binary": last.offset_data + last.size // 2}[where]
    cut = tmp_path / "cut.bundle"
    cut.write_bytes(good.read_bytes()[:cut_at])
    assert_refused(cut, target, "truncated")


def test_truncated_between_members_is_refused(good: Path, target: SQLiteStore,
                                              tmp_path: Path) -> None:
    members = members_of(good)
    path = write_raw(tmp_path / "short.bundle",
                     [raw_member(n, d) for n, d in members[:3]], end=False)
    assert_refused(path, target, "truncated", "missing")


@pytest.mark.parametrize("content", [b"", b"garbage " * 1000, os.urandom(20000)])
def test_garbage_is_refused(target: SQLiteStore, tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "garbage.bundle"
    path.write_bytes(content)
    assert_refused(path, target, "bundle")


def test_a_tar_of_something_else_is_refused(target: SQLiteStore, tmp_path: Path) -> None:
    path = write_raw(tmp_path / "other.tar", [raw_member("README", b"hello")])
    assert_refused(path, target, "not a kernel-farm bundle")


@pytest.mark.parametrize("name,words", [
    ("../../etc/evil", ("climbs",)),
    ("opencl/v1/../../../evil", ("climbs",)),
    ("/etc/passwd", ("absolute",)),
])
def test_member_name_escaping_is_refused(good: Path, target: SQLiteStore, tmp_path: Path,
                                         name: str, words: tuple[str, ...]) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    path = write_raw(tmp_path / "escape.bundle", [*members[:2], raw_member(name, b"x"),
                                                  *members[2:]])
    assert_refused(path, target, name, *words)
    first = write_raw(tmp_path / "escape-first.bundle", [raw_member(name, b"x"), *members])
    assert_refused(first, target, *words)


def test_link_member_is_refused(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    link = raw_member("opencl/v1/link", b"", kind=tarfile.SYMTYPE, linkname="/etc/passwd")
    path = write_raw(tmp_path / "link.bundle", [members[0], link, *members[1:]])
    assert_refused(path, target, "not a regular file")


def test_absurd_declared_size_in_the_manifest_is_refused(good: Path, target: SQLiteStore,
                                                         tmp_path: Path) -> None:
    members = members_of(good)
    manifest = manifest_bytes(members)
    manifest["artifacts"][0]["size"] = 10**15
    manifest["artifacts"][0]["meta"]["size"] = 10**15
    path = write_raw(tmp_path / "huge.bundle", [
        raw_member(MANIFEST_MEMBER, json.dumps(manifest).encode()),
        *(raw_member(n, d) for n, d in members[1:])])
    assert_refused(path, target, "exceeds the limit", str(MAX_ARTIFACT_BYTES))


def test_absurd_declared_size_in_a_member_header_is_refused(good: Path, target: SQLiteStore,
                                                            tmp_path: Path) -> None:
    members = members_of(good)
    name, data = members[1]
    path = write_raw(tmp_path / "header.bundle", [
        raw_member(*members[0]), raw_member(name, data, size=10**12)])
    assert_refused(path, target, "declares 1000000000000 bytes")


def test_total_size_cap(good: Path, target: SQLiteStore) -> None:
    assert_refused(good, target, "over the limit", max_bytes=good.stat().st_size - 1)


def test_digest_mismatch_is_refused(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = members_of(good)
    name, data = members[-1]
    evil = bytes([data[0] ^ 0xFF]) + data[1:]
    path = write_raw(tmp_path / "evil.bundle", [
        *(raw_member(n, d) for n, d in members[:-1]), raw_member(name, evil)])
    assert_refused(path, target, "digest mismatch")


def test_metadata_that_disagrees_with_its_entry_is_refused(good: Path, target: SQLiteStore,
                                                           tmp_path: Path) -> None:
    members = members_of(good)
    manifest = manifest_bytes(members)
    manifest["artifacts"][0]["meta"]["digest"] = "0" * 64
    path = write_raw(tmp_path / "meta.bundle", [
        raw_member(MANIFEST_MEMBER, json.dumps(manifest).encode()),
        *(raw_member(n, d) for n, d in members[1:])])
    assert_refused(path, target, "disagrees")


@pytest.mark.parametrize("field,value,words", [
    ("version", 2, ("format version 2", "reads version 1")),
    ("version", "1", ("format version '1'",)),
    ("format", "kernel-farm-bundle-ng", ("not a kernel-farm-bundle",)),
])
def test_other_format_version_is_refused(good: Path, target: SQLiteStore, tmp_path: Path,
                                         field: str, value: object,
                                         words: tuple[str, ...]) -> None:
    members = members_of(good)
    manifest = manifest_bytes(members)
    manifest[field] = value
    manifest["some_new_field"] = "of a newer farm"
    path = write_raw(tmp_path / "v2.bundle", [
        raw_member(MANIFEST_MEMBER, json.dumps(manifest).encode()),
        *(raw_member(n, d) for n, d in members[1:])])
    assert_refused(path, target, *words)


@pytest.mark.parametrize("bad", ["../v1/pocl-test-device-0123456789ab",
                                 "opencl/v1/Not A Fingerprint",
                                 "opencl/v9/pocl-test-device-0123456789ab",
                                 "opencl/v1/pocl-test-device-0123456789ab/extra"])
def test_invalid_namespace_is_refused(good: Path, target: SQLiteStore, tmp_path: Path,
                                      bad: str) -> None:
    members = members_of(good)
    manifest = manifest_bytes(members)
    old = manifest["artifacts"][0]["namespace"]
    for entry in manifest["artifacts"]:
        if entry["namespace"] == old:
            entry["namespace"] = bad
            entry["member"] = entry["member"].replace(old, bad, 1)
    for entry in manifest["namespaces"]:
        if entry["namespace"] == old:
            entry["namespace"] = bad
    renamed = [(n.replace(old, bad, 1), d) for n, d in members[1:]]
    path = write_raw(tmp_path / "ns.bundle", [
        raw_member(MANIFEST_MEMBER, json.dumps(manifest).encode()),
        *(raw_member(n, d) for n, d in renamed)])
    assert_refused(path, target, "namespace")


def test_member_not_listed_is_refused(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    extra = raw_member(artifact_object(NS1, key(1234)), b"smuggled")
    path = write_raw(tmp_path / "extra.bundle", [*members, extra])
    assert_refused(path, target, "not listed in the manifest")


def test_duplicate_member_is_refused(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    path = write_raw(tmp_path / "dup.bundle", [*members, members[1]])
    assert_refused(path, target, "appears twice")


def test_manifest_must_come_first(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    path = write_raw(tmp_path / "late.bundle", [members[1], members[0], *members[2:]])
    assert_refused(path, target, MANIFEST_MEMBER)


def test_manifest_not_json_is_refused(good: Path, target: SQLiteStore, tmp_path: Path) -> None:
    members = [raw_member(n, d) for n, d in members_of(good)]
    path = write_raw(tmp_path / "nojson.bundle",
                     [raw_member(MANIFEST_MEMBER, b"{not json"), *members[1:]])
    assert_refused(path, target, "not JSON")


# ----------------------------------------------------------------------------------------
# the CLI: one line and exit status 2 for a refused bundle
# ----------------------------------------------------------------------------------------
def run_farm(args: list[str], capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """Run ``farm ARGS`` in this process through the real entry point (``main``),
    mounting ``warm`` and ``bundle`` when ``farm/cli/main.py`` does not mount them yet."""
    import farm.cli.main as cli
    from farm.cli.bundle import app as bundle_app
    from farm.cli.warm import warm

    if not any(g.name == "bundle" for g in cli.app.registered_groups):
        cli.app.add_typer(bundle_app, name="bundle")
    if not any(c.name == "warm" for c in cli.app.registered_commands):
        cli.app.command("warm")(warm)
    monkeypatch.setattr(sys, "argv", ["farm", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_export_show_import(source: SQLiteStore, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    store_a = SQLiteStore(Settings(home=home_a).store_path)
    for ns in (NS1, NS2):
        for k in source.keys(ns):
            got = source.get(ns, k)
            assert got is not None
            store_a.put(ns, got)
    store_a.close()
    out = tmp_path / "cli.bundle"
    monkeypatch.setenv("FARM_HOME", str(home_a))
    monkeypatch.delenv("FARM_MINIO_ENDPOINT", raising=False)
    code, stdout, _ = run_farm(["bundle", "export", "--namespace", NS1.fingerprint,
                                str(out), "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(stdout)["artifacts"] == 3
    code, _, stderr = run_farm(["bundle", "export", "--all", str(out)], capsys, monkeypatch)
    assert code == 2 and "exists" in stderr
    code, _, _ = run_farm(["bundle", "export", "--all", "--force", str(out)], capsys,
                          monkeypatch)
    assert code == 0

    code, stdout, _ = run_farm(["bundle", "show", str(out), "--json"], capsys, monkeypatch)
    shown = json.loads(stdout)
    assert code == 0 and shown["verified"] is True and len(shown["artifacts"]) == 6
    assert {n["fingerprint"] for n in shown["namespaces"]} == {NS1.fingerprint,
                                                               NS2.fingerprint}

    monkeypatch.setenv("FARM_HOME", str(home_b))
    code, stdout, _ = run_farm(["bundle", "import", str(out), "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(stdout)["imported"] == 6
    code, stdout, _ = run_farm(["bundle", "import", str(out), "--json"], capsys, monkeypatch)
    assert code == 0 and json.loads(stdout)["skipped"] == 6


@pytest.mark.parametrize("command", ["import", "show"])
def test_cli_refuses_a_hostile_bundle_in_one_line(tmp_path: Path, command: str,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FARM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FARM_MINIO_ENDPOINT", raising=False)
    path = write_raw(tmp_path / "escape.bundle", [raw_member("../../x", b"x")])
    code, stdout, stderr = run_farm(["bundle", command, str(path)], capsys, monkeypatch)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: bundle ")
    assert "Traceback" not in stderr and stdout == ""


# ----------------------------------------------------------------------------------------
# the offline flow: build on A, ship a bundle, warm on B with no compiler
# ----------------------------------------------------------------------------------------
class ForbiddenCompiler:
    """A compiler that fails the test if anything reaches it."""

    parallelism = 1

    def submit(self, lowered: object) -> Any:
        raise AssertionError("the platform compiler ran during an offline warm")

    def close(self) -> None:
        pass


def _no_finalize(*args: object, **kwargs: object) -> Any:
    raise AssertionError("finalize (the platform compiler) ran during an offline warm")


@pytest.fixture(scope="module")
def built_tiny(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Environment A: the tiny manifest built by a local farm (two compile processes)."""
    from farm.compilation.local import local_farm
    from farm.manifest import expand, load_manifest, resolve_manifest

    settings = Settings(home=tmp_path_factory.mktemp("farm-a"), workers=2, redis_url=None,
                        minio_endpoint=None, device=None, records_url=None)
    with local_farm(settings, label="build tiny", workers=2) as farm:
        entries = expand(load_manifest(resolve_manifest("tiny")), farm.registry)
        report = farm.batch(label="build tiny").run([e.artifact for e in entries])
    assert report.failed == [] and report.unsupported == []
    return settings


def test_offline_flow_build_export_import_warm_without_compiler(
        built_tiny: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import farm.compilation.compiler
    import farm.compilation.finalize
    from loader import KernelLoader

    store_a = SQLiteStore(built_tiny.store_path)
    (ns,) = store_a.namespaces()
    held = sorted(store_a.keys(ns), key=str)
    assert len(held) == 20
    out = tmp_path / "tiny.bundle"
    export_bundle(store_a, [ns], out)
    store_a.close()

    settings_b = Settings(home=tmp_path / "farm-b", workers=0, redis_url=None,
                          minio_endpoint=None, device=None, records_url=None)
    store_b = SQLiteStore(settings_b.store_path)
    assert store_b.namespaces() == []
    report = import_bundle(out, store_b)
    assert (report.imported, report.skipped, report.refused) == (20, 0, 0)
    store_b.close()

    forbidden = 0
    # every entry to the platform compiler
    for module in (farm.compilation.finalize, farm.compilation.compiler):
        for name in dir(module):
            if name.startswith("finalize") and callable(getattr(module, name)):
                monkeypatch.setattr(module, name, _no_finalize)
                forbidden += 1
    assert forbidden >= 2
    with KernelLoader(settings_b, compiler=ForbiddenCompiler()) as loader:
        assert loader.namespace == ns  # the same device: the bundle's namespace serves it
        warm = loader.warm("tiny")
        s = warm.summary()
        assert (s["kernels"], s["local"], s["compiled"], s["rekeyed"], s["failed"]) == \
            (20, 20, 0, 0, 0)
        assert s["compiler_invocations"] == 0 and loader.stats.loads == 20
        assert sorted((i.key for i in warm.items if i.key), key=str) == held

    # and the command a person would run on B says the same
    monkeypatch.setenv("FARM_HOME", str(settings_b.home))
    for name in ("FARM_MINIO_ENDPOINT", "FARM_REDIS_URL", "FARM_DEVICE", "FARM_RECORDS_URL",
                 "FARM_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    code, stdout, _ = run_farm(["warm", "tiny", "--json", "--on-miss", "fail"], capsys,
                               monkeypatch)
    summary = json.loads(stdout)["summary"]
    assert code == 0 and summary["local"] == 20 and summary["compiled"] == 0
    assert summary["compiler_invocations"] == 0
