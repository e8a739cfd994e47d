"""Issue 29, items 1, 2, 3, 6 and 9: a stored program's bytes never crash an application,
never run as another program, are repaired at the next run, and its build log is signed
and escaped. Real processes: a small pyopencl application under ``farm run`` on the local
PoCL, its programs in a node's local tier, in MinIO, or imported from a bundle.

Each hostile case is made from what a real served run stored (tests/served_apps.py):
a binary cut short or with one flipped bit (its digest and size made to match), an
empty, random, PTX or other device's binary, another program's valid binary under the
key. What must hold for every one: the application exits 0 with the right values, says
so in one warning line, and its next run loads the repaired program with no warning.
"""

from __future__ import annotations

import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from served_apps import (
    device_binary,
    env,
    flipped,
    put_local,
    run,
    stored,
    under_key,
    with_binary,
)

from farm.core.model import Artifact

PTX = (b"//\n.version 7.0\n.target sm_80\n.address_size 64\n\n"
       b".visible .entry twice(.param .u64 a) { ret; }\n")


def _other_device(binary: bytes) -> bytes:
    """A PoCL binary naming another device (its header's device id changed)."""
    return binary[:8] + bytes(b ^ 0x5A for b in binary[8:16]) + binary[16:]


def _renamed(binary: bytes) -> bytes:
    """``binary`` named by its content again (as the farm names what it stores), so that
    only a load can tell it is damaged; as it is where the layout is unknown."""
    from farm.compilation.poclbin import PoclBinaryError, rewrite

    try:
        return rewrite(binary, frozenset())
    except PoclBinaryError:
        return binary


