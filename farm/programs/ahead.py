"""Proving ahead: a fresh node proves an application's programs while the application
starts, so that its builds find the verdicts in the node's proof book.

The trust rule (docs/SECURITY.md) has a stored binary proven on a node before its first
use there, in a process whose crash harms nobody, with a private driver cache. On a
fresh node that proof costs a process and a device context (on NVIDIA a context costs
1 to 2.4 s), and the application would pay it at its first build. But an application
spends that long itself before it builds anything: importing pyopencl, creating its own
context. So when a served process starts importing pyopencl on a node that has not
proven this application's programs yet (:func:`start`, from ``farm run``'s start-up
hook), it starts one more process, the **prover ahead**
(``python -m farm.programs.ahead APP HOME``), and goes on:

1. the prover takes the application's lock in the node's book (one prover per
   application and node: a pool's children, a second rank, wait for the same one), reads
   the application's **plan** (:mod:`farm.programs.plan`: the programs its first run on
   that device fingerprint built, in order) for every device of the node, and lists in
   its lock file what it will prove;
2. it opens a context on each device with a plan, with every driver cache private
   (:func:`farm.compilation.validate.private_caches`), and proves each program of the plan
   and its work-group records exactly as the program server does
   (:class:`farm.programs.proving.Proving`, the loads done in this process: it is the
   process whose crash harms nobody), keeping every definite verdict in the book;
3. then it writes ``<app>.done``, and later processes of the application on the node
   start no prover.

Meanwhile the application's quick path (:mod:`farm.programs.quick`) finds no verdict for
a program the prover has listed, and waits for it (:meth:`Ahead.wait`: a ``stat`` every
few milliseconds, :data:`WAIT_S` at most, and not at all once the prover has ended or for
a program it did not list): the verdict arrives while the application was starting
anyway, or milliseconds later. A prover that crashes on a binary leaves that binary
without a verdict: the application's server proves it in its own child, which then
keeps the crash as the verdict.
"""

from __future__ import annotations

import os
import sys
import time

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    import pyopencl as cl

    from farm.compilation.validate import Request
    from farm.compilation.verdict import Verdict
    from farm.core.keys import Namespace
    from farm.core.model import Artifact, Key
    from farm.programs.body import Body
    from farm.programs.rows import Rows
    from farm.programs.supplements import Found

#: the longest one build waits for a verdict of the prover ahead
WAIT_S = 10.0
#: the longest the prover runs
PROVER_LIMIT_S = 300.0
_END = "end"


#: the node's book of this proof version (``farm.compilation.proofs.PROOF_VERSION``, which
#: this module does not import: ``farm run``'s own process starts a prover too, and
#: imports as little as it can; tests/test_quick_trust.py holds the two equal)
BOOK = os.path.join("proofs", "v1")


def folder(home: str) -> str:
    """Where the provers ahead keep their locks and marks, in the node's book."""
    return os.path.join(home, BOOK, "ahead")


def start_before(command: list[str], capture: bool) -> None:
    """``farm run``'s own start of the prover ahead, before the command's interpreter
    even starts (0.1 to 0.5 s before the application imports pyopencl): where the
    command names a Python script (its first argument that ends in ``.py`` and is a
    file: ``python app.py``, ``mpirun -n 4 python3 app.py``), the prover of that
    application. The application's own start (:func:`farm.programs.autoinstall.
    before_pyopencl`) then finds it running; a command this does not read (``python -m
    pkg``, a shell script) is left to that."""
    if capture:
        return
    script = next((a for a in command[1:] if a.endswith(".py") and os.path.isfile(a)), "")
    from farm.core.runenv import home_of, script_digest

    app = script_digest(script) if script else ""
    if app:
        start(home_of(os.environ), app)


class Ahead:
    """The prover ahead of this application on this node, as its processes see it."""

    def __init__(self, where: str, app: str, pid: int | None) -> None:
        self.lock = os.path.join(where, f"{app}.lock")
        #: the prover this process started (``None``: another process's)
        self.pid = pid
        self._listed: frozenset[tuple[str, str]] | None = None

    def running(self) -> bool:
        """Whether a prover of this application runs (this process's child, not yet
        ended, or any process holding the lock)."""
        if self.pid is not None:
            try:
                done, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours (a forked child), or reaped elsewhere
                done = self.pid
            if done == 0:
                return True
            self.pid = None
        return _held(self.lock)

    def proving(self, fingerprint: str, key: str) -> bool:
        """Whether the prover runs and has listed ``key`` on ``fingerprint`` (or has not
        listed yet)."""
        if not self.running():
            return False
        if self._listed is None:
            self._listed = _listed(self.lock)
            if self._listed is None:
                return True  # starting: it lists before it proves anything
        return (fingerprint, key) in self._listed

    def wait(self, verdict: Callable[[], str | None], fingerprint: str, key: str
             ) -> str | None:
        """``verdict()`` once it is known, while the prover is proving ``key`` on
        ``fingerprint`` (:data:`WAIT_S` at most); ``None`` when it stays unknown."""
        deadline = time.monotonic() + WAIT_S
        pause = 0.001
        while True:
            known = verdict()
            if known is not None or time.monotonic() > deadline \
                    or not self.proving(fingerprint, key):
                return known if known is not None else verdict()
            time.sleep(pause)
            pause = min(2 * pause, 0.01)


