"""The quick path: a served build answered from a stored binary with the standard library.

A served application's builds are, on every node but the first, loads of binaries the
store holds. What the full program server (:mod:`farm.programs.serve`) needs for one,
pydantic models, pydantic-settings, the MinIO SDK, the records session, costs a process
0.3 to 0.5 s of imports, paid before its first build; the loads themselves cost
milliseconds. So the hook (:mod:`farm.programs.hook`) asks this path first, and it
answers a build only when everything about it is plain:

1. the build's key (:func:`farm.programs.program_key.program_id_of`) and each device's
   fingerprint (:mod:`farm.core.fingerprint`);
2. the binary for each fingerprint from this process's memory, else the node's local tier
   (the environment's SQLite file, :mod:`farm.store.sqlite_file`), else MinIO (a signed
   GET, :mod:`farm.store.s3_get`), each checked against its digest, its key and its
   family before it is used (:func:`_checked`);
3. on PoCL's CPU drivers, the work-group function records stored beside the program
   merged into its binary, and what its launches make harvested
   (:mod:`farm.programs.quick_pocl`: the records' models are the first pydantic this
   process imports);
4. the application's program made from those binaries (:mod:`farm.programs.assemble`),
   and what MinIO served kept in the local tier once it loaded.

It declines (and the server, imported then, does the build) whenever anything is not:
a key or a stored row it does not read as expected, a miss in every tier, a binary the
device refuses, a record refused, signing configured (the server verifies signatures),
a capture asked, a setting it does not parse, a MinIO answer it does not expect. What it
served is counted like the server's loads and handed to the server as observed records
if one is made later (:meth:`farm.programs.serve.ProgramServer.adopt`); a process the
quick path served entirely writes no records, as a process that only loads writes none.

Trust: a binary is used only after its digest, its key and its family are checked, and
never when it was imported and not yet validated on this device (``origin``); a node's
cached verdict on a binary (:func:`_trusted`) is the place for any further check.

A store that does not answer is waited out :data:`APP_OUTAGE_LIMIT_S` at most (no
attempt starts that could end later: :class:`farm.core.outage.Waiter`); then the farm
is unavailable for the rest of the process, said once by the server, and every later
build is built the plain way (:class:`QuickUnavailable`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import namedtuple

from farm.core.hashing import sha256_hex
from farm.core.keys import PROGRAM_FAMILY, Namespace, artifact_object
from farm.programs.program_key import PROGRAM_BUILD_ID, Unserved, program_id_of

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import queue
    import sqlite3
    from collections.abc import Callable, Sequence
    from typing import Any, TypeAlias

    import pyopencl as cl

    #: the options pyopencl's ``Program.build`` takes
    BuildOptions: TypeAlias = str | Sequence[str] | None

    from farm.core.model import Artifact
    from farm.core.outage import Waiter
    from farm.programs.counts import RunCounts
    from farm.programs.prepared import Prepared
    from farm.programs.quick_pocl import Records, RowReader
    from farm.store.base import ArtifactStore
    from farm.store.s3_get import S3Reader

#: seconds a store outage is waited out inside an application (the farm's default of a
#: minute would stall the application; past this its programs are built the plain way)
APP_OUTAGE_LIMIT_S = 2.0
#: the longest one request to the store may take inside an application: half the wait,
#: so that a frozen store (no answer at all) is given up within it
APP_ATTEMPT_S = APP_OUTAGE_LIMIT_S / 2

#: seconds the process's end waits for the local tier to take what MinIO served
KEEP_S = 10.0

#: what a program the quick path served leaves for the records: (key id, seconds, why
#: machine code was not used)
Observed = tuple[str, float, str]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

#: a key as :func:`farm.core.keys.artifact_object` reads one, without the pydantic model
_Key = namedtuple("_Key", "id_hash build_id")
#: a stored program artifact as the quick path read it: its binary, its source build's
#: log, the spec's digest (a harvest names it), its metadata JSON, whether MinIO served it
_Stored = namedtuple("_Stored", "binary log source_hash meta remote")


class QuickUnavailable(Exception):
    """The store did not answer within :data:`APP_OUTAGE_LIMIT_S`; ``cause`` says why."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def app_waiter(what: str) -> Waiter:
    """The outage waiter of a store inside an application (see the module docstring):
    silent (the one line is the server's), and naming where the store is configured."""
    from farm.core.outage import Waiter

    waiter = Waiter(what, APP_OUTAGE_LIMIT_S, is_down=lambda exc: isinstance(exc, OSError),
                    say=lambda line: None, attempt_s=APP_ATTEMPT_S)
    waiter.limit_setting = "FARM_MINIO_ENDPOINT"
    return waiter


