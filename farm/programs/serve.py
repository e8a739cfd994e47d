"""Serving one ``pyopencl.Program.build`` from the farm, on the application's own context.

For a build the hook hands over (:mod:`farm.programs.hook`), per group of the build's
devices that share a fingerprint, in order:

1. **memory**: this process already served the key (pyopencl rebuilds the same source);
2. **the store tiers**, front to back (the environment's SQLite file, then MinIO): each
   verifies the digest; a later tier's hit is copied forward only after it loaded;
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
service that fails, a stored binary the device refuses), the program is built the plain
way and one warning line says why; a store that failed once is not asked again in this
process (an outage would otherwise stall every build).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from farm.compilation.native import unpack
from farm.core.device import DeviceInfo, info_from_device
from farm.core.errors import FarmError, LoadError, StoreError
from farm.core.gcpause import cyclic_gc_paused
from farm.core.generation import GenerationCache
from farm.core.keys import PROGRAM_FAMILY, Namespace
from farm.core.model import Artifact, Key, Lowered, Outcome
from farm.core.settings import Settings, load_settings
from farm.programs.assemble import Assembled, assemble, put_in_place
from farm.programs.counts import RunCounts
from farm.programs.harvest import Harvester
from farm.programs.plain import build_plain, driver_output_held, unavailable, warn, why
from farm.programs.program_key import PROGRAM_BUILD_ID, Unserved
from farm.programs.quick import APP_ATTEMPT_S, APP_OUTAGE_LIMIT_S, app_waiter
from farm.programs.spec import Described, describe
from farm.programs.supplements import READ_AHEAD, Prepared, SlotReader, fill_front, prepare
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
        self._memory: GenerationCache[tuple[str, Key], Artifact] = GenerationCache()
        #: per (fingerprint, key): the prepared binary, or (None,) where none applies
        self._prepared: GenerationCache[tuple[str, Key], tuple[Prepared | None]] = \
            GenerationCache()
        self._harvester: Harvester | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._devices: dict[int, DeviceInfo] = {}
        self._broken = ""
        self._warned: set[str] = set()
        self._blobs_put: set[str] = set()
        self._remote: Remote | None = None

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
                self.counts.bump("loaded" if served.outcome is Outcome.LOADED else "compiled")
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
        by_fp: dict[str, tuple[Artifact, int]] = {}
        prepared: dict[str, Prepared] = {}
        compiled: dict[str, Artifact] = {}  # compiled here: stored once it loaded
        stored: list[bytes] = []
        for dev in devs:
            info = self._info(dev)
            if info.fingerprint not in by_fp:
                reader = self._read_ahead(info, key)  # while the artifact is fetched
                art, got, tier = self._obtain(ctx, dev, info, described)
                by_fp[info.fingerprint] = art, max(tier, 0)
                if got is Outcome.COMPILED:
                    outcome = got
                if tier == _UNSTORED:
                    compiled[info.fingerprint] = art
                prep = self._prepare(info, key, art, reader)
                if prep is not None:
                    prepared[info.fingerprint] = prep
            art = by_fp[info.fingerprint][0]
            prep = prepared.get(info.fingerprint)
            binaries.append(prep.binary if prep is not None else art.binary)
            stored.append(art.binary)
            logs[dev.int_ptr] = art.meta.build_log
        archs = [self._info(d).native_arch for d in devs]
        try:
            assembled = assemble(ctx, devs, binaries, described.options, archs)
        except LoadError:
            if binaries == stored:
                raise
            self._warn("a program's stored work-group functions were refused; it is "
                       "loaded without them")
            assembled, prepared = assemble(ctx, devs, stored, described.options, archs), {}
        for fp, art in compiled.items():  # it loaded: now it may be stored
            if not self._keep(fp, described, art):
                prepared.pop(fp, None)  # another binary won: harvest for that one
        seconds = time.perf_counter() - start
        for fp, (art, tier) in by_fp.items():
            ns = Namespace.for_fingerprint(fp)
            self._fill_front(ns, art, tier)
            if fp in prepared:
                self._watch(ns, key, prepared[fp], art, assembled.program)
        self._record(key, outcome, seconds, described, assembled.native_fallback)
        return Served(assembled, outcome, logs, seconds)

    def _read_ahead(self, info: DeviceInfo, key: Key) -> SlotReader | None:
        """A reader of the program's work-group function records, its first slots on
        their way (PoCL's CPU drivers, the first time this process serves the key)."""
        if (not info.compiles_at_launch or not self._settings().pocl_ready or self._broken
                or self._prepared.get((info.fingerprint, key)) is not None):
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

    def _prepare(self, info: DeviceInfo, key: Key, art: Artifact,
                 reader: SlotReader | None) -> Prepared | None:
        """On PoCL's CPU drivers, ``art``'s binary with the work-group functions stored
        beside it (once per key in this process); ``None`` elsewhere."""
        if (not info.compiles_at_launch or not self._settings().pocl_ready
                or unpack(art.binary) is not None):
            return None
        mkey = (info.fingerprint, key)
        with self._key_lock(mkey):
            known = self._prepared.get(mkey)
            if known is not None:
                return known[0]
            ns = Namespace.for_fingerprint(info.fingerprint)
            tiers = [] if self._broken else tiers_of(self.store)
            prep = prepare(reader or SlotReader(tiers, ns, key), key, art.binary)
            if prep is not None and prep.ignored:  # said once a run: what and why
                self._warn_once("ignored", "work-group functions stored for a program were "
                                f"ignored ({prep.ignored[0]}); its first launches compile")
                fill_front(tiers, ns, prep.fills)
                prep.fills.clear()
            self._prepared.put(mkey, (prep,))
            return prep

    def _watch(self, ns: Namespace, key: Key, prep: Prepared, art: Artifact,
               handle: object) -> None:
        with self._lock:
            if self._harvester is None:
                self._harvester = Harvester(self._harvest_store, self._warn)
            harvester = self._harvester
        harvester.watch(ns, key, prep, art.meta.source_hash, handle)

    def _harvest_store(self) -> ArtifactStore:
        if self._broken:
            raise StoreError(f"the farm is unavailable ({self._broken})")
        return self.store

    def _obtain(self, ctx: cl.Context, dev: cl.Device, info: DeviceInfo,
                described: Described) -> tuple[Artifact, Outcome, int]:
        """The artifact for ``dev``'s fingerprint, how it was got, and the index of the
        store tier that served it (0 for memory and the cluster's compiles: nothing to
        copy; :data:`_UNSTORED` for a compile here, stored once the application's load
        validated it)."""
        key = described.spec.key
        mkey = (info.fingerprint, key)
        with self._key_lock(mkey):
            art = self._memory.get(mkey)
            if art is not None:
                return art, Outcome.LOADED, 0
            ns = Namespace.for_fingerprint(info.fingerprint)
            outcome, tier = Outcome.LOADED, 0
            for tier, stored in enumerate(tiers_of(self.store)):  # noqa: B007
                art = stored.store.get(ns, key)
                if art is not None:
                    break
            if art is None:
                outcome, art, tier = Outcome.COMPILED, self._on_cluster(info, described), 0
                if art is None:
                    art, tier = self._compile(ctx, dev, described), _UNSTORED
            self._memory.put(mkey, art)
            return art, outcome, tier

    def _fill_front(self, ns: Namespace, art: Artifact, served_by: int) -> None:
        """Copy what a later tier served into the tiers in front of it, after it loaded
        (a binary this device refused is never copied)."""
        for front in tiers_of(self.store)[:served_by]:
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

    def _compile(self, ctx: cl.Context, dev: cl.Device, described: Described) -> Artifact:
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
        return Artifact.create(described.spec.key, PROGRAM_FAMILY, built.binary,
                               described.spec.blob_digest, build_log=built.build_log,
                               host=built.host, worker=built.worker, work_s=built.work_s)

    def _keep(self, fingerprint: str, described: Described, art: Artifact) -> bool:
        """Store a binary compiled here that the application loaded: the sources first
        (see the docstring), then the artifact, first writer wins. False when another
        process's binary was there first."""
        store = self.store
        for digest, data in described.blobs().items():
            if digest not in self._blobs_put:
                store.put_blob(data)
                self._blobs_put.add(digest)
        return store.put(Namespace.for_fingerprint(fingerprint), art) is not PutResult.REFUSED

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