def start(home: str, app: str) -> Ahead | None:
    """The prover ahead of application ``app`` (its main script's digest) on the node
    whose farm home is ``home``: started now unless the node proved the application's
    plan already (``None``) or another process's prover runs (then that one)."""
    if not app:
        return None
    where = folder(home)
    if os.path.exists(os.path.join(where, f"{app}.done")):
        return None
    ahead = Ahead(where, app, None)
    if _held(ahead.lock):
        return ahead
    from farm.core.runenv import unserved_environment

    env = {**unserved_environment(), "FARM_HOME": home}
    null = os.devnull
    try:
        ahead.pid = os.posix_spawn(
            sys.executable, [sys.executable, "-m", "farm.programs.ahead", app, home], env,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, null, os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 1, null, os.O_WRONLY, 0),
                          (os.POSIX_SPAWN_OPEN, 2, null, os.O_WRONLY, 0)])
    except OSError:
        return None
    return ahead


def _held(path: str) -> bool:
    """Whether a process holds the lock ``path``."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _listed(path: str) -> frozenset[tuple[str, str]] | None:
    """What the prover listed in its lock file; ``None`` until it has."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    if not lines or lines[-1] != _END:
        return None
    return frozenset((fp, key) for fp, _, key in (line.partition(" ") for line in lines[:-1]))


# -- the prover ---------------------------------------------------------------------------
class _Here:
    """Loads binaries in this process (a prover ahead is itself a process whose crash
    harms nobody): the proofs' :class:`~farm.compilation.proofs.Checker`."""

    started = 1

    def __init__(self, ctx: cl.Context, device: cl.Device, arch: str) -> None:
        self._ctx, self._device, self._arch = ctx, device, arch

    def start(self) -> None:
        """Opened already."""

    def check(self, binary: bytes, request: Request) -> Verdict:
        from dataclasses import asdict

        from farm.compilation.validate import check_binary
        from farm.compilation.verdict import Verdict

        why = check_binary(self._ctx, self._device, self._arch, binary, asdict(request))
        return Verdict(" ".join(why.split())[:500])

    def close(self) -> None:
        """Nothing to end."""