class _Config:
    """The settings the quick path reads (``FARM_*``), or why it leaves builds to the
    server (``declined``: a value it does not parse is the server's to report)."""

    def __init__(self, env: dict[str, str]) -> None:
        from farm.core.keys import DEFAULT_ENVIRONMENT, HOME_FOLDER, STORE_FILE

        self.declined = ""
        home = env.get("FARM_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
            HOME_FOLDER)  # as farm.core.settings makes FARM_HOME's default
        environment = env.get("FARM_ENVIRONMENT") or DEFAULT_ENVIRONMENT
        if "/" in environment or environment in (".", ".."):
            self.declined = "FARM_ENVIRONMENT"

        self.store_path = os.path.join(home, "envs", environment, STORE_FILE)
        self.pocl_ready = self._flag(env, "FARM_POCL_READY", True)
        if env.get("FARM_SIGNING_KEY") or env.get("FARM_VERIFY_KEY"):
            self.declined = "signing"
        self.minio: tuple[str, bool, str, str, str] | None = None
        endpoint = env.get("FARM_MINIO_ENDPOINT")
        if endpoint:
            from farm.store.s3_get import parse_endpoint

            access = env.get("FARM_MINIO_ACCESS_KEY")
            secret = env.get("FARM_MINIO_SECRET_KEY")
            bucket = env.get("FARM_MINIO_BUCKET")
            try:
                host, secure = parse_endpoint(
                    endpoint, self._flag(env, "FARM_MINIO_SECURE", False))
            except ValueError:
                host, secure = "", False
            if not (host and access and secret):
                self.declined = "FARM_MINIO_*"
            else:
                from farm.core.keys import DEFAULT_BUCKET

                self.minio = (host, secure, access, secret, bucket or DEFAULT_BUCKET)

    def _flag(self, env: dict[str, str], name: str, default: bool) -> bool:
        value = env.get(name, "").strip().lower()
        if not value:
            return default
        if value not in _TRUE + _FALSE:
            self.declined = name
        return value in _TRUE


