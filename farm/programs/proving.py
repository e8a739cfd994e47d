"""Proving an application's stored program and its work-group function records before
the application loads them (the trust rule: :mod:`farm.compilation.proofs`).

What is checked, in order, cheapest first:

1. the **body** (:mod:`farm.programs.body`): the bytes are this program's, built for this
   device (another program's binary under the key, or a copy from another device's
   namespace, is refused here, without a child);
2. the **structure**, on PoCL: the binary walks exactly (every size checked against the
   bytes there are), is named by its own content (so the PoCL folder it unpacks into
   holds nothing of another binary), and carries no specialised work-group function (a
   program's binary never does: those travel in records, proven apart);
3. the **records** (:func:`farm.programs.supplements.decode`): each names this program,
   binary and device, and only kernels of it;
4. the **child** (:mod:`farm.compilation.validate`): the binary with every record not
   yet proven merged in is loaded in one isolated process with a private PoCL cache,
   holding exactly the kernels its body names, each record's function ``dlopen``\\ ed
   there, each recorded launch run. One load proves the program and its records
   together; only when it fails is the program loaded alone, then each record with it,
   so that the verdict falls on the part that is bad.

Every definite verdict is kept in the node's book, so a later process pays a ``stat``
per binary. The caller (:class:`~farm.programs.serve.ProgramServer`) quarantines what is
refused in the tier that held it, says so in one line, and builds the program again
from the source the application just gave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from farm.compilation.poclbin import (
    PoclBinaryError,
    build_hash,
    kernel_files,
    named_by_content,
    rewrite,
)
from farm.compilation.proofs import Claim, ProofBook, Prover, prove_family
from farm.compilation.verdict import Verdict
from farm.core.errors import DeviceError
from farm.core.keys import PROGRAM_FAMILY, PROGRAM_FUNCTIONS_FAMILY, Namespace
from farm.core.model import Artifact, Key
from farm.core.outcomes import Outcome
from farm.programs.body import Body, BodyError, program_artifact, read_body
from farm.programs.prepared import Prepared, merge
from farm.programs.prepared import structure as program_structure
from farm.programs.supplements import Candidate, Found, Refused, SlotReader, read_records
from farm.store.base import set_aside
from farm.store.tiers import Tier

if TYPE_CHECKING:
    from farm.compilation.finalize import FinalizeResult
    from farm.compilation.validate import Request
    from farm.core.device import DeviceInfo


def structure(binary: bytes, info: DeviceInfo) -> str:
    """:func:`farm.programs.prepared.structure` on ``info``'s device."""
    return program_structure(binary, info.compiles_at_launch)


#: what a served binary's warnings go through: (kind said once a run, the line)
Warn = Callable[[str, str], None]
#: the tier index of a program compiled in this process, stored once the application's
#: load validated it
UNSTORED = -1


@dataclass
class Got:
    """A program for one device fingerprint, as this process serves it."""

    #: the stored artifact (its body), or the one to store (compiled here)
    art: Artifact
    body: Body
    outcome: Outcome
    #: the tier that served it (0: memory, the cluster's compile), or :data:`UNSTORED`
    tier: int
    #: on PoCL: the binary with its records merged, under a name of its own
    prepared: Prepared | None = None
    #: a binary compiled here that may be stored once the application loaded it
    storable: bool = True

    @property
    def binary(self) -> bytes:
        """What the application loads."""
        return self.prepared.binary if self.prepared is not None else self.body.binary


@dataclass
class Proven:
    """What a proof decided about one stored program and its records."""

    #: the program's body, when it is proven; ``None`` when it is not
    body: Body | None = None
    #: why the program is not proven ("" when it is)
    why: str = ""
    #: False when nothing was decided about the program (no child could run)
    definite: bool = True
    #: records proven with it
    records: list[Candidate] = field(default_factory=list)
    #: records refused (definitely: quarantine them)
    refused: list[Refused] = field(default_factory=list)


