"""The quick path: a served build answered from a stored, proven program with the
standard library.

A served application's builds are, on every node but the first, loads of binaries the
store holds. What the full program server (:mod:`farm.programs.serve`) needs for one,
pydantic models, pydantic-settings, the MinIO SDK, the records session, costs a process
0.3 to 0.5 s of imports, paid before its first build; the loads themselves cost
milliseconds. So the hook (:mod:`farm.programs.hook`) asks this path first, and it
answers a build only when everything about it is plain:

1. the build's key (:func:`farm.programs.program_key.program_id_of`) and each device's
   fingerprint (:mod:`farm.core.fingerprint`);
2. the stored program for each fingerprint from this process's memory, else the node's
   local tier, else MinIO (:mod:`farm.programs.rows`: key, family, size and digest
   checked), read as a **body** (:mod:`farm.programs.headers`: it names this key and
   device, and its kernels), exactly as the server reads it;
3. **the trust rule** (docs/SECURITY.md): the program is used only when the node's proof
   book (:class:`~farm.compilation.proofs.ProofBook`) already holds a good verdict for
   exactly those bytes and those kernels (a ``stat``); a verdict the prover ahead of this
   application (:mod:`farm.programs.ahead`) is about to write is waited for;
4. on PoCL's CPU drivers, the program's work-group function records, each read as the
   server reads it and used only with a good verdict for it merged into that program
   (:mod:`farm.programs.quick_pocl`), merged into its binary, and what its launches make
   harvested;
5. the application's program made from those binaries (:mod:`farm.programs.assemble`),
   holding exactly the kernels the body names (:func:`farm.compilation.load.
   program_kernels`), and what MinIO served kept in the local tier once it loaded.

It declines (and the server, imported then, does the build) whenever anything is not:
a key or a stored row it does not read as expected, a miss in every tier, a program or
record the node has not proven (the server proves it, in a child with a private driver
cache) or has refused (the server quarantines it, says so, and builds it again), a
binary the device refuses, signing configured (the server verifies signatures), a
capture asked, a setting it does not parse. What it served is counted like the server's
loads and handed to the server as observed records if one is made later
(:meth:`farm.programs.serve.ProgramServer.adopt`).

A store that does not answer is waited out :data:`~farm.programs.rows.
APP_OUTAGE_LIMIT_S` at most; then the farm is unavailable for the rest of the process,
said once by the hook, and every later build is built the plain way
(:class:`~farm.programs.rows.Unavailable`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from farm.compilation.proofs import Claim, ProofBook
from farm.core.keys import PROGRAM_FAMILY
from farm.core.outcomes import Fate
from farm.programs.exactly import body_exactly
from farm.programs.headers import BodyError, BodyView
from farm.programs.program_key import PROGRAM_BUILD_ID, Unserved, program_id_of
from farm.programs.rows import Config, Row, Rows, Unchecked

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TypeAlias

    import pyopencl as cl

    #: the options pyopencl's ``Program.build`` takes
    BuildOptions: TypeAlias = str | Sequence[str] | None

    from farm.programs.ahead import Ahead
    from farm.programs.counts import RunCounts
    from farm.programs.prepared import Prepared
    from farm.programs.quick_pocl import Records
    from farm.store.base import ArtifactStore

#: what a program the quick path served leaves for the records: (key id, seconds, why
#: machine code was not used)
Observed = tuple[str, float, str]


class _Served:
    """One program for one fingerprint as this process serves it."""

    __slots__ = ("body", "digest", "prepared", "row", "source_hash")

    def __init__(self, row: Row, meta: dict[str, object], body: BodyView,
                 prepared: Prepared | None) -> None:
        #: the stored artifact, its digest, its ``source_hash`` (its spec's digest: a
        #: harvest names it)
        self.row, self.digest = row, str(meta["digest"])
        source_hash = meta.get("source_hash", "")
        self.source_hash = source_hash if isinstance(source_hash, str) else ""
        self.body, self.prepared = body, prepared

    @property
    def binary(self) -> bytes:
        """What the application loads."""
        return self.prepared.binary if self.prepared is not None else self.body.binary


class QuickPath:
    """The quick path of one process (see the module docstring). Thread-safe."""

    def __init__(self, counts: RunCounts, harvest_store: Callable[[], ArtifactStore],
                 warn: Callable[[str], None], env: dict[str, str] | None = None) -> None:
        """``harvest_store``: the store a harvest writes what PoCL's launches made to
        (the server's, opened then); ``warn``: how a warning line is said."""
        self.counts = counts
        self.config = Config(dict(os.environ if env is None else env))
        self.rows = Rows(self.config)
        self.book = ProofBook(Path(self.config.home))
        #: the prover ahead of this application, if one was started (the hook's)
        self.ahead: Ahead | None = None
        #: what each build was, per fingerprint, for the application's plan
        self.built: Callable[[str, str], None] = lambda fingerprint, key: None
        self._harvest_store = harvest_store
        self._warn = warn
        self._lock = threading.Lock()
        self._devices: dict[int, tuple[str, str, bool]] = {}
        #: (fingerprint, key id) -> the program as served before
        self._memory: dict[tuple[str, str], _Served] = {}
        self._records: Records | None = None
        self._observed: list[Observed] = []

    # -- the hook's entry point -------------------------------------------------------------
    def build(self, program: cl.Program, options: BuildOptions,
              devices: Sequence[cl.Device] | None) -> bool:
        """Serve ``program.build(options, devices)`` from stored, proven programs;
        ``False`` when this path declines (nothing was done),
        :class:`~farm.programs.rows.Unavailable` when the store did not answer."""
        if self.config.declined:
            return False
        ctx = program._context
        devs = list(devices) if devices is not None else list(ctx.devices)
        found = [self._device(d) for d in devs]
        options_bytes, _ = program._process_build_options(ctx, options)
        raw = program._source
        source = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
        start = time.perf_counter()
        try:
            key = program_id_of(source, options_bytes, os.getcwd())
        except Unserved:
            return False  # the server says why, once
        served: dict[str, _Served] = {}
        for fingerprint, _, at_launch in found:
            if fingerprint not in served:
                got = self._served(fingerprint, key, at_launch)
                if got is None:
                    return False
                served[fingerprint] = got
        from farm.compilation.load import program_kernels
        from farm.core.errors import LoadError
        from farm.programs.assemble import assemble, escaped_log, put_in_place

        try:
            assembled = assemble(ctx, devs, [served[fp].binary for fp, _, _ in found],
                                 options_bytes, [arch for _, arch, _ in found])
        except LoadError:
            return False  # the server warns, and builds it the plain way
        names = sorted(program_kernels(assembled.program))
        if any(names != sorted(got.body.kernels) for got in served.values()):
            return False  # not what was proven: the server's to say
        self._loaded(key, served, assembled.program)
        seconds = time.perf_counter() - start
        put_in_place(program, assembled.program,
                     {d.int_ptr: escaped_log(served[fp].body.log)
                      for d, (fp, _, _) in zip(devs, found, strict=True)},
                     loaded=True, seconds=seconds)
        self.counts.bump("programs")
        self.counts.bump(Fate.LOADED)
        with self._lock:
            self._observed.append((key, seconds, assembled.native_fallback))
        return True

    def _loaded(self, key: str, served: dict[str, _Served], handle: object) -> None:
        """What follows a load: memory, the local tier kept, the harvest, the plan."""
        for fingerprint, got in served.items():
            self._memory[(fingerprint, key)] = got
            self.built(fingerprint, key)
            if got.row.remote:
                got.row = got.row._replace(remote=False)
                self.rows.keep(fingerprint, key, PROGRAM_BUILD_ID, got.row)
            prep = got.prepared
            if prep is not None and self._records is not None:
                for _, (rec_id, row) in prep.fills:
                    self.rows.keep(fingerprint, rec_id, PROGRAM_BUILD_ID, row)
                prep.fills = []
                self._records.watch(fingerprint, key, prep, got.source_hash, got.digest,
                                    handle)

    def _served(self, fingerprint: str, key: str, at_launch: bool) -> _Served | None:
        """The program for ``fingerprint`` as this process may load it, or ``None`` to
        decline (see the module docstring)."""
        held = self._memory.get((fingerprint, key))
        if held is not None:
            return held
        try:
            found = self.rows.read(fingerprint, key, PROGRAM_BUILD_ID, PROGRAM_FAMILY)
        except Unchecked:
            return None
        if found is None:
            return None
        row, meta = found
        digest = str(meta["digest"])
        try:
            body = body_exactly(row.binary, f"{key}.{PROGRAM_BUILD_ID}", fingerprint)
        except BodyError:
            return None  # the server refuses it, quarantines it and says so
        claim = Claim("program", fingerprint, digest, names=body.kernels)
        if self.verdict(claim, key) != "":
            return None
        prepared = None
        if at_launch and self.config.pocl_ready:
            prepared = self._ready(fingerprint, key, body, digest)
            if prepared is None:
                return None
        return _Served(row, meta, body, prepared)

    def verdict(self, claim: Claim, key: str) -> str | None:
        """The node's verdict on ``claim`` ("" proven, why refused, ``None`` unknown),
        waiting for the prover ahead where it is proving ``key`` now."""
        known = self.book.verdict(claim)
        if known is None and self.ahead is not None:
            known = self.ahead.wait(lambda: self.book.verdict(claim), claim.fingerprint, key)
        return known

    def _ready(self, fingerprint: str, key: str, body: BodyView, digest: str
               ) -> Prepared | None:
        """On PoCL's CPU drivers, the body's binary with its proven work-group function
        records merged (:mod:`farm.programs.quick_pocl`); ``None`` to decline."""
        if self._records is None:
            from farm.programs.quick_pocl import Records

            self._records = Records(self.rows, self._harvest_store, self._warn, self.book)
        return self._records.prepare(fingerprint, key, body.binary, digest, self.verdict)

    def read_generated(self, key: str, build_id: str) -> bytes | None:
        """A stored artifact of generated code (:mod:`farm.programs.generated`) from the
        local tier or MinIO, verified; ``None`` when there is none (or it is not whole)."""
        from farm.programs.generated import GENERATED_FAMILY, GENERATED_NAMESPACE

        try:
            found = self.rows.read(GENERATED_NAMESPACE, key, build_id, GENERATED_FAMILY)
        except Unchecked:
            return None
        return None if found is None else found[0].binary

    def close(self) -> None:
        """What is left to keep in the local tier, and the last harvest of what PoCL's
        launches made (the process ends)."""
        self.rows.close()
        records, self._records = self._records, None
        if records is not None:
            records.close()

    def observed(self) -> list[Observed]:
        """What this path served so far, for the records (see the module docstring)."""
        with self._lock:
            return list(self._observed)

    def _device(self, dev: cl.Device) -> tuple[str, str, bool]:
        """(fingerprint, native architecture, compiles at launch) of a device, once."""
        known = self._devices.get(dev.int_ptr)
        if known is None:
            from farm.core.fingerprint import (
                compiles_at_launch,
                device_identity,
                fingerprint_of,
            )

            identity = device_identity(dev)
            known = self._devices[dev.int_ptr] = (
                fingerprint_of(identity), identity.get("native_arch", ""),
                compiles_at_launch(identity["platform_name"], identity["device_name"]))
        return known
