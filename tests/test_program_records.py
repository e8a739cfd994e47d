"""Issue 29, items 4 and 5: work-group function records never crash an application, and a
bad function never spreads: not kept in a node's PoCL cache past the store's repair,
never harvested back into the store. Real processes: a small pyopencl application under
``farm run`` on the local PoCL (tests/served_apps.py), records in a node's local tier.

What a record says it is (program, binary, device, kernel, local size, grid class) sits
in its digested body and is checked against what is being loaded; then the program's
binary with the record merged is loaded in an isolated child with a private PoCL cache,
each function ``dlopen``\\ ed there and each recorded launch run. A record whose function
the dynamic loader refuses (PoCL aborted the application on it) or whose recorded launch
kills the child is quarantined, and the application's own first launch makes the
function, which the harvest stores in the freed slot.

What no check that costs less than compiling the function again can see is a record
whose every field agrees but whose function was made for another local size, with no
launch recorded: only a signature says who wrote it (the last test: with a verify key,
such a record written without the signing key is refused). docs/SECURITY.md says so.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from served_apps import (
    device_binary,
    env,
    put_local,
    record_bytes,
    record_functions,
    run,
    stored,
)

from farm.core.keys import PROGRAM_FUNCTIONS_FAMILY, Namespace, program_functions_key
from farm.core.model import Artifact, ReadyLaunch

SMALL, LARGE = "16-1-1-goffs0-smallgrid", "128-1-1-goffs0-smallgrid"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A node whose runs stored the program and the functions of its launches at local
    sizes 16 and 128 (its record, decoded)."""
    from farm.compilation.poclbin import build_hash

    root = tmp_path_factory.mktemp("records")
    node = env(root / "a", root / "a-pocl")
    for _ in range(2):  # the second run loads, its launches find their functions
        assert run(root, node, locals_="16,128").ok
    [(ns, art)] = stored(root / "a")
    functions: dict[tuple[str, str], bytes] = {}
    base = build_hash(device_binary(art.binary))
    for _, rec in stored(root / "a", PROGRAM_FUNCTIONS_FAMILY):
        functions.update(record_functions(rec.binary, art.meta.key, base, ns.fingerprint,
                                          frozenset({"twice"})))
    assert set(functions) == {("twice", SMALL), ("twice", LARGE)}, functions
    return {"root": root, "ns": ns, "art": art, "base": base, "functions": functions}


def _record(g: dict[str, Any], functions: dict[tuple[str, str], bytes],
            launches: dict[tuple[str, str], ReadyLaunch] | None = None,
            device: str | None = None) -> Artifact:
    art = g["art"]
    return Artifact.create(program_functions_key(art.meta.key, 0), PROGRAM_FUNCTIONS_FAMILY,
                           record_bytes(art.meta.key, g["base"], device or g["ns"].fingerprint,
                                        functions, launches), art.meta.source_hash)


def _node(g: dict[str, Any], home: Path, record: Artifact) -> None:
    put_local(home, g["ns"], g["art"])
    put_local(home, g["ns"], record)


def _does_not_open(function: bytes) -> bytes:
    """A function that still exports its symbol (section headers intact) but that the
    dynamic loader refuses: its program headers point past the end of the file."""
    out = bytearray(function)
    struct.pack_into("<Q", out, 32, len(function) + 8192)
    return bytes(out)


def _refused_then_repaired(g: dict[str, Any], tmp_path: Path, home: Path, locals_: str
                           ) -> None:
    node = env(home, tmp_path / "b-pocl")
    first = run(tmp_path, node, locals_=locals_)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.ok and first.counts["loaded"] == 1, first
    assert len(first.warnings) == 1 and "refused" in first.warnings[0], first.warnings
    [(_, rec)] = stored(home, PROGRAM_FUNCTIONS_FAMILY)  # the harvest's, in the freed slot
    assert rec.meta.key == program_functions_key(g["art"].meta.key, 0)
    again = run(tmp_path, node, locals_=locals_)
    assert again.returncode == 0 and again.ok and again.warnings == [], again


def test_a_function_the_dynamic_loader_refuses_never_reaches_the_application(
        genuine: dict[str, Any], tmp_path: Path) -> None:
    """PoCL aborts the application when it cannot dlopen a function: the child does it
    first, the record is quarantined, the application's launch makes its own."""
    home = tmp_path / "b"
    _node(genuine, home, _record(genuine, {("twice", SMALL): _does_not_open(
        genuine["functions"][("twice", SMALL)])}))
    _refused_then_repaired(genuine, tmp_path, home, "16")


def test_a_function_filed_under_another_local_size_with_its_launch_is_refused(
        genuine: dict[str, Any], tmp_path: Path) -> None:
    """Item 4: the function made for 128 work-items filed as 16 crashes the application
    that launches 16; with the launch recorded, it crashes the child instead."""
    launch = ReadyLaunch(kernel_name="twice", global_size=(4096,), local_size=(16,),
                         args=({"kind": "buffer", "nbytes": 4 * 4096},))
    home = tmp_path / "b"
    _node(genuine, home, _record(genuine, {("twice", SMALL): genuine["functions"][
        ("twice", LARGE)]}, {("twice", SMALL): launch}))
    _refused_then_repaired(genuine, tmp_path, home, "16")


