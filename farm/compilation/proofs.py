"""Proofs: every stored binary is proven on a node before its first use there, once.

The trust rule (docs/SECURITY.md, "One trust rule for every stored binary"): a digest
catches damage in transit, a signature (when a key is set) a writer that should not
have written; neither says the driver survives the bytes. PoCL trusts what it parses: a
program binary cut short, with its digest made to match, kills the process that loads it
(SIGSEGV), one flipped bit aborts it inside LLVM. So before a stored binary of any kind
(a family's artifact, an application's program, a program's work-group functions) is
first used on a node, it is loaded in a child process whose crash harms nobody, with a
*private* driver cache (:mod:`farm.compilation.validate`), against exactly what its record
says it is: the kernel names, the target, the work-group functions it carries, a launch
where one is recorded. A :class:`Claim` is that record; :class:`Prover` proves one.

The verdict is kept per node (:class:`ProofBook`): one small file per claim under
``<FARM_HOME>/proofs/v1/<fingerprint>/``, named by a SHA-256 of the claim (its kind, the
bytes' digest, the names, what it is merged with) and :data:`PROOF_VERSION`. A later
process that finds the file pays one ``stat``; a refusal is kept too (``<hash>.refused``,
holding why), so a bad binary that could not be quarantined (read-only credentials) costs
no child the next time. Only definite verdicts are kept (the driver refused or crashed);
a child that could not start or did not answer in time decides nothing. The book is as
trustworthy as the node's own folder: whoever can write ``FARM_HOME`` can write its
local tier too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from farm.compilation.verdict import Verdict

if TYPE_CHECKING:
    from typing import Protocol

    from farm.compilation.validate import Request
    from farm.core.device import DeviceInfo
    from farm.core.model import Artifact

    class Checker(Protocol):
        """What loads a binary where its crash harms nobody: the isolated child
        (:class:`farm.compilation.validate.IsolatedValidator`), or a process that is
        itself such a child (:mod:`farm.programs.ahead`)."""

        started: int

        def start(self) -> None: ...

        def check(self, binary: bytes, request: Request) -> Verdict: ...

        def close(self) -> None: ...

#: bump when what a proof checks changes: every verdict kept before is then unknown
PROOF_VERSION = 1
#: the longest reason a refusal keeps
_MAX_REASON = 500

Kind = Literal["family", "program", "functions"]


@dataclass(frozen=True)
class Claim:
    """What a stored binary is proven to be on a device of ``fingerprint``.

    ``digest`` is the SHA-256 of the stored bytes (the artifact's, verified by the store);
    ``names`` the exact kernel names it must hold (``None``: not checked); ``merged`` the
    digests of what it is proven together with (a record of work-group functions is
    proven merged into its program's binary, so the same record with another program
    binary is another claim).
    """

    kind: Kind
    fingerprint: str
    digest: str
    names: tuple[str, ...] | None = None
    merged: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The verdict file's name: a SHA-256 of everything the proof checked."""
        text = json.dumps({"v": PROOF_VERSION, "kind": self.kind, "fp": self.fingerprint,
                           "digest": self.digest, "names": self.names,
                           "merged": list(self.merged)}, sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ProofBook:
    """The node's verdicts, one file per claim (see the module docstring). ``home`` None
    keeps nothing (every claim is unknown): a process with no farm home of its own."""

    def __init__(self, home: Path | None) -> None:
        self._root = home / "proofs" / f"v{PROOF_VERSION}" if home is not None else None

    def _path(self, claim: Claim) -> Path | None:
        if self._root is None:
            return None
        name = claim.name
        return self._root / claim.fingerprint / name[:2] / name

    def holds(self, fingerprint: str) -> bool:
        """Whether this node ever kept a verdict for ``fingerprint`` (a fresh node did
        not: its first stored binary will need the child, which may start early)."""
        return self._root is not None and (self._root / fingerprint).is_dir()

    def verdict(self, claim: Claim) -> str | None:
        """"" when this node proved ``claim``, why not when it refused it, ``None`` when
        it never decided."""
        path = self._path(claim)
        if path is None:
            return None
        if path.exists():
            return ""
        try:
            why = path.with_name(path.name + ".refused").read_text("utf-8", "replace")
        except OSError:
            return None
        return why.strip() or "refused on this node"

    def note(self, claim: Claim, why: str) -> None:
        """Keep the verdict on ``claim`` ("" proven). A folder that cannot be written
        keeps nothing: the next process proves it again."""
        path = self._path(claim)
        if path is None:
            return
        target = path if not why else path.with_name(path.name + ".refused")
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verdict-")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(" ".join(why.split())[:_MAX_REASON])
            os.replace(tmp, target)


@dataclass
class ProofStats:
    """What a prover did (for summaries and tests)."""

    known: int = 0
    proven: int = 0
    refused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def bump(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class Prover:
    """Proves claims on one device: the node's book first, then the child process
    (started on first need, or early with :meth:`start`). Thread-safe."""

    def __init__(self, device: DeviceInfo, book: ProofBook,
                 timeout_s: float | None = None, checker: Checker | None = None) -> None:
        """``checker``: what loads the binaries (default: an isolated child, started on
        first need)."""
        self.device = device
        self.book = book
        self.stats = ProofStats()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._validator: Checker | None = checker

    def known(self, claim: Claim) -> str | None:
        """The node's verdict on ``claim`` ("" proven, why refused), ``None``: unknown."""
        return self.book.verdict(claim)

    def start(self) -> None:
        """Start the child now, without waiting for it (it opens its device while this
        process goes on)."""
        self._child().start()

    def prove(self, claim: Claim, binary: bytes, request: Request) -> Verdict:
        """The verdict on ``claim`` (``binary``, loaded as ``request`` says), from the
        book, else from the child; a definite one is kept in the book."""
        known = self.book.verdict(claim)
        if known is not None:
            self.stats.bump("known")
            return Verdict(known)
        verdict = self.check(binary, request)
        self.note(claim, verdict)
        return verdict

    def check(self, binary: bytes, request: Request) -> Verdict:
        """The child's verdict on ``binary``, kept nowhere (the caller notes the claims
        it decides: one load may prove several, see ``farm.programs.proving``)."""
        from farm.compilation.validate import ValidatorError

        try:
            return self._child().check(binary, request)
        except ValidatorError as exc:
            return Verdict(str(exc), definite=False)

    def note(self, claim: Claim, verdict: Verdict) -> None:
        """Keep a definite ``verdict`` on ``claim``."""
        if verdict.definite:
            self.book.note(claim, verdict.why)
            self.stats.bump("refused" if verdict.why else "proven")

    def _child(self) -> Checker:
        from farm.compilation.validate import DEFAULT_TIMEOUT_S, IsolatedValidator

        with self._lock:
            if self._validator is None:
                self._validator = IsolatedValidator(self.device,
                                                    self._timeout_s or DEFAULT_TIMEOUT_S)
            return self._validator

    @property
    def children(self) -> int:
        """Child processes started so far (a crash costs one)."""
        with self._lock:
            return self._validator.started if self._validator is not None else 0

    def close(self) -> None:
        with self._lock:
            validator, self._validator = self._validator, None
        if validator is not None:
            validator.close()

    def __enter__(self) -> Prover:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prove_family(prover: Prover, art: Artifact, names: tuple[str, ...] = ()) -> str:
    """"" when ``art`` (a family's stored artifact) is proven on this node to load, else
    why not; :class:`~farm.core.errors.DeviceError` when nothing could be decided here
    (no child could start, or it did not answer in time): the caller then loads nothing.

    The claim is the bytes' alone, and so is the child's check: which kernels a binary
    may hold depends on the key it is served under, and is the caller's to check at its
    own load (``farm.compilation.load``: exactly the family's declared names). So a
    verdict made without them (a bundle import's) serves every loader of the node, and
    a valid binary copied under another kernel's key is refused under that key only,
    never on this node for the kernel it belongs to. ``names`` are the caller's
    (kept for its signature: ``Obtainer``'s validate)."""
    from farm.compilation.validate import Request
    from farm.core.errors import DeviceError

    del names  # checked by the caller's own load, see above
    claim = Claim("family", prover.device.fingerprint, art.meta.digest)
    verdict = prover.prove(claim, art.binary, Request())
    if not verdict.definite:
        raise DeviceError(verdict.why)
    return verdict.why
