"""Serving one ``pyopencl.Program.build`` from the farm, on the application's own context.

For a build the hook hands over (:mod:`farm.programs.hook`), per group of the build's
devices that share a fingerprint, in order:

1. **memory**: this process already served the key (pyopencl rebuilds the same source);
2. **the store tiers**, front to back (the environment's SQLite file, then MinIO): each
   verifies the digest, and the program (with its work-group function records) is proven
   on this node before the application loads it (:mod:`~farm.programs.proving`: its body
   names this program and device; a child process with a private driver cache loads it;
   the node keeps the verdict); one refused is quarantined in its tier, said once, and
   the next tier asked, then the compile below; a later tier's hit is copied forward
   only after it loaded;
3. **compile here**: the farm's own compile path (:func:`~farm.compilation.finalize.
   finalize_and_validate` on the application's context and device: the native linker on
   NVIDIA), then the application's own load of the binary validates it, and only then
   the store, first writer wins; the source and its headers go into the store as blobs,
   so the cluster can build the program for other devices from their digests.

On PoCL's CPU drivers the work-group functions stored beside the program
(:mod:`~farm.programs.supplements`) are merged into its binary, so the first launch of
a geometry some node already ran compiles nothing; and the functions this process's
launches make are stored for the next node (:mod:`~farm.programs.harvest`).

Then the program is made from the binaries for every device of the build
(:mod:`~farm.programs.assemble`), and put into the application's ``Program``. Each
program obtained is recorded in the process's records session (family ``program``).

**Never break the application.** A source the compiler refuses is built again by
pyopencl itself, which raises its own error (same type, code and build log): the farm
never invents one. When the farm cannot help (options it cannot key, a store or
service that fails), the program is built the plain way and one warning line says why; a
store that failed once is not asked again in this process (an outage would otherwise
stall every build). A stored program that is refused is built again by the farm from
the source the application just gave, and the repair stored. A stored build log is shown
escaped (:func:`~farm.programs.assemble.escaped_log`).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from farm.compilation.load import program_kernels
from farm.core.device import DeviceInfo, info_from_device
from farm.core.errors import FarmError, LoadError, StoreError
from farm.core.gcpause import cyclic_gc_paused
from farm.core.generation import GenerationCache
from farm.core.keys import PROGRAM_FAMILY, Namespace
from farm.core.model import Artifact, Key, Lowered
from farm.core.outcomes import Fate, Outcome
from farm.core.settings import Settings, load_settings
from farm.programs.assemble import Assembled, assemble, escaped_log, put_in_place
from farm.programs.counts import RunCounts
from farm.programs.harvest import Harvester
from farm.programs.plain import build_plain, driver_output_held, unavailable, warn, why
from farm.programs.prepared import Pair, Prepared
from farm.programs.program_key import PROGRAM_BUILD_ID, Unserved
from farm.programs.proving import UNSTORED, Got, Proving, compiled_here
from farm.programs.rows import APP_ATTEMPT_S, APP_OUTAGE_LIMIT_S, app_waiter
from farm.programs.spec import Described, describe
from farm.programs.supplements import READ_AHEAD, SlotReader, fill_front
from farm.records.model import Trip
from farm.store.base import ArtifactStore, PutResult
from farm.store.tiers import tiers_of

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import pyopencl as cl

    from farm.programs.capture import CaptureLog
    from farm.programs.quick import Observed
    from farm.programs.remote import Remote
    from farm.records import Recorder

#: the tier index :meth:`ProgramServer._obtain` gives a binary compiled here, not stored
_UNSTORED = -1

#: what the farm's own machinery raises when it cannot help
_CANNOT_HELP = (FarmError, OSError, sqlite3.Error)

PlainBuild = Callable[[], "cl.Program"]


class _CompileRefused(Exception):
    """The platform compiler refused the source: pyopencl must say so itself."""


@dataclass(frozen=True)
class Served:
    """What the farm made of one build."""

    assembled: Assembled
    outcome: Outcome
    log: dict[int, str]  # device int_ptr -> the source build's log
    seconds: float


class ProgramServer:
    """Serves program builds for one process. Thread-safe; opens its store and records
    session at the first build (an application that builds nothing pays nothing)."""

    def __init__(self, settings: Settings | None = None, *,
                 store: ArtifactStore | None = None, recorder: Recorder | None = None,
                 label: str = "", capture: CaptureLog | None = None,
                 counts: RunCounts | None = None) -> None:
        self.settings = settings
        #: the hook's counts when it made this server after its quick path served some
        self.counts = counts if counts is not None else RunCounts()
        self.capture = capture
        self._store = store
        self._recorder = recorder
        self._owns = store is None, recorder is None
        self._label = label or f"program hook {os.path.basename(sys.argv[0] or 'python')}"
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, Key], threading.Lock] = {}
        #: per (fingerprint, key): the program as served (proven, records merged)
        self._memory: GenerationCache[tuple[str, Key], Got] = GenerationCache()
        self._proofs: Proving | None = None
        self._harvester: Harvester | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._devices: dict[int, DeviceInfo] = {}
        self._broken = ""
        self._warned: set[str] = set()
        self._blobs_put: set[str] = set()
        self._remote: Remote | None = None
        #: told of each program served or compiled, per fingerprint (the hook's plan)
        self.built: Callable[[str, str], None] = lambda fingerprint, key: None
        if capture is not None:  # the launches it records: what the harvest saw (PoCL)
            capture.follow(self._launched)

    # -- the hook's entry point -------------------------------------------------------------
    def build(self, program: Any, options: Any,
              devices: Sequence[cl.Device] | None, plain: PlainBuild) -> cl.Program:
        """Serve ``program.build(options, devices)``; ``plain()`` is pyopencl's own."""
        ctx = program._context
        options_bytes, _ = program._process_build_options(ctx, options)
        raw = program._source
        source = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
        self.counts.bump("programs")
        devs = list(devices) if devices is not None else list(ctx.devices)
        described: Described | None = None
        try:
            described = describe(source, options_bytes, os.getcwd())
            if self._broken:  # said once, when it broke
                result = self._fallback(plain, "")
            else:
                served = self._serve(ctx, devs, described)
                _install(program, served, options_bytes)
                self.counts.bump(Fate.LOADED if served.outcome is Outcome.LOADED
                                 else Fate.COMPILED)
                result = program
        except _CompileRefused:
            return self._refused(plain)
        except Unserved as exc:
            return self._fallback(plain, f"{exc}; built the plain way")
        except _CANNOT_HELP as exc:
            result = self._cannot_help(plain, exc)
        if self.capture is not None and described is not None:  # built, served or not
            self.capture.add(described, [self._info(d).fingerprint for d in devs])
        return result

    @property
    def broken(self) -> str:
        """Why the farm is unavailable for the rest of this process ("" while it is not)."""
        return self._broken

    def _cannot_help(self, plain: PlainBuild, exc: BaseException) -> cl.Program:
        reason = why(exc)
        if isinstance(exc, LoadError):  # this program's binary: the next may load
            return self._fallback(plain, f"the farm could not serve a program ({reason}); "
                                         "built the plain way")
        self._broken = reason
        return self._fallback(plain, unavailable(reason))

    def close(self) -> None:
        """Store what the watched programs' launches made (PoCL), then close the store
        and recorder this server opened."""
        harvester, self._harvester = self._harvester, None
        if harvester is not None:
            harvester.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        proofs, self._proofs = self._proofs, None
        if proofs is not None:
            proofs.close()
        with self._lock:
            if self._remote is not None:
                self._remote.close()
                self._remote = None
            if self._recorder is not None and self._owns[1]:
                self._recorder.close()
                self._recorder = None
            if self._store is not None and self._owns[0]:
                self._store.close()
                self._store = None

    # -- outcomes ------------------------------------------------------------------------------
    def _refused(self, plain: PlainBuild) -> cl.Program:
        """pyopencl builds it itself: its error (or, if it disagrees, its program)."""
        return self._fallback(plain, "", after="the farm's compile failed where pyopencl's "
                              "succeeded; built the plain way")

    def _fallback(self, plain: PlainBuild, why: str, *, after: str = "") -> cl.Program:
        """Build the plain way; ``why`` is the warning line said first ("": said already),
        ``after`` one said only once the plain build succeeded."""
        if why:
            self._warn(why)
        result = build_plain(plain, self.counts)
        if after:
            self._warn(after)
        return result

    def _warn_once(self, what: str, text: str) -> None:
        """``text``, the first time something of kind ``what`` is said in this run."""
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        self._warn(text)

    def _warn(self, text: str) -> None:
        with self._lock:
            if text in self._warned:
                return
            self._warned.add(text)
        warn(text)

    # -- obtaining -----------------------------------------------------------------------------
    def _serve(self, ctx: cl.Context, devs: list[cl.Device], described: Described) -> Served:
        start = time.perf_counter()
        key = described.spec.key
        binaries: list[bytes] = []
        logs: dict[int, str] = {}
        outcome = Outcome.LOADED
        by_fp: dict[str, Got] = {}
        infos: dict[str, DeviceInfo] = {}
        for dev in devs:
            info = infos.setdefault(self._info(dev).fingerprint, self._info(dev))
            got = by_fp.get(info.fingerprint)
            if got is None:
                got = by_fp[info.fingerprint] = self._obtain(ctx, dev, info, described)
                if got.outcome is Outcome.COMPILED:
                    outcome = got.outcome
            binaries.append(got.binary)
            logs[dev.int_ptr] = escaped_log(got.body.log)
        archs = [self._info(d).native_arch for d in devs]
        assembled = assemble(ctx, devs, binaries, described.options, archs)
        names = sorted(program_kernels(assembled.program))
        for fp, got in by_fp.items():
            if got.tier == UNSTORED:  # it loaded: now it may be stored
                if not self._keep(infos[fp], described, got, names):
                    got.prepared = None  # another binary won: harvest for that one
        seconds = time.perf_counter() - start
        for fp, got in by_fp.items():
            self.built(fp, key.id_hash)
            ns = Namespace.for_fingerprint(fp)
            self._fill_front(ns, got.art, got.tier)
            if got.prepared is not None and self._settings().pocl_ready:
                fill_front([] if self._broken else tiers_of(self.store), ns,
                           got.prepared.fills)
                got.prepared.fills = []
                self._watch(ns, key, got.prepared, got.art, assembled.program)
        self._record(key, outcome, seconds, described, assembled.native_fallback)
        return Served(assembled, outcome, logs, seconds)

    def _reader(self, info: DeviceInfo, key: Key) -> SlotReader | None:
        """A reader of the program's work-group function records, its first slots on
        their way while the program is fetched (PoCL's CPU drivers)."""
        if not info.compiles_at_launch or not self._settings().pocl_ready or self._broken:
            return None
        with self._lock:
            if self._pool is None:
                # imported here: a server made at the process's exit (a harvest, the
                # generated code's store) cannot import it then (it registers an atexit)
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(2 * READ_AHEAD,
                                                thread_name_prefix="kernel-farm records")
            pool = self._pool
        return SlotReader(tiers_of(self.store), Namespace.for_fingerprint(info.fingerprint),
                          key, pool)

    def _watch(self, ns: Namespace, key: Key, prep: Prepared, art: Artifact,
               handle: object) -> None:
        book = self._proving().book  # (takes the server's lock)
        with self._lock:
            if self._harvester is None:
                self._harvester = Harvester(self._harvest_store, self._warn, book=book)
            harvester = self._harvester
        harvester.watch(ns, str(key), prep, art.meta.source_hash, handle, art.meta.digest)

    def _launched(self) -> dict[tuple[str, str], set[Pair]]:
        """Each watched program's work-group functions (:meth:`Harvester.launched`)."""
        with self._lock:
            harvester = self._harvester
        return harvester.launched() if harvester is not None else {}

    def _harvest_store(self) -> ArtifactStore:
        if self._broken:
            raise StoreError(f"the farm is unavailable ({self._broken})")
        return self.store

    def _obtain(self, ctx: cl.Context, dev: cl.Device, info: DeviceInfo,
                described: Described) -> Got:
        """The program for ``dev``'s fingerprint: from memory, else the first store tier
        holding one this node proves (:mod:`farm.programs.proving`; what is refused is
        quarantined and said once), else the cluster's compile, else a compile here
        (stored once the application's load validated it)."""
        key = described.spec.key
        mkey = (info.fingerprint, key)
        with self._key_lock(mkey):
            got = self._memory.get(mkey)
            if got is not None:
                return dataclasses.replace(got, outcome=Outcome.LOADED, tier=0)
            proving = self._proving()
            proving.start_early(info)
            tiers = tiers_of(self.store)
            got = proving.stored(info, key, tiers, self._reader(info, key), self._warn_once)
            if got is None:
                art = self._on_cluster(info, described)  # stored by a worker: proven too
                got = proving.served(info, key, art, len(tiers) - 1, tiers, None,
                                     self._warn_once) if art is not None else None
                got = got or self._compile(ctx, dev, info, described)
                got.outcome = Outcome.COMPILED
            self._memory.put(mkey, got)
            return got

    def _proving(self) -> Proving:
        with self._lock:
            if self._proofs is None:
                self._proofs = Proving(self._settings().home)
            return self._proofs

    def _fill_front(self, ns: Namespace, art: Artifact, served_by: int) -> None:
        """Copy what a later tier served into the tiers in front of it, after it loaded
        (a binary this device refused is never copied)."""
        for front in tiers_of(self.store)[:max(served_by, 0)]:
            try:
                front.store.put(ns, art)
            except _CANNOT_HELP as exc:
                self._warn(f"could not keep a program in {front.store.location} "
                           f"({' '.join(str(exc).split())[:200]})")

    def _on_cluster(self, info: DeviceInfo, described: Described) -> Artifact | None:
        """The cluster's compile (``FARM_PROGRAMS_ON_MISS=farm``), or ``None``."""
        settings = self._settings()
        if settings.programs_on_miss != "farm" or not settings.redis_url \
                or not described.spec.portable:
            return None
        from farm.programs.remote import Remote, RemoteRefused

        store = self.store
        with self._lock:
            if self._remote is None:
                self._remote = Remote(_capped(settings), store)
            remote = self._remote
        try:
            return remote.build(info.fingerprint, described)
        except RemoteRefused as exc:
            raise _CompileRefused(str(exc)) from None

    def _compile(self, ctx: cl.Context, dev: cl.Device, info: DeviceInfo,
                 described: Described) -> Got:
        """Compile here; the binary is not loaded here (the application's load that
        follows validates it, and :meth:`_keep` stores it then)."""
        # the compile path loads only in a process that compiles (a served one never does)
        from farm.compilation.finalize import RawSource, finalize_and_validate

        settings = self._settings()
        with driver_output_held() as held:  # said once: see farm.programs.plain
            built = finalize_and_validate(ctx, dev, RawSource(described.source,
                                                              described.options),
                                          "auto" if settings.native_binaries else None,
                                          ready=settings.pocl_ready, validate=False)
            held.keep = built.ok or built.error_kind != "compile"
        if not built.ok:
            if built.error_kind == "compile":
                raise _CompileRefused(built.error)
            raise LoadError(built.error)
        return compiled_here(info, described.spec.key, described.spec.blob_digest, built)

    def _keep(self, info: DeviceInfo, described: Described, got: Got,
              names: list[str]) -> bool:
        """Store a binary compiled here that the application loaded, holding the kernels
        its body names: the sources first (see the docstring), then the artifact, first
        writer wins. False when another process's binary was there first."""
        if not got.storable or names != sorted(got.body.kernels):
            return False
        store = self.store
        for digest, data in described.blobs().items():
            if digest not in self._blobs_put:
                store.put_blob(data)
                self._blobs_put.add(digest)
        kept = store.put(Namespace.for_fingerprint(info.fingerprint), got.art)
        if kept is PutResult.REFUSED:
            return False
        self._proving().note_compiled(info, got.art, got.body.kernels)
        return True

    def adopt(self, observed: Sequence[Observed]) -> None:
        """Record the loads the hook's quick path served before this server existed, as
        if this server had served them (they are written with the session, if anything
        of this process changes the environment)."""
        for id_hash, seconds, fallback in observed:
            self._record(Key(id_hash=id_hash, build_id=PROGRAM_BUILD_ID), Outcome.LOADED,
                         seconds, None, fallback)

    def _record(self, key: Key, outcome: Outcome, seconds: float, described: Described | None,
                native_fallback: str) -> None:
        code = None if outcome is Outcome.LOADED or described is None else Lowered(
            source=described.source.decode("utf-8", "replace"),
            options=described.spec.options, kernel_names=())
        try:
            self.recorder.compilation(Trip(family=PROGRAM_FAMILY, key=key, outcome=outcome,
                                           work_s=seconds, native_fallback=native_fallback),
                                      code)
        except _CANNOT_HELP as exc:  # records never break a build
            self._warn(f"could not record a program ({' '.join(str(exc).split())[:200]})")

    # -- state -----------------------------------------------------------------------------------
    def _key_lock(self, mkey: tuple[str, Key]) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(mkey, threading.Lock())

    def _info(self, dev: cl.Device) -> DeviceInfo:
        info = self._devices.get(dev.int_ptr)
        if info is None:
            info = self._devices[dev.int_ptr] = info_from_device(0, 0, dev)
        return info

    def _settings(self) -> Settings:
        if self.settings is None:
            self.settings = load_settings()
        return self.settings

    @property
    def store(self) -> ArtifactStore:
        with self._lock:
            if self._store is None:
                with cyclic_gc_paused():  # imports the MinIO SDK: see farm.core.gcpause
                    from farm.store import open_store

                    settings = _store_settings(self._settings())
                    self._store = open_store(settings, remote_reads=app_waiter(
                        f"MinIO at {settings.minio_endpoint}"))
            return self._store

    @property
    def recorder(self) -> Recorder:
        with self._lock:
            if self._recorder is None:
                with cyclic_gc_paused():
                    from farm.records.open import open_recorder

                    self._recorder = open_recorder(self._settings(), self._label)
            return self._recorder


def _capped(settings: Settings) -> Settings:
    """``settings`` with outages waited out :data:`APP_OUTAGE_LIMIT_S` at most."""
    return settings.model_copy(update={
        "outage_limit": min(settings.outage_limit, APP_OUTAGE_LIMIT_S)})


def _store_settings(settings: Settings) -> Settings:
    """:func:`_capped`, and each request to the store bounded by :data:`APP_ATTEMPT_S`,
    so that a store that stops answering is given up within the wait (a request blocked
    for the default socket timeout alone would outlast it)."""
    return _capped(settings).model_copy(update={
        "socket_timeout": min(settings.socket_timeout, APP_ATTEMPT_S)})


def _install(program: Any, served: Served, options: bytes) -> None:
    """Make ``program`` what pyopencl's build would have made (see ``assemble``)."""
    put_in_place(program, served.assembled.program, served.log,
                 loaded=served.outcome is Outcome.LOADED, seconds=served.seconds)