class Proving:
    """The provers of one process's program server, one per device fingerprint."""

    def __init__(self, home: Path | None) -> None:
        self.book = ProofBook(home)
        self._lock = threading.Lock()
        self._provers: dict[str, Prover] = {}

    @classmethod
    def around(cls, prover: Prover) -> Proving:
        """Proofs through ``prover`` (its book, its child: one per process and device)."""
        out = cls(None)
        out.book = prover.book
        out._provers[prover.device.fingerprint] = prover
        return out

    def prover(self, info: DeviceInfo) -> Prover:
        with self._lock:
            prover = self._provers.get(info.fingerprint)
            if prover is None:
                prover = self._provers[info.fingerprint] = Prover(info, self.book)
            return prover

    def start_early(self, info: DeviceInfo) -> None:
        """On a node that never proved anything for ``info``'s device, start its child
        now: it opens the device while this process fetches what it will prove."""
        if not self.book.holds(info.fingerprint):
            self.prover(info).start()

    def note_compiled(self, info: DeviceInfo, art: Artifact, kernels: tuple[str, ...]
                      ) -> None:
        """``art``, compiled in this process and loaded by the application, needs no
        proof on this node: noted so (the application's load was the validating one)."""
        self.prover(info).note(Claim("program", info.fingerprint, art.meta.digest,
                                     names=kernels), Verdict())

    def program(self, info: DeviceInfo, key: Key, art: Artifact,
                records: Callable[[Body], Found] | None = None) -> Proven:
        """Prove ``art`` (``key``'s stored program) and the records ``records`` reads for
        its body."""
        fp = info.fingerprint
        try:
            body = read_body(art.binary, key, fp)
        except BodyError as exc:
            return Proven(why=str(exc))
        why = structure(body.binary, info)
        if why:
            return Proven(why=why)
        found = records(body) if records is not None else None
        prover = self.prover(info)
        claim = Claim("program", fp, art.meta.digest, names=body.kernels)
        out = Proven(body=body, refused=list(found.refused) if found else [])
        pending = []
        for cand in found.candidates if found else []:
            known = prover.known(_record_claim(fp, art, cand))
            if known is None:
                pending.append(cand)
            elif known:
                out.refused.append(Refused(cand.slot, cand.tier, cand.art, known))
            else:
                out.records.append(cand)
        own = prover.known(claim)
        if own:
            return Proven(why=own, refused=out.refused)
        if own is None or pending:
            decided = self._prove(prover, claim, own is None, body, art, pending, out)
            if decided is not None:
                return decided
        return out

    def _prove(self, prover: Prover, claim: Claim, unknown: bool, body: Body,
               art: Artifact, pending: list[Candidate], out: Proven) -> Proven | None:
        """Prove what the book did not know; a :class:`Proven` when the program itself
        is not proven, else ``None`` (``out`` holds the records' verdicts)."""
        base = build_hash(body.binary) if pending else ""
        if pending:  # one load for all: the common case of a fresh node
            verdict = prover.check(merge(body.binary, base, pending, 0).binary,
                                   _request(body, pending))
            if verdict.ok:
                if unknown:
                    prover.note(claim, verdict)
                for cand in pending:
                    prover.note(_record_claim(claim.fingerprint, art, cand), verdict)
                out.records.extend(pending)
                return None
        if unknown:
            verdict = prover.prove(claim, body.binary, _request(body, []))
            if not verdict.ok:
                return Proven(why=verdict.why, definite=verdict.definite,
                              refused=out.refused)
        for cand in pending:
            verdict = prover.prove(_record_claim(claim.fingerprint, art, cand),
                                   merge(body.binary, base, [cand], 0).binary,
                                   _request(body, [cand]))
            if verdict.ok:
                out.records.append(cand)
            elif verdict.definite:
                out.refused.append(Refused(cand.slot, cand.tier, cand.art, verdict.why))
        return None

    def stored(self, info: DeviceInfo, key: Key, tiers: list[Tier],
               reader: SlotReader | None, warn: Warn) -> Got | None:
        """``key``'s program from the first tier holding one this node proves (with its
        records, read by ``reader``, when they apply); what is refused on the way is
        quarantined in its tier and said once (``warn(kind, line)``)."""
        ns = Namespace.for_fingerprint(info.fingerprint)
        for tier, held in enumerate(tiers):
            art = held.store.get(ns, key)
            if art is None:
                continue
            got = self.served(info, key, art, tier, tiers, reader, warn)
            if got is not None:
                return got
            if reader is not None:  # the next tier's binary has its records read afresh
                reader = SlotReader(tiers, ns, key)
        return None

    def served(self, info: DeviceInfo, key: Key, art: Artifact, tier: int,
               tiers: list[Tier], reader: SlotReader | None, warn: Warn) -> Got | None:
        """``art`` (``key``'s, from tier ``tier``) as this process serves it once proven;
        ``None`` when it is refused (then quarantined) or cannot be proven here."""
        ns = Namespace.for_fingerprint(info.fingerprint)
        found: list[Found] = []

        def records(body: Body) -> Found:
            kernels = frozenset(kernel_files(body.binary))
            found.append(read_records(reader, key, build_hash(body.binary),
                                      info.fingerprint, kernels) if reader is not None
                         else Found())
            return found[0]

        proven = self.program(info, key, art, records if info.compiles_at_launch else None)
        for bad in proven.refused:
            set_aside(tiers[bad.tier].store, ns, bad.art,
                      f"work-group function record refused: {bad.why}")
            warn("records", f"work-group functions stored for a program were refused "
                            f"({bad.why}); quarantined, their first launches compile")
        if found and found[0].unread:
            warn("records", f"work-group functions stored for a program were not read "
                            f"({found[0].unread}); its first launches compile")
        if proven.body is None:
            if not proven.definite:
                warn("unproven", f"a stored program could not be proven on this node "
                                 f"({proven.why}); built from the application's source")
                return None
            set_aside(tiers[tier].store, ns, art, proven.why)
            warn("refused", f"a stored program was refused ({proven.why}); quarantined, "
                            "and built again from the application's source")
            return None
        prepared = None
        if info.compiles_at_launch:
            free = [r.slot for r in proven.refused] + [found[0].next_slot if found else 0]
            prepared = merge(proven.body.binary, build_hash(proven.body.binary),
                             proven.records, min(free))
        return Got(art=art, body=proven.body, outcome=Outcome.LOADED, tier=tier,
                   prepared=prepared)

    def close(self) -> None:
        with self._lock:
            provers, self._provers = list(self._provers.values()), {}
        for prover in provers:
            prover.close()