HOSTILE = {
    "cut short": lambda b: b[:len(b) // 2],
    "a flipped bit": lambda b: flipped(b, 400),
    "a flipped bit, renamed by content": lambda b: _renamed(flipped(b, 400)),
    "empty": lambda b: b"",
    "random": lambda b: random.Random(29).randbytes(len(b)),
    "PTX": lambda b: PTX,
    "another device's": _other_device,
}


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A node that compiled and stored the program (and one that stored another)."""
    root = tmp_path_factory.mktemp("trust")
    first = run(root, env(root / "a", root / "a-pocl"))
    assert first.returncode == 0 and first.ok and first.counts["compiled"] == 1, first
    [(ns, art)] = stored(root / "a")
    others = {}
    for name, factor in (("twice", 3), ("thrice", 3)):
        home = root / f"o-{name}-{factor}"
        other = run(root, env(home, root / f"o-{name}-{factor}-pocl"), name=name,
                    factor=factor)
        assert other.returncode == 0 and other.ok, other
        [(_, others[name])] = stored(home)
    return {"root": root, "ns": ns, "art": art, "others": others}


def _served_twice(root: Path, node_env: dict[str, str]) -> None:
    """The run on a node holding something hostile, then the next one: no crash, the
    right values, one warning line, then the repair loaded with none."""
    first = run(root, node_env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.ok and first.counts["fallbacks"] == 0, first
    assert len(first.warnings) == 1, first.warnings
    again = run(root, node_env)
    assert again.returncode == 0 and again.ok, again.stderr[-3000:]
    assert again.warnings == [] and again.counts["loaded"] == again.counts["programs"] == 1, \
        (again.counts, again.warnings)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_program_in_the_local_tier_is_refused_and_repaired(
        kind: str, node_a: dict[str, Any], tmp_path: Path) -> None:
    """Items 1 and 3: cut short or a flipped bit (SIGSEGV, SIGABRT before), and binaries
    the device refuses (a warning on every run before, two for another device's)."""
    home = tmp_path / "b"
    art = node_a["art"]
    put_local(home, node_a["ns"], with_binary(art, HOSTILE[kind](device_binary(art.binary))))
    _served_twice(tmp_path, env(home, tmp_path / "b-pocl"))


@pytest.mark.parametrize("other", ["twice", "thrice"])
def test_another_programs_valid_binary_under_the_key_is_never_served(
        other: str, node_a: dict[str, Any], tmp_path: Path) -> None:
    """Item 2: another program's valid binary (3x for 2x; a kernel of another name) is
    refused without a verify key, quarantined and rebuilt from the application's source."""
    home = tmp_path / "b"
    put_local(home, node_a["ns"], under_key(node_a["art"], node_a["others"][other]))
    _served_twice(tmp_path, env(home, tmp_path / "b-pocl"))


@pytest.mark.integration
def test_a_program_cut_short_in_minio_is_quarantined_there_and_repaired_for_every_node(
        node_a: dict[str, Any], tmp_path: Path, minio_server: Any) -> None:
    """Item 1 from MinIO: the node that meets it survives and repairs the shared copy; a
    fresh node then loads the repair."""
    from farm.core.settings import Settings
    from farm.store.open import open_store

    bucket = f"t29-{uuid.uuid4().hex[:12]}"
    art = node_a["art"]
    bad = with_binary(art, HOSTILE["cut short"](device_binary(art.binary)))
    store = open_store(Settings(
        minio_endpoint=minio_server.endpoint, minio_access_key=minio_server.access_key,
        minio_secret_key=minio_server.secret_key, minio_bucket=bucket), shared=True, signed=False)
    try:
        store.put(node_a["ns"], bad)
        first = run(tmp_path, env(tmp_path / "b", tmp_path / "b-pocl", minio_server, bucket))
        assert first.returncode == 0 and first.ok and len(first.warnings) == 1, first
        assert [q.artifact.meta.digest for q in store.quarantined(node_a["ns"])] == \
            [bad.meta.digest]
        held = store.get(node_a["ns"], art.meta.key)
        assert held is not None and held.meta.digest != bad.meta.digest
    finally:
        store.close()
    fresh = run(tmp_path, env(tmp_path / "c", tmp_path / "c-pocl", minio_server, bucket))
    assert fresh.returncode == 0 and fresh.ok and fresh.warnings == [], fresh
    assert fresh.counts["loaded"] == 1


def _bundle(root: Path, ns: Any, art: Artifact) -> Path:
    """A bundle holding ``art`` in namespace ``ns``."""
    from farm.store.bundle import export_bundle
    from farm.store.sqlite import SQLiteStore

    store = SQLiteStore(root / f"bundle-{uuid.uuid4().hex[:8]}.sqlite")
    try:
        store.put(ns, art)
        path = root / f"{uuid.uuid4().hex[:8]}.bundle"
        export_bundle(store, None, path)
        return path
    finally:
        store.close()


def _farm(node_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], env=node_env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_after_an_import_without_validation_a_damaged_program_is_refused_at_first_use(
        node_a: dict[str, Any], tmp_path: Path) -> None:
    """Item 1 after ``farm bundle import --no-validate``, whose output says the loaders
    validate each binary in a child process before first use: now they do."""
    art = node_a["art"]
    path = _bundle(tmp_path, node_a["ns"], with_binary(
        art, HOSTILE["a flipped bit, renamed by content"](device_binary(art.binary))))
    node_env = env(tmp_path / "b", tmp_path / "b-pocl")
    imported = _farm(node_env, "bundle", "import", str(path), "--no-validate")
    assert imported.returncode == 0, imported.stderr
    _served_twice(tmp_path, node_env)


def test_a_refused_bundle_import_leaves_nothing_in_the_nodes_driver_cache(
        node_a: dict[str, Any], tmp_path: Path) -> None:
    """Item 6: the validating child has a private PoCL cache, so a binary that kills it
    leaves no residue where the node's loaders look (which then died with SIGABRT)."""
    art = node_a["art"]
    bad = with_binary(art, HOSTILE["a flipped bit, renamed by content"](
        device_binary(art.binary)))
    path = _bundle(tmp_path, node_a["ns"], bad)
    cache = tmp_path / "b-pocl"
    node_env = {**env(tmp_path / "b", cache), "POCL_KERNEL_CACHE": "1"}
    imported = _farm(node_env, "bundle", "import", str(path))
    assert imported.returncode == 2, imported.stdout + imported.stderr
    assert "fails validation" in imported.stderr and "Traceback" not in imported.stderr
    # PoCL's own temporary files of device discovery aside, no program folder
    assert [p for p in cache.rglob("*") if not p.name.startswith("tempfile_")] == [], \
        "residue in the node's cache"
    after = run(tmp_path, node_env)
    assert after.returncode == 0 and after.ok, after


# -- item 9: the build log ------------------------------------------------------------------
FORGED = "\x1b[2J\x1b[Hkernel-farm: programs 99, loaded 99\nsecond line\x07"


def _tampered_log(art: Artifact) -> Artifact:
    """``art`` with its build log replaced, its signature kept (what a writer without the
    signing key can do), its digest and size made to match."""
    changed = with_binary(art, device_binary(art.binary), log=FORGED)
    return Artifact(meta=changed.meta.model_copy(update={
        "signature": art.meta.signature}), binary=changed.binary)


def _no_forgery(stderr: str) -> None:
    assert "\x1b" not in stderr and "\x07" not in stderr, stderr[-2000:]
    assert not any(line.startswith("kernel-farm: programs 99") for line in
                   stderr.splitlines()), stderr[-2000:]


def test_a_tampered_build_log_is_refused_with_a_verify_key(tmp_path: Path) -> None:
    """Item 9: the log is part of what the signature covers: a log changed by a writer
    without the key is refused (and the program rebuilt), never printed."""
    from farm.store.signing import generate_keypair

    private, public = generate_keypair()
    writer = {**env(tmp_path / "a", tmp_path / "a-pocl"), "FARM_SIGNING_KEY": private}
    assert run(tmp_path, writer).ok
    [(ns, art)] = stored(tmp_path / "a")
    assert art.meta.signature
    home = tmp_path / "b"
    put_local(home, ns, _tampered_log(art))
    reader = {**env(home, tmp_path / "b-pocl"), "FARM_VERIFY_KEY": public,
              "PYOPENCL_COMPILER_OUTPUT": "1"}
    served = run(tmp_path, reader)
    assert served.returncode == 0 and served.ok, served
    _no_forgery(served.stderr)


def test_a_stored_build_log_is_escaped_and_indented_when_shown(
        node_a: dict[str, Any], tmp_path: Path) -> None:
    """Item 9 without signing: whatever a log holds, it is shown with its control
    characters escaped and every line indented, so no line of it passes for the farm's."""
    home = tmp_path / "b"
    art = node_a["art"]
    put_local(home, node_a["ns"], with_binary(art, device_binary(art.binary), log=FORGED))
    served = run(tmp_path, {**env(home, tmp_path / "b-pocl"),
                            "PYOPENCL_COMPILER_OUTPUT": "1"})
    assert served.returncode == 0 and served.ok, served
    _no_forgery(served.stderr)
    assert "\\x1b[2J" in served.stderr  # shown, escaped


def test_the_node_book_spares_later_runs_the_child(node_a: dict[str, Any],
                                                    tmp_path: Path) -> None:
    """The verdict is kept per node: the first run proves the stored program in a child
    and notes the work-group functions its own launches made and its harvest stored
    (PoCL made and ran them here); later runs find every verdict (files under FARM_HOME)
    and prove nothing again."""
    home = tmp_path / "b"
    put_local(home, node_a["ns"], node_a["art"])
    node_env = env(home, tmp_path / "b-pocl")

    def verdicts() -> dict[str, int]:
        return {p.name: p.stat().st_mtime_ns for p in (home / "proofs").rglob("*")
                if p.is_file() and p.parent.name != "ahead"}

    first = run(tmp_path, node_env)
    assert first.ok and first.warnings == [] and first.counts["loaded"] == 1, first
    both = verdicts()
    assert len(both) == 2 and not any(n.endswith(".refused") for n in both)
    second = run(tmp_path, node_env)
    assert second.ok and second.warnings == [] and second.counts["loaded"] == 1, second
    assert verdicts() == both
    third = run(tmp_path, node_env)
    assert third.ok and third.counts["loaded"] == 1
    assert verdicts() == both
