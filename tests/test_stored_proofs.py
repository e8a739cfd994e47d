"""One proof for every stored binary (issue 29), on the local PoCL device: the node's
book of verdicts, the child's private driver cache, a family's binary of any origin, and
an application's program fuzzed in this very process (the proof runs in a child, so no
case may take this process down, serve a wrong value or stay unrepaired).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from served_apps import device_binary, flipped, source, with_binary
from test_trust import built_store, farm_cli, put_damaged, truncated, two_kernels

from farm.core.device import probe_devices, select_device
from farm.core.model import Artifact
from farm.store import SQLiteStore


def test_the_book_keeps_definite_verdicts_by_what_was_proven(tmp_path: Path) -> None:
    from farm.compilation.proofs import Claim, ProofBook, Prover
    from farm.compilation.verdict import Verdict

    book = ProofBook(tmp_path)
    claim = Claim("program", "pocl-x", "a" * 64, names=("f",))
    assert book.verdict(claim) is None and not book.holds("pocl-x")
    book.note(claim, "")
    assert book.verdict(claim) == "" and book.holds("pocl-x")
    other = Claim("program", "pocl-x", "a" * 64, names=("g",))  # other names: unknown
    assert book.verdict(other) is None
    book.note(other, "the driver crashed\nloading it")
    assert book.verdict(other) == "the driver crashed loading it"
    device = select_device(probe_devices(), None)
    prover = Prover(device, book)
    prover.note(Claim("family", device.fingerprint, "b" * 64), Verdict("no child", False))
    assert prover.known(Claim("family", device.fingerprint, "b" * 64)) is None
    assert ProofBook(None).verdict(claim) is None  # no home: nothing kept


def test_the_childs_driver_cache_is_private_and_goes_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load the driver dies in leaves its files in the child's own cache folder, which
    is removed with the child: never where the node's processes look (issue 29, item 6)."""
    from farm.compilation.validate import IsolatedValidator, Request

    device = select_device(probe_devices(), None)
    settings, ns, neg, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, neg)
    store.close()
    assert good is not None
    # the node's cache named only now: PoCL takes its folder once a process, when it
    # first starts there (the lines above, when no test before them used PoCL here), and
    # this process's PoCL must not be pointed at a folder this test then removes
    node_cache = tmp_path / "node-pocl"
    node_cache.mkdir()
    monkeypatch.setenv("POCL_CACHE_DIR", str(node_cache))
    with IsolatedValidator(device) as child:
        assert child.check(good.binary, Request()).ok
        private = child._cache
        assert private is not None and Path(private, "pocl").is_dir()
        crashed = child.check(truncated(good.binary, False), Request())
        assert crashed.definite and "crashed" in crashed.why
        assert not Path(private).exists()  # the crashed child's folder went with it
    assert [p for p in node_cache.rglob("*") if not p.name.startswith("tempfile_")] == []


@pytest.mark.parametrize("origin", ["compiled", "validated"])
def test_a_damaged_family_binary_of_any_origin_is_proven_before_a_load(
        tmp_path: Path, origin: str) -> None:
    """``origin`` is metadata any store writer sets: a damaged binary marked ``compiled``
    killed ``farm warm`` (only ``imported`` ones went through a child before)."""
    settings, ns, neg, _ = built_store(tmp_path)
    store = SQLiteStore(settings.store_path)
    good = store.get(ns, neg)
    store.close()
    assert good is not None
    put_damaged(settings, ns, neg, truncated(good.binary, False), origin=origin)
    warm = farm_cli(settings.home, "warm", str(two_kernels(tmp_path)), "--json",
                    "--no-launch")
    assert warm.returncode == 0, warm.stderr[-2000:]
    summary = json.loads(warm.stdout)["summary"]
    assert (summary["local"], summary["compiled"]) == (1, 1), summary
    store = SQLiteStore(settings.store_path)
    [entry] = store.quarantined(ns)
    assert entry.key == neg and "crashed" in entry.reason
    store.close()
    again = farm_cli(settings.home, "warm", str(two_kernels(tmp_path)), "--json",
                     "--no-launch")
    assert json.loads(again.stdout)["summary"]["local"] == 2


# -- an application's program, fuzzed in this process ---------------------------------------
def _mutations(good: Artifact, rng: random.Random) -> list[tuple[str, Artifact]]:
    """Hostile variants of a stored program, each with its digest made to match."""
    binary = device_binary(good.binary)
    out = []
    for i in range(12):
        cut = rng.randrange(1, len(binary))
        out.append((f"cut at {cut}", with_binary(good, binary[:cut])))
        at = rng.randrange(len(binary))
        out.append((f"bit flipped at {at}", with_binary(good, flipped(binary, at))))
        raw = bytearray(good.binary)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        out.append((f"stored bytes changed ({i})", Artifact.create(
            good.meta.key, good.meta.family, bytes(raw), good.meta.source_hash)))
    return out


def test_a_fuzzed_stored_program_never_takes_the_process_down(tmp_path: Path) -> None:
    """Whatever the stored bytes of a program are (cut, a flipped bit, any bytes of the
    body changed, the digest made to match), a build in this process gets the right
    program: the proof is a child's, and the key is repaired at once."""
    import pyopencl as cl

    from farm.core.settings import Settings
    from farm.programs.serve import ProgramServer
    from farm.store import MemoryStore

    ctx = cl.Context([next(d for p in cl.get_platforms() if "Portable" in p.name
                           for d in p.get_devices())])
    queue = cl.CommandQueue(ctx)
    src = source("twice_fuzz", 2)
    store = MemoryStore()
    settings = Settings(home=tmp_path / "home", device=None, records_url=None)
    server = ProgramServer(settings, store=store)
    server.build(cl.Program(ctx, src), None, None, lambda: pytest.fail("built plainly"))
    server.close()
    [ns] = store.namespaces()
    [key] = list(store.keys(ns))
    good = store.get(ns, key)
    assert good is not None
    refused = 0
    cases = _mutations(good, random.Random(29))
    for i, (what, bad) in enumerate(cases):
        store.delete(ns, key)
        store.put(ns, bad)
        server = ProgramServer(settings.model_copy(update={"home": tmp_path / f"n{i}"}),
                               store=store)
        program = cl.Program(ctx, src)
        server.build(program, None, None, lambda w=what: pytest.fail(f"{w}: built plainly"))
        x = np.arange(256, dtype=np.float32)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                        hostbuf=x)
        cl.Kernel(program, "twice_fuzz")(queue, (256,), None, buf)
        out = np.empty_like(x)
        cl.enqueue_copy(queue, out, buf)
        assert np.array_equal(out, 2 * x), what
        held = store.get(ns, key)
        counts = server.counts.snapshot()
        server.close()
        assert held is not None, what
        if counts["loaded"]:  # the proof let it through: it is the program, loadable
            assert held.meta.digest == bad.meta.digest, what
        else:  # refused: quarantined, the repair stored
            assert counts["compiled"] == 1 and held.meta.digest != bad.meta.digest, what
            refused += 1
    assert refused >= len(cases) // 2, f"only {refused} of {len(cases)} refused"
