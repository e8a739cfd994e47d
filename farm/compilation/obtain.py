"""Obtaining a kernel: Loaded, else Rekeyed, else Compiled. The rules, in one place.

Every path that obtains kernels applies these rules and no others: the embedded batch
(:mod:`farm.compilation.batch`: in bulk, lowering and compiling in parallel), a cluster
worker (``worker.execute``: one kernel at a time, its look-ups and compile under a
compile lease, through :func:`obtain`), and the loader (through the batch, and
:func:`store_key` for its look-ups). A rule fixed here is fixed for all of them.

1. **The key** (:func:`store_key`): the kernel id's hash and the family's build id
   *here*; a build id computed elsewhere that differs is version skew, never stored.
2. **Loaded** (:meth:`Obtainer.stored`): the store holds the key, its digest verifies
   (the store checks it on every read) and the device loads it. A corrupt or refused
   artifact is a miss, which compiling repairs.
3. **Rekeyed** (:meth:`Obtainer.reusable`): after lowering, the source index points at
   another key whose artifact verifies, was made from this very source (index entries
   are hints) and loads. It is kept under this key too (:meth:`Obtainer.keep_reused`),
   indexed by the source *we* lowered; an earlier build of the same family is moved
   (:mod:`farm.compilation.rekey`).
4. **Compiled**: finalize, validate by a load, keep (:meth:`Obtainer.keep`).

Trust (docs/SECURITY.md, "One trust rule for every stored binary"): an artifact is
proven in an isolated process (the ``validate`` of :class:`Obtainer`:
:func:`farm.compilation.proofs.prove_family`, the node's book first) before this process
loads it, whatever its origin; one a caller does not load is proven only when it came
from outside a worker's validation (``origin="imported"``: a bundle's), and then noted
``validated``. One that does not load there, or that this device refuses, is proven bad
on its own device and quarantined (moved aside with why, its bytes kept), so the
kernel's repair can be stored instead of being refused by first-writer-wins for ever. A
binary is loaded as exactly the kernels its family declares, where they are known
(after lowering).

Nothing of a kernel that fails is stored. Where a record must be durable before the
store changes (a worker), :func:`obtain` records first.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from farm.compilation.load import LoadedBinary
from farm.compilation.rekey import RekeyAction, rekey_action
from farm.core.errors import FarmError, LoadError, VersionSkewError
from farm.core.keys import Namespace
from farm.core.model import Artifact, ArtifactId, Key, Lowered
from farm.core.outcomes import Outcome
from farm.families import Registry
from farm.store.base import ArtifactStore, mark_validated, set_aside

if TYPE_CHECKING:
    from farm.compilation.finalize import FinalizeResult

log = logging.getLogger(__name__)

#: puts a binary on the device holding exactly the kernel names given, when any are
#: (raising :class:`LoadError` when it refuses it)
LoadOnDevice = Callable[[bytes, tuple[str, ...]], LoadedBinary]
#: proves a stored artifact in an isolated process (the node's verdict first): "" when
#: it loads holding exactly the names given, else why not
ValidateIsolated = Callable[[Artifact, tuple[str, ...]], str]
#: the kernel names a family declares, given now or worked out when needed (lowering)
Names = tuple[str, ...] | Callable[[], tuple[str, ...]]


def store_key(registry: Registry, artifact: ArtifactId, build_id: str | None = None) -> Key:
    """The key ``artifact`` is stored under: its id hash and its family's build id here.

    ``build_id`` is what another process (a build client) computed for it: a worker whose
    family code differs refuses with :class:`VersionSkewError` naming both ids, because
    storing would put an artifact under a key its code did not produce. An unknown family
    raises the registry's error.
    """
    family = registry.get(artifact.kernel.family)
    if build_id is not None and family.build_id != build_id:
        raise VersionSkewError(
            f"version skew for family {family.name}: client build id {build_id}, "
            f"worker build id {family.build_id} (client and worker run different "
            "kernel code)")
    return Key(id_hash=artifact.id_hash, build_id=family.build_id)


@dataclass(frozen=True)
class Found:
    """A stored artifact this device accepts: under ``key`` (this kernel's, or another's
    to reuse, then with the rekey ``action``), and its program when it was loaded."""

    key: Key
    artifact: Artifact
    loaded: LoadedBinary | None = None
    action: RekeyAction | None = None


class Obtainer:
    """The rules of obtaining kernels into one namespace of one store.

    ``load`` puts a binary on the device; every artifact found is loaded before it
    counts (Loaded or Rekeyed), so a binary the device refuses is a miss. Without it
    (``farm build`` filling the store, where a load here would be thrown away) a
    verified digest is enough.
    """

    def __init__(self, store: ArtifactStore, ns: Namespace,
                 load: LoadOnDevice | None = None,
                 validate: ValidateIsolated | None = None) -> None:
        self.store = store
        self.ns = ns
        self._load = load
        self._validate = validate

    def stored(self, key: Key, names: Names = ()) -> Found | None:
        """The Loaded rule: ``key``'s artifact, verified and accepted by the device (as
        exactly the kernels ``names``, when given)."""
        art = self.store.get(self.ns, key)
        return self._accepted(key, art, names) if art is not None else None


    def claim(self, key: Key, lowered: Lowered) -> tuple[Key | None, bool]:
        """The look a worker makes under the compile lease, in one request where the
        store can (``ArtifactStore.claim_source``): (the key the source index held, or
        ``None``; whether the index now points at ``key``, which it did not before).
        Pointed, neither the source nor the key is stored: compile, no look needed."""
        return self.store.claim_source(self.ns, lowered.source_hash, key)

    def reusable(self, key: Key, family: str, lowered: Lowered, *,
                 claimed: tuple[Key | None, bool] | None = None) -> Found | None:
        """The Rekeyed rule: an artifact of ``lowered``'s source under another key.
        ``claimed``: what :meth:`claim` found, when it was made (not read again)."""
        source_hash = lowered.source_hash
        found = self.store.find_source(self.ns, source_hash) if claimed is None \
            else claimed[0]
        if found is None or found == key:
            return None
        art = self.store.get(self.ns, found)
        if art is None or art.meta.source_hash != source_hash:  # index entries are hints
            return None
        accepted = self._accepted(found, art, lowered.kernel_names)
        if accepted is None:
            return None
        action = rekey_action(found, art.meta.family, key, family)
        return Found(key=found, artifact=accepted.artifact, loaded=accepted.loaded,
                     action=action)

    def keep(self, key: Key, family: str, art: Artifact, lowered: Lowered | None) -> None:
        """Store ``art`` under ``key``, indexed by the source *we* lowered for it (never
        by the hash in a stored artifact's metadata, see farm.store.base). First writer
        wins: a refused write means another process stored it first."""
        update: dict[str, object] = {}
        if art.meta.key != key or art.meta.family != family:
            update.update(key=key, family=family)
        if lowered is not None and art.meta.source_hash != lowered.source_hash:
            update["source_hash"] = lowered.source_hash
        if update:
            art = Artifact(meta=art.meta.model_copy(update=update), binary=art.binary)
        self.store.put(self.ns, art, source=lowered)

    def keep_reused(self, found: Found, key: Key, family: str, lowered: Lowered) -> None:
        """Keep a reusable artifact under ``key``; a moved one leaves its old key."""
        self.keep(key, family, found.artifact, lowered)
        if found.action is RekeyAction.MOVE:
            self.store.delete(self.ns, found.key)

    def _accepted(self, key: Key, art: Artifact, names: Names) -> Found | None:
        """``art`` once this device accepts it; ``None`` (a miss) when it does not, and
        then, proven bad on its own device, it is quarantined."""
        validating = self._validate is not None and (
            self._load is not None or art.meta.origin == "imported")
        if not validating and self._load is None:
            return Found(key=key, artifact=art)  # nothing runs here: no names needed
        try:
            wanted = names() if callable(names) else names
        except FarmError as exc:  # the kernel does not lower here: its compile says why
            log.info("stored artifact %s: %s; a miss", key, exc)
            return None
        if validating:
            checked = self._validated(art, wanted)
            if checked is None:
                return None
            art = checked
        if self._load is None:
            return Found(key=key, artifact=art)
        try:
            return Found(key=key, artifact=art, loaded=self._load(art.binary, wanted))
        except LoadError as exc:
            log.warning("stored artifact %s refused by the device (%s); a miss", key, exc)
            set_aside(self.store, self.ns, art, f"the device refused it: {exc}")
            return None

    def _validated(self, art: Artifact, names: tuple[str, ...]) -> Artifact | None:
        """``art`` once proven on this node (an imported one noted ``validated``);
        ``None`` when it did not load there (quarantined), or could not be tried."""
        assert self._validate is not None
        try:
            why = self._validate(art, names)
        except FarmError as exc:  # no validating process can start here
            log.warning("stored artifact %s was not validated here (%s); a miss",
                        art.meta.key, exc)
            return None
        if why:
            log.warning("stored artifact %s (%s) failed validation in a child process: "
                        "%s; a miss", art.meta.key, art.meta.origin, why)
            set_aside(self.store, self.ns, art, why)
            return None
        if art.meta.origin != "imported":
            return art
        return mark_validated(self.store, self.ns, art)


def compiled_artifact(key: Key, family: str, built: FinalizeResult, source_hash: str,
                      worker: str = "") -> Artifact:
    """The artifact of a successful compile, with where and how long it was made."""
    return Artifact.create(key, family, built.binary, source_hash, build_log=built.build_log,
                           host=built.host, worker=worker or built.worker,
                           work_s=built.work_s)


class Steps(Protocol):
    """What :func:`obtain` asks of its caller for one kernel."""

    def lower(self) -> Lowered:
        """Validate against the device and expand to source (KernelError on failure)."""

    def compile(self, lowered: Lowered) -> Artifact:
        """Finalize and validate by a load (KernelError on failure): the artifact."""

    def lease(self, source_hash: str) -> contextlib.AbstractContextManager[bool]:
        """Hold the right to compile ``source_hash``: enters True when held, False when
        another process held it and has now let go (look again before compiling)."""

    def record(self, outcome: Outcome, lowered: Lowered | None) -> None:
        """Record the kernel's trip; called *before* a Rekeyed or Compiled store write."""


def obtain(key: Key, family: str, rules: Obtainer, steps: Steps) -> Outcome:
    """Obtain one kernel: lowered, then under the source's compile lease Loaded, else
    Rekeyed, else Compiled.

    The store is looked at once, under the lease: a worker is asked for a kernel because
    its client just found it missing, so looking before the lease as well cost two
    MinIO reads for every compile and saved nothing (six requests a compiled kernel
    instead of four: bench/bench_control_plane.py). While another process holds the
    lease this waits for it to let go and takes it, then looks, so a kernel in flight in
    two builds is compiled once. Raises the step's error when the kernel cannot be
    obtained; nothing of it is stored then.
    """
    lowered = steps.lower()
    while True:
        with steps.lease(lowered.source_hash) as held:
            if not held:
                continue  # another process had it: take it now, then look
            if rules.stored(key, lowered.kernel_names) is not None:  # another build
                # stored this very key: loaded as exactly the kernels the family declares
                steps.record(Outcome.LOADED, None)
                return Outcome.LOADED
            reuse = rules.reusable(key, family, lowered)
            if reuse is not None:
                steps.record(Outcome.REKEYED, lowered)
                rules.keep_reused(reuse, key, family, lowered)
                return Outcome.REKEYED
            art = steps.compile(lowered)
            steps.record(Outcome.COMPILED, lowered)
            rules.keep(key, family, art, lowered)
            return Outcome.COMPILED
