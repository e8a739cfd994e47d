"""An application's plan: the programs it builds, per device fingerprint, so that a fresh
node proves them before the application asks (:mod:`farm.programs.ahead`).

The first process of an application (its main script, by digest, as generated code is
named: :func:`farm.programs.generated.application_digest`) that builds programs through
the program server on a fingerprint, where the store holds no plan for it yet, stores the
keys it built, in the order it built them, as an artifact of family :data:`PLAN_FAMILY`
in that fingerprint's namespace (first writer wins). A plan is data, never code: a list
of program keys, read within limits (:func:`decode`); the worst a forged plan can do is
make a node prove programs the application will not ask for. Standard library only.
"""

from __future__ import annotations

import json
import re

from farm.core.hashing import stable_hash
from farm.core.keys import PLAN_FAMILY

#: typing.TYPE_CHECKING without importing typing (see farm.core.errors)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from farm.store.base import ArtifactStore

_FORMAT = 1
PLAN_BUILD_ID = stable_hash({"kind": PLAN_FAMILY, "format": _FORMAT}, 24)
#: programs one plan names at most (past it, the first ones)
MAX_PROGRAMS = 4096
#: a program key's ``id`` (:func:`farm.programs.program_key.program_id`)
_KEY = re.compile(r"[0-9a-f]{64}")


def plan_id(app: str) -> str:
    """The ``id`` of the plan of the application whose main script has digest ``app``."""
    return stable_hash({"kind": PLAN_FAMILY, "app": app}, 64)


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
    """Store the plan of application ``app`` for each fingerprint of ``built`` (the
    program keys this process built there, in order) where the store holds none: the
    first writer's plan stays (what it built is what a fresh node proves)."""
    from farm.core.keys import Namespace
    from farm.core.model import Artifact, Key

    key = Key(id_hash=plan_id(app), build_id=PLAN_BUILD_ID)
    for fingerprint, keys in built.items():
        ns = Namespace.for_fingerprint(fingerprint)
        if keys and store.get(ns, key) is None:
            store.put(ns, Artifact.create(key, PLAN_FAMILY, encode(keys), key.id_hash))