def test_a_record_copied_from_another_devices_namespace_is_refused(
        genuine: dict[str, Any], tmp_path: Path) -> None:
    """The device a record's functions were made on is part of its digested body: a copy
    into another namespace (the same kind of CPU, another driver) is refused."""
    home = tmp_path / "b"
    _node(genuine, home, _record(genuine, {("twice", SMALL): genuine["functions"][
        ("twice", SMALL)]}, device="pocl-elsewhere-0123456789ab"))
    _refused_then_repaired(genuine, tmp_path, home, "16")


def test_a_bad_function_does_not_outlive_the_stores_repair_nor_spread(
        genuine: dict[str, Any], tmp_path: Path) -> None:
    """Item 5: a function filed under a local size it was not made for (a forgery no
    check sees, see the module docstring) is used by the node while the store holds it.
    Once the record is removed, the node computes the right values again although its
    PoCL cache (kept, as PoCL's kernel cache keeps it) still holds the bad file; its
    harvest stores the function PoCL made, not the bad one; a fresh node is right too."""
    home = tmp_path / "b"
    node = {**env(home, tmp_path / "b-pocl"), "POCL_KERNEL_CACHE": "1"}
    small = genuine["functions"][("twice", SMALL)]
    forged = _record(genuine, {("twice", LARGE): small})
    _node(genuine, home, forged)
    first = run(tmp_path, node, locals_="128")  # its values are the forger's
    assert first.returncode == 0, first.stderr[-3000:]
    from farm.core.settings import Settings
    from farm.store.sqlite import SQLiteStore

    store = SQLiteStore(Settings(home=home).store_path)
    try:
        store.delete(genuine["ns"], forged.meta.key)  # the store is repaired
    finally:
        store.close()
    repaired = run(tmp_path, node, locals_="128")
    assert repaired.returncode == 0 and repaired.ok, repaired
    harvested = _functions(genuine, home)
    assert harvested.get(("twice", LARGE)) not in (None, small), "the bad function spread"
    fresh = tmp_path / "c"
    put_local(fresh, genuine["ns"], genuine["art"])
    for ns, rec in stored(home, PROGRAM_FUNCTIONS_FAMILY):
        put_local(fresh, ns, rec)
    other = run(tmp_path, env(fresh, tmp_path / "c-pocl"), locals_="128")
    assert other.returncode == 0 and other.ok and other.warnings == [], other


def _functions(g: dict[str, Any], home: Path) -> dict[tuple[str, str], bytes]:
    out: dict[tuple[str, str], bytes] = {}
    for ns, rec in stored(home, PROGRAM_FUNCTIONS_FAMILY):
        out.update(record_functions(rec.binary, g["art"].meta.key, g["base"], ns.fingerprint,
                                    frozenset({"twice"})))
    return out


def test_with_a_verify_key_a_record_not_signed_is_refused(
        genuine: dict[str, Any], tmp_path: Path) -> None:
    """The forgery no check sees is a writer's word: with a verify key only a writer that
    holds the signing key is believed, and the application computes the right values."""
    from farm.store.signing import Signer, generate_keypair

    private, public = generate_keypair()
    signer = Signer(private)
    ns: Namespace = genuine["ns"]
    art = genuine["art"]
    signed = Artifact(meta=signer.sign(art.meta, ns), binary=art.binary)
    home = tmp_path / "b"
    put_local(home, ns, signed)
    put_local(home, ns, _record(genuine, {("twice", LARGE): genuine["functions"][
        ("twice", SMALL)]}))
    served = run(tmp_path, {**env(home, tmp_path / "b-pocl"), "FARM_VERIFY_KEY": public},
                 locals_="128")
    assert served.returncode == 0 and served.ok and served.counts["loaded"] == 1, served


@pytest.mark.integration
def test_a_bad_record_in_minio_is_quarantined_there_and_replaced_for_every_node(
        genuine: dict[str, Any], tmp_path: Path, minio_server: Any) -> None:
    """The node that meets a bad record in the shared store quarantines it there, and its
    harvest stores the functions its launches made in the freed slot: a fresh node then
    loads the program with that record and compiles nothing at its launches."""
    import uuid

    from farm.core.settings import Settings
    from farm.store.open import open_store

    bucket = f"t29r-{uuid.uuid4().hex[:12]}"
    ns = genuine["ns"]
    bad = _record(genuine, {("twice", SMALL): _does_not_open(
        genuine["functions"][("twice", SMALL)])})
    store = open_store(Settings(
        minio_endpoint=minio_server.endpoint, minio_access_key=minio_server.access_key,
        minio_secret_key=minio_server.secret_key, minio_bucket=bucket), shared=True, signed=False)
    try:
        store.put(ns, genuine["art"])
        store.put(ns, bad)
        first = run(tmp_path, env(tmp_path / "b", tmp_path / "b-pocl", minio_server, bucket))
        assert first.returncode == 0 and first.ok and len(first.warnings) == 1, first
        assert [q.artifact.meta.digest for q in store.quarantined(ns)] == [bad.meta.digest]
        held = store.get(ns, bad.meta.key)
        assert held is not None and held.meta.digest != bad.meta.digest
    finally:
        store.close()
    fresh = run(tmp_path, {**env(tmp_path / "c", tmp_path / "c-pocl", minio_server, bucket),
                           "POCL_DEBUG": "general"})
    assert fresh.returncode == 0 and fresh.ok and fresh.warnings == [], fresh
    assert "Built a" not in fresh.stderr and "Using a cached WG function" in fresh.stderr