def main(argv: list[str]) -> int:
    """``python -m farm.programs.ahead APP HOME`` (see the module docstring)."""
    import fcntl
    import shutil
    import tempfile

    app, home = argv
    where = folder(home)
    os.makedirs(where, exist_ok=True)
    fd = os.open(os.path.join(where, f"{app}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another prover of this application
    done = os.path.join(where, f"{app}.done")
    if os.path.exists(done):
        return 0
    os.ftruncate(fd, 0)
    from farm.compilation.validate import private_caches

    cache = tempfile.mkdtemp(prefix="farm-ahead-")
    os.environ.update(private_caches(cache))
    try:
        finished = _prove(app, home, fd)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if finished:
        with open(done, "w", encoding="ascii") as fh:
            fh.write("proven\n")
    return 0


def _prove(app: str, home: str, fd: int) -> bool:
    """Prove the plans of ``app`` on this node's devices; whether it all finished (a
    store that did not answer leaves it for the next process)."""
    import pyopencl as cl

    from farm.core.fingerprint import device_identity, fingerprint_of
    from farm.programs.rows import Config, Rows, Unavailable

    config = Config(dict(os.environ))
    if config.declined:
        return True  # the application's settings are the server's to report: nothing here
    rows = Rows(config)
    plans: dict[str, tuple[cl.Device, list[str]]] = {}
    try:
        for platform in cl.get_platforms():
            for dev in platform.get_devices():
                fp = fingerprint_of(device_identity(dev))
                if fp not in plans:
                    keys = _plan(rows, fp, app)
                    if keys:
                        plans[fp] = (dev, keys)
    except Unavailable:
        os.write(fd, f"{_END}\n".encode())
        return False
    os.write(fd, "".join(f"{fp} {key}\n" for fp, (_, keys) in plans.items()
                         for key in keys).encode() + f"{_END}\n".encode())
    deadline = time.monotonic() + PROVER_LIMIT_S
    try:
        return all(_prove_plan(rows, dev, keys, home, deadline)
                   for dev, keys in plans.values())
    finally:
        rows.close()  # what it keeps in the local tier, written


def _plan(rows: Rows, fingerprint: str, app: str) -> list[str]:
    """The programs ``app``'s plans name on ``fingerprint``, in order (every slot until
    the first missing one; a plan that does not read is skipped)."""
    from farm.programs.plan import PLAN_BUILD_ID, PLAN_FAMILY, PLAN_SLOTS, decode, plan_id
    from farm.programs.rows import Unchecked

    keys: list[str] = []
    for slot in range(PLAN_SLOTS):
        try:
            found = rows.read(fingerprint, plan_id(app, slot), PLAN_BUILD_ID, PLAN_FAMILY)
            if found is None:
                break
            keys += decode(found[0].binary)
        except (Unchecked, ValueError):
            continue
    return list(dict.fromkeys(keys))


def _prove_plan(rows: Rows, dev: cl.Device, keys: list[str], home: str,
                deadline: float) -> bool:
    """Prove ``keys`` (a plan) on ``dev``, each with its records, as the server proves
    them (:meth:`farm.programs.proving.Proving.program`)."""
    from pathlib import Path

    import pyopencl as cl

    from farm.compilation.proofs import ProofBook, Prover
    from farm.core.device import info_from_device
    from farm.core.keys import Namespace
    from farm.core.model import Key
    from farm.programs.program_key import PROGRAM_BUILD_ID
    from farm.programs.proving import Proving
    from farm.programs.rows import Unavailable

    ctx = cl.Context([dev])
    info = info_from_device(0, 0, dev)
    proving = Proving.around(Prover(info, ProofBook(Path(home)), checker=_Here(
        ctx, dev, info.native_arch)))
    tiers = _tiers(rows)
    ns = Namespace.for_fingerprint(info.fingerprint)
    ready = rows.config.pocl_ready and info.compiles_at_launch
    for id_hash in keys:
        if time.monotonic() > deadline:
            return False
        key = Key(id_hash=id_hash, build_id=PROGRAM_BUILD_ID)
        try:
            art = tiers[0].store.get(ns, key) or tiers[1].store.get(ns, key)
            if art is None:
                continue
            proven = proving.program(info, key, art, _records(tiers, ns, key,
                                                              info.fingerprint)
                                     if ready else None)
            if proven.body is not None:  # what MinIO served and is proven: kept locally
                _keep(rows, info.fingerprint, tiers[1].store,
                      [art] + [c.art for c in proven.records])
        except Unavailable:
            return False
    return True


def _keep(rows: Rows, fingerprint: str, remote: _Reads, arts: list[Artifact]) -> None:
    """Keep what MinIO served and this prover proved in the node's local tier, so that
    the application reads it there (as it keeps what it loaded itself)."""
    from farm.programs.rows import Row

    for art in arts:
        if remote.read.pop(art.meta.key.id_hash, None) is art:
            rows.keep(fingerprint, art.meta.key.id_hash, art.meta.key.build_id,
                      Row(art.meta.model_dump_json(), art.binary, False))


def _records(tiers: list[_Tier], ns: Namespace, key: Key, fingerprint: str
             ) -> Callable[[Body], Found]:
    """The records of ``key``'s program, read as the server reads them for a body."""
    from farm.compilation.poclbin import build_hash, kernel_files
    from farm.programs.supplements import SlotReader, read_records

    def records(body: Body) -> Found:
        return read_records(SlotReader(tiers, ns, key), key,  # type: ignore[arg-type]
                            build_hash(body.binary), fingerprint,
                            frozenset(kernel_files(body.binary)))

    return records


class _Reads:
    """One tier as :class:`~farm.programs.supplements.SlotReader` walks tiers:
    ``get`` answers an artifact, verified, or ``None``; what it answered is kept
    (``read``: its key id -> the artifact) for the local tier."""

    def __init__(self, read: Callable[[str, str, str], tuple[str | bytes, bytes] | None]
                 ) -> None:
        self._read = read
        self.read: dict[str, Artifact] = {}

    def get(self, ns: Namespace, key: Key) -> Artifact | None:
        from farm.core.model import Artifact, ArtifactMeta

        row = self._read(str(ns), key.id_hash, key.build_id)
        if row is None:
            return None
        try:
            art = Artifact(meta=ArtifactMeta.model_validate_json(row[0]), binary=row[1])
        except ValueError:
            return None
        if not art.verify() or art.meta.key != key:
            return None
        self.read[key.id_hash] = art
        return art


class _Tier:
    """A tier as the program server's proofs read tiers."""

    def __init__(self, store: _Reads) -> None:
        self.store = store


def _tiers(rows: Rows) -> list[_Tier]:
    """The node's local tier, then MinIO."""
    remote = rows.read_remote if rows.config.minio is not None else _nothing
    return [_Tier(_Reads(rows.read_local)), _Tier(_Reads(remote))]


def _nothing(ns: str, id_hash: str, build_id: str) -> None:
    """A tier that holds nothing (no MinIO configured)."""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
