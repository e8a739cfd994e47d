"""An application's plan: the programs it builds, per device fingerprint, so that a fresh
node proves them before the application asks (:mod:`farm.programs.ahead`).

A process of an application (its main script, by digest, as generated code is named:
:func:`farm.programs.generated.application_digest`) that built programs through the
program server on a fingerprint stores the keys it built that no plan of the application
names yet, in the order it built them, as an artifact of family :data:`PLAN_FAMILY` in
that fingerprint's namespace, in the first free of :data:`PLAN_SLOTS` slots (first writer
wins each slot: a pool's children, an MPI job's ranks, each add what they built). A
plan is data, never code: a list of program keys, read within limits (:func:`decode`);
the worst a forged plan can do is make a node prove programs the application will not
ask for. Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
import threading

from farm.core.hashing import stable_hash
from farm.core.keys import PLAN_FAMILY
from farm.core.runenv import script_digest

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from farm.store.base import ArtifactStore

_FORMAT = 1
PLAN_BUILD_ID = stable_hash({"kind": PLAN_FAMILY, "format": _FORMAT}, 24)
#: programs one plan names at most (past it, the first ones)
MAX_PROGRAMS = 4096
#: plans of one application on one fingerprint at most (read in order until a miss)
PLAN_SLOTS = 16
#: a program key's ``id`` (:func:`farm.programs.program_key.program_id`)
_KEY = re.compile(r"[0-9a-f]{64}")


def plan_id(app: str, slot: int) -> str:
    """The ``id`` of plan ``slot`` of the application whose main script has digest
    ``app``."""
    return stable_hash({"kind": PLAN_FAMILY, "app": app, "slot": slot}, 64)


def encode(keys: list[str]) -> bytes:
    """A plan of ``keys`` (program key ids, in build order, each once)."""
    return json.dumps({"format": _FORMAT, "programs": list(dict.fromkeys(keys))
                       [:MAX_PROGRAMS]}, separators=(",", ":")).encode("ascii")


def decode(data: bytes) -> list[str]:
    """The program key ids of a plan; ``ValueError`` for anything else."""
    if len(data) > 80 * MAX_PROGRAMS:
        raise ValueError("a plan over its size")
    try:
        plan = json.loads(data)
    except RecursionError:
        raise ValueError("a plan nested too deep") from None
    if type(plan) is not dict or plan.keys() != {"format", "programs"} \
            or type(plan["format"]) is not int or plan["format"] != _FORMAT:
        raise ValueError("not a plan of this format")
    keys = plan["programs"]
    if type(keys) is not list or len(keys) > MAX_PROGRAMS or not all(
            type(k) is str and _KEY.fullmatch(k) for k in keys):
        raise ValueError("a plan's programs are not program keys")
    return list(dict.fromkeys(keys))


def store_plans(store: ArtifactStore, app: str, built: dict[str, list[str]]) -> None:
    """Store what this process built on each fingerprint of ``built`` (program keys, in
    order) that no plan of application ``app`` there names yet, in the first free slot."""
    from farm.core.keys import Namespace
    from farm.core.model import Artifact, Key
    from farm.store.base import PutResult

    for fingerprint, keys in built.items():
        ns = Namespace.for_fingerprint(fingerprint)
        todo = list(keys)
        slot, rounds = 0, 2 * PLAN_SLOTS  # a slot refused and then not found, forever
        while todo and slot < PLAN_SLOTS and rounds > 0:
            rounds -= 1
            key = Key(id_hash=plan_id(app, slot), build_id=PLAN_BUILD_ID)
            there = store.get(ns, key)
            if there is not None:
                try:
                    named = set(decode(there.binary))
                except ValueError:
                    named = set()
                todo = [k for k in todo if k not in named]
                slot += 1
                continue
            art = Artifact.create(key, PLAN_FAMILY, encode(todo), key.id_hash)
            if store.put(ns, art) is not PutResult.REFUSED:
                break  # this fingerprint's plan stored; the next fingerprint's


def application_digest() -> str:
    """The digest of the main script (``""`` when there is none: ``python -c``, a REPL)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return script_digest(path) if path else ""


class Built:
    """What one process built, per fingerprint, in order (thread-safe); its application
    is read when it is made (Python drops the main module's ``__file__`` before the
    process's exit)."""

    def __init__(self) -> None:
        self.app = application_digest()
        self._lock = threading.Lock()
        self._keys: dict[str, list[str]] = {}

    def add(self, fingerprint: str, key: str) -> None:
        """A program built (loaded or compiled) for ``fingerprint``."""
        with self._lock:
            keys = self._keys.setdefault(fingerprint, [])
            if key not in keys:
                keys.append(key)

    def store(self, store: Callable[[], ArtifactStore], warn: Callable[[str], None]) -> None:
        """Store it as the application's plan (:func:`store_plans`), where there is an
        application and something was built; a failure is one warning, never an error.
        Called by a process that used the program server (its store is open): one the
        quick path served alone found a plan, or its node had proven everything."""
        from farm.core.errors import FarmError

        with self._lock:
            built = {fp: list(keys) for fp, keys in self._keys.items()}
        if self.app and built:
            try:
                store_plans(store(), self.app, built)
            except (OSError, ValueError, FarmError) as exc:
                warn(f"the application's plan was not stored "
                     f"({' '.join(str(exc).split())[:200]})")