class QuickPath:
    """The quick path of one process (see the module docstring). Thread-safe."""

    def __init__(self, counts: RunCounts, harvest_store: Callable[[], ArtifactStore],
                 warn: Callable[[str], None], env: dict[str, str] | None = None) -> None:
        """``harvest_store``: the store a harvest writes what PoCL's launches made to
        (the server's, opened then); ``warn``: how a warning line is said."""
        self.counts = counts
        self.config = _Config(dict(os.environ if env is None else env))
        self._harvest_store = harvest_store
        self._warn = warn
        self._lock = threading.Lock()
        self._devices: dict[int, tuple[str, str, bool]] = {}
        #: (fingerprint, key id) -> the stored artifact, as served before
        self._memory: dict[tuple[str, str], _Stored] = {}
        #: (fingerprint, key id) -> the binary with its records merged (PoCL)
        self._prepared: dict[tuple[str, str], Prepared] = {}
        #: fingerprint -> records MinIO served, to keep locally once their program loaded
        self._fills: dict[str, list[Artifact]] = {}
        self._records: Records | None = None
        self._observed: list[Observed] = []
        self._local: sqlite3.Connection | None = None
        self._local_tried = False
        self._remote: tuple[S3Reader, Waiter] | None = None
        #: rows to keep in the local tier, and the thread that writes them
        self._keeping: queue.SimpleQueue[tuple[str, str, str, str, str, bytes] | None]
        self._keeper: threading.Thread | None = None

    # -- the hook's entry point -------------------------------------------------------------
    def build(self, program: cl.Program, options: BuildOptions,
              devices: Sequence[cl.Device] | None) -> bool:
        """Serve ``program.build(options, devices)`` from stored binaries; ``False`` when
        this path declines (nothing was done), :class:`QuickUnavailable` when the store
        did not answer."""
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
        stored: dict[str, _Stored] = {}
        loads: dict[str, bytes] = {}
        for fingerprint, _, at_launch in found:
            if fingerprint in stored:
                continue
            got = self._obtain(fingerprint, key)
            if got is None:
                return False
            stored[fingerprint] = got
            loads[fingerprint] = got.binary
            if at_launch and self.config.pocl_ready:
                ready = self._ready(fingerprint, key, got.binary)
                if ready is None:
                    return False
                loads[fingerprint] = ready.binary
        from farm.core.errors import LoadError
        from farm.programs.assemble import assemble, put_in_place

        try:
            assembled = assemble(ctx, devs, [loads[fp] for fp, _, _ in found], options_bytes,
                                 [arch for _, arch, _ in found])
        except LoadError:
            return False  # the server warns, and builds it the plain way
        for fingerprint, got in stored.items():
            self._memory[(fingerprint, key)] = got._replace(remote=False)
            if got.remote:
                self._keep(fingerprint, key, got.binary, got.meta)
            if fingerprint in self._fills:
                for art in self._fills.pop(fingerprint):
                    self._keep(fingerprint, art.meta.key.id_hash, art.binary,
                               art.meta.model_dump_json(), art.meta.key.build_id)
            prep = self._prepared.get((fingerprint, key))
            if prep is not None and self._records is not None:
                self._records.watch(fingerprint, key, prep, got.source_hash,
                                    assembled.program)
        seconds = time.perf_counter() - start
        put_in_place(program, assembled.program,
                     {d.int_ptr: stored[fp].log for d, (fp, _, _) in zip(devs, found,
                                                                         strict=True)},
                     loaded=True, seconds=seconds)
        self.counts.bump("programs")
        self.counts.bump("loaded")
        with self._lock:
            self._observed.append((key, seconds, assembled.native_fallback))
        return True

    def _ready(self, fingerprint: str, key: str, binary: bytes) -> Prepared | None:
        """On PoCL's CPU drivers, ``binary`` with its work-group function records merged
        (once per key in this process; :mod:`farm.programs.quick_pocl`); ``None`` to
        decline."""
        from farm.compilation.native import unpack

        known = self._prepared.get((fingerprint, key))
        if known is not None or unpack(binary) is not None:
            return known
        if self._records is None:
            from farm.programs.quick_pocl import Records

            tiers: list[RowReader] = [self._read_local]
            if self.config.minio is not None:
                tiers.append(self._read_remote_row)
            self._records = Records(tiers, self._harvest_store, self._warn)
        got = self._records.prepare(fingerprint, key, binary)
        if got is None:
            return None
        prep, fills = got
        self._prepared[(fingerprint, key)] = prep
        self._fills[fingerprint] = [art for tier, art in fills if tier > 0]
        return prep

    def read_generated(self, key: str, build_id: str) -> bytes | None:
        """A stored artifact of generated code (:mod:`farm.programs.generated`) from the
        local tier or MinIO, verified; ``None`` when there is none (or it is not whole)."""
        from farm.programs.generated import GENERATED_FAMILY, GENERATED_NAMESPACE

        ns = str(Namespace.for_fingerprint(GENERATED_NAMESPACE))
        row = self._read_local(ns, key, build_id)
        if row is None and self.config.minio is not None:
            row = self._read_remote_row(ns, key, build_id)
        if row is None or _checked(key, row[0], row[1], GENERATED_FAMILY, build_id) is None:
            return None
        return row[1]

    def close(self) -> None:
        """What is left to keep in the local tier, and the last harvest of what PoCL's
        launches made (the process ends)."""
        keeper = self._keeper
        if keeper is not None:
            self._keeping.put(None)
            keeper.join(KEEP_S)
        records, self._records = self._records, None
        if records is not None:
            records.close()

    def observed(self) -> list[Observed]:
        """What this path served so far, for the records (see the module docstring)."""
        with self._lock:
            return list(self._observed)

    # -- obtaining ----------------------------------------------------------------------------
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

    def _obtain(self, fingerprint: str, key: str) -> _Stored | None:
        """The program's artifact from memory, the local tier or MinIO; ``None`` to
        decline."""
        held = self._memory.get((fingerprint, key))
        if held is not None:
            return held
        row = self._read_local(str(Namespace.for_fingerprint(fingerprint)), key,
                               PROGRAM_BUILD_ID)
        remote = row is None
        if remote and self.config.minio is not None:
            row = self._read_remote_row(str(Namespace.for_fingerprint(fingerprint)), key,
                                        PROGRAM_BUILD_ID)
        if row is None:
            return None
        meta = _checked(key, row[0], row[1])
        if meta is None:
            return None
        log, source_hash = meta.get("build_log", ""), meta.get("source_hash", "")
        if not isinstance(log, str) or not isinstance(source_hash, str):
            return None
        text = row[0] if isinstance(row[0], str) else row[0].decode("utf-8")
        return _Stored(row[1], log, source_hash, text, remote)

    def _read_local(self, ns: str, id_hash: str, build_id: str
                    ) -> tuple[str | bytes, bytes] | None:
        """(metadata JSON, binary) of an artifact in the node's local tier, if there."""
        local = self._local_tier()
        if local is None:
            return None
        from farm.store.sqlite_file import read_row

        with self._lock:
            return read_row(local, ns, id_hash, build_id)

    def _read_remote_row(self, ns: str, id_hash: str, build_id: str
                         ) -> tuple[str | bytes, bytes] | None:
        """(metadata JSON, binary) of an artifact in MinIO, if there (and whole)."""
        from farm.store.frames import split_artifact

        data = self._read_remote(artifact_object(Namespace.parse(ns), _Key(id_hash, build_id)))
        return None if data is None else split_artifact(data)

    def _local_tier(self) -> sqlite3.Connection | None:
        """The node's local tier, if it is a store this path reads (see
        :func:`farm.store.sqlite_file.open_existing`)."""
        with self._lock:
            if not self._local_tried:
                from pathlib import Path

                from farm.store.sqlite_file import open_existing

                self._local_tried = True
                self._local = open_existing(Path(self.config.store_path))
            return self._local

    def _read_remote(self, name: str) -> bytes | None:
        from farm.core.outage import OutageError
        from farm.store.s3_get import S3Declined

        reader, waiter = self._remote_reader()
        try:
            return waiter.call(lambda: reader.get(name))
        except S3Declined:
            return None  # an answer the SDK handles: the server reads it
        except OutageError as exc:
            raise QuickUnavailable(exc) from None

    def _remote_reader(self) -> tuple[S3Reader, Waiter]:
        with self._lock:
            if self._remote is None:
                from farm.store.s3_get import S3Reader

                assert self.config.minio is not None
                host, secure, access, secret, bucket = self.config.minio
                self._remote = (S3Reader(host, secure, access, secret, bucket,
                                         APP_ATTEMPT_S), app_waiter(f"MinIO at {host}"))
            return self._remote

    def _keep(self, fingerprint: str, key: str, binary: bytes, meta: str,
              build_id: str = PROGRAM_BUILD_ID) -> None:
        """Keep what MinIO served, and the device loaded, in the local tier (a cache:
        what cannot be kept there is read from MinIO again next time), on a thread of
        its own: a fresh node makes its store file then (WAL, an fsync), and SQLite lets
        the application run meanwhile."""
        import queue

        with self._lock:
            if self._keeper is None:
                self._keeping = queue.SimpleQueue()
                self._keeper = threading.Thread(target=self._keep_all, daemon=True,
                                                 name="kernel-farm local tier")
                self._keeper.start()
        self._keeping.put((str(Namespace.for_fingerprint(fingerprint)), key, build_id,
                           sha256_hex(binary), meta, binary))

    def _keep_all(self) -> None:
        import sqlite3

        from farm.store.sqlite_file import insert_row

        while (row := self._keeping.get()) is not None:
            local = self._local_tier()
            with self._lock:
                if local is None:
                    from pathlib import Path

                    from farm.store.sqlite_file import create, open_existing

                    path = Path(self.config.store_path)
                    local = self._local = open_existing(path) if create(path) else None
                if local is None:
                    continue
                try:
                    insert_row(local, *row)
                except sqlite3.Error:
                    pass


def _checked(key: str, meta_json: str | bytes, binary: bytes, family: str = PROGRAM_FAMILY,
             build_id: str = PROGRAM_BUILD_ID) -> dict[str, Any] | None:
    """The metadata of a stored artifact that says it is ``key``'s (and ``build_id``'s),
    of ``family``, of exactly these bytes, and trusted here; ``None`` otherwise (the
    server then reads it, and treats it as its rules say)."""
    try:
        meta = json.loads(meta_json)
        stored_key = meta["key"] if isinstance(meta, dict) else None
        if not (isinstance(stored_key, dict) and stored_key.get("id_hash") == key
                and stored_key.get("build_id") == build_id
                and meta.get("family") == family
                and meta.get("size") == len(binary)
                and meta.get("digest") == sha256_hex(binary) and _trusted(meta)):
            return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return meta


def _trusted(meta: dict[str, Any]) -> bool:
    """Whether a verified binary may be loaded here without the server: not one imported
    from a bundle and not yet validated on this device. (A node's cached verdict on a
    binary belongs here.)"""
    return meta.get("origin", "compiled") in ("compiled", "validated")