def compiled_here(info: DeviceInfo, key: Key, spec_digest: str, built: FinalizeResult
                  ) -> Got:
    """The program this process just compiled, as it is served and later stored: on PoCL
    named by its content (a binary taken the plain way is renamed), its body naming its
    kernels and its log. One the farm could not store (a binary it cannot walk, kernel
    names it cannot keep) is served all the same, and never stored."""
    binary, storable = built.binary, True
    if info.compiles_at_launch:
        try:
            if not named_by_content(binary):
                binary = rewrite(binary, frozenset())
        except PoclBinaryError:
            storable = False
    storable = storable and not structure(binary, info)
    try:
        art = program_artifact(key, info.fingerprint, built, binary, spec_digest)
    except ValidationError:  # a kernel name or log no body keeps: served, not stored
        storable = False
        art = program_artifact(key, info.fingerprint, built.model_copy(update={
            "kernel_names": (), "build_log": built.build_log[:1 << 20]}), binary,
                               spec_digest)
    body = read_body(art.binary, key, info.fingerprint)
    prepared = (merge(binary, build_hash(binary), [], 0)
                if info.compiles_at_launch and storable else None)
    return Got(art=art, body=body, outcome=Outcome.COMPILED, tier=UNSTORED,
               prepared=prepared, storable=storable)


def _record_claim(fingerprint: str, program: Artifact, cand: Candidate) -> Claim:
    """A record is proven merged into one program binary: the claim names both."""
    return Claim("functions", fingerprint, cand.art.meta.digest,
                 merged=(program.meta.digest,))


def _request(body: Body, records: list[Candidate]) -> Request:
    from farm.compilation.validate import Request  # the child's side: when one is asked

    launches: list[dict[str, Any]] = [launch.model_dump(mode="json")
                                      for rec in records
                                      for launch in rec.decoded.launches.values()]
    return Request(names=body.kernels, require_kernel=False,
                   functions=tuple(pair for rec in records
                                   for pair in sorted(rec.decoded.functions)),
                   launches=tuple(launches))


def prove_stored(proving: Proving, info: DeviceInfo, art: Artifact) -> str:
    """"" when ``art``, of any kind, passes what can be proven of it alone on ``info``'s
    device (a bundle import's check), else why not; a record of work-group functions is
    proven with its program's binary, at its first use. ``DeviceError`` when nothing
    could be decided here."""
    if art.meta.family == PROGRAM_FUNCTIONS_FAMILY:
        return ""
    if art.meta.family == PROGRAM_FAMILY:
        proven = proving.program(info, art.meta.key, art)
        if not proven.definite:
            raise DeviceError(proven.why)
        return proven.why
    return prove_family(proving.prover(info), art, ())
