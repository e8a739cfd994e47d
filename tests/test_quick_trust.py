"""The served quick path under the trust rule (issue 29 meets issue 30): it loads a stored
program only with the node's good verdict for exactly those bytes, and a fresh node's
prover ahead proves the application's plan while the application starts; a binary that
crashes the prover is proven again, in the application's server's own child, and
refused there. Real processes: a small pyopencl application under ``farm run`` on the
local PoCL (tests/served_apps.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from served_apps import device_binary, env, put_local, run, stored, with_binary

from farm.compilation.proofs import Claim, ProofBook
from farm.core.keys import PLAN_FAMILY
from farm.programs.headers import read_body


@pytest.fixture(scope="module")
def node_a(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("quick-trust")
    first = run(root, env(root / "a", root / "a-pocl"))
    assert first.returncode == 0 and first.ok and first.counts["compiled"] == 1, first
    [(ns, art)] = stored(root / "a")
    return {"root": root, "ns": ns, "art": art}


def _claim(ns: Any, art: Any) -> Claim:
    body = read_body(art.binary, str(art.meta.key), ns.fingerprint)
    return Claim("program", ns.fingerprint, art.meta.digest, names=body.kernels)


def test_a_program_the_node_refused_is_never_loaded_by_the_quick_path(
        node_a: dict[str, Any], tmp_path: Path) -> None:
    """The node's book refused these very bytes (a verdict of an earlier run): the quick
    path must not load them, good as they are; the server quarantines them with one
    warning, without a child, and builds the program again; the next run loads that."""
    home = tmp_path / "b"
    put_local(home, node_a["ns"], node_a["art"])
    ProofBook(home).note(_claim(node_a["ns"], node_a["art"]), "refused on this node (test)")
    node_env = env(home, tmp_path / "b-pocl")
    first = run(tmp_path, node_env)
    assert first.returncode == 0 and first.ok, first
    assert first.counts["compiled"] == 1 and first.counts["loaded"] == 0, first
    assert len(first.warnings) == 1 and "refused on this node (test)" in first.warnings[0]
    again = run(tmp_path, node_env)
    assert again.ok and again.warnings == [] and again.counts["loaded"] == 1, again


def test_a_program_the_node_never_proved_is_proven_before_the_quick_path_loads_it(
        node_a: dict[str, Any], tmp_path: Path) -> None:
    """No verdict and no plan (nothing to prove ahead): the server proves it in its
    child; the verdict then lets the next run's quick path load it."""
    home = tmp_path / "b"
    put_local(home, node_a["ns"], node_a["art"])
    claim = _claim(node_a["ns"], node_a["art"])
    book = ProofBook(home)
    assert book.verdict(claim) is None
    first = run(tmp_path, env(home, tmp_path / "b-pocl"))
    assert first.ok and first.warnings == [] and first.counts["loaded"] == 1, first
    assert book.verdict(claim) == ""


def _crashing(binary: bytes) -> bytes:
    """``binary`` with one bit flipped in its code, renamed by its content again (as the
    farm names what it stores), so that it walks and only a load can tell: PoCL aborts
    loading it (SIGABRT in LLVM)."""
    from farm.compilation.poclbin import rewrite

    out = bytearray(binary)
    out[400] ^= 0x10
    return rewrite(bytes(out), frozenset())


@pytest.mark.integration
def test_a_binary_that_crashes_the_prover_ahead_is_refused_by_the_applications_own_child(
        node_a: dict[str, Any], tmp_path: Path, minio_server: Any) -> None:
    """A node stored the program and the application's plan in MinIO; the program is then
    cut short there (digest made to match). A fresh node's prover ahead dies on it and
    keeps no verdict; the application's server proves it in its own child, which keeps
    the crash: quarantined, one warning, built again; a fresh node then loads the repair,
    proven ahead."""
    from farm.core.settings import Settings
    from farm.store import open_store

    bucket = f"t30-{uuid.uuid4().hex[:12]}"
    filler = run(tmp_path, env(tmp_path / "filler", tmp_path / "f-pocl", minio_server, bucket))
    assert filler.ok and filler.counts["compiled"] == 1, filler
    store = open_store(Settings(
        minio_endpoint=minio_server.endpoint, minio_access_key=minio_server.access_key,
        minio_secret_key=minio_server.secret_key, minio_bucket=bucket), shared=True,
        signed=False)
    ns, art = node_a["ns"], node_a["art"]
    try:
        plans = [k for k in store.keys(ns) if (a := store.get(ns, k)) is not None
                 and a.meta.family == PLAN_FAMILY]
        assert len(plans) == 1
        good = store.get(ns, art.meta.key)
        assert good is not None
        bad = with_binary(good, _crashing(device_binary(good.binary)))
        store.delete(ns, art.meta.key)
        store.put(ns, bad)
        home = tmp_path / "b"
        first = run(tmp_path, env(home, tmp_path / "b-pocl", minio_server, bucket))
        assert first.returncode == 0 and first.ok, first.stderr[-3000:]
        assert len(first.warnings) == 1 and "crashed" in first.warnings[0], first.warnings
        assert [q.artifact.meta.digest for q in store.quarantined(ns)] == [bad.meta.digest]
    finally:
        store.close()
    fresh = run(tmp_path, env(tmp_path / "c", tmp_path / "c-pocl", minio_server, bucket))
    assert fresh.ok and fresh.warnings == [] and fresh.counts["loaded"] == 1, fresh


def test_the_prover_ahead_keeps_its_marks_in_the_book_of_this_proof_version() -> None:
    """``farm run``'s own process starts the prover without importing the proofs' module:
    the book's folder is named twice, and must be one folder."""
    from farm.compilation.proofs import PROOF_VERSION
    from farm.programs.ahead import BOOK

    assert BOOK == str(Path("proofs") / f"v{PROOF_VERSION}")
