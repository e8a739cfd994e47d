"""Tuning keys: which kernels are candidates of one problem, and the key their measurement
is stored under.

A family with a tuning space names its *tuning parameters*
(:attr:`~farm.families.base.KernelFamily.tuning_params`, matmul's tile shape); every other
parameter, with the launch settings and the variant (build options), is the *problem*.
Kernels of one family whose parameters differ only in tuning parameters are candidates
of one problem, in the order they are listed (the first is what a user gets untuned).

A :class:`TuningSpec` is a problem and its candidate list. Its key (:meth:`TuningSpec.key`)
hashes the family, the problem, launch, variant and the digest of the candidate list,
with the family's build id as the key's build id: changing the list, the family's code
or (through the namespace) the device or driver gives a new key, so an old winner is
never served for anything else. :meth:`TuningSpec.index_key` leaves the candidate list
out: under it the store keeps the problem's latest tuning, for a reader who knows the
problem only (``KernelLoader.tuned``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import Field, field_validator

from farm.core.errors import InputError, ParameterError
from farm.core.hashing import canonical_json, stable_hash
from farm.core.model import (
    MAX_PARAMS_JSON,
    ArtifactId,
    Frozen,
    KernelId,
    Key,
    LaunchSettings,
    Name,
    Variant,
)
from farm.families import Registry
from farm.families.base import KernelFamily

#: fewest candidates that make a problem worth timing
MIN_CANDIDATES = 2
#: most candidates one key may have (a manifest's tuning list is bounded the same way)
MAX_CANDIDATES = 1024
#: the stored format of a key's hash input; a new one is a new key for everything
KEY_FORMAT = 1

Params = dict[str, Any]


class TuningSpec(Frozen):
    """One problem of one family and its candidates, as the family validated them.

    ``problem`` holds every parameter that is not a tuning choice (defaults filled in),
    each candidate its tuning parameters (likewise): a candidate's kernel has the
    parameters ``{**problem, **candidate}``."""

    family: Name
    problem: Params
    launch: LaunchSettings = LaunchSettings()
    variant: Variant = Variant()
    candidates: tuple[Params, ...] = Field(min_length=1, max_length=MAX_CANDIDATES)
    #: the family's build id where the spec was made
    build_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")

    @field_validator("problem")
    @classmethod
    def _bounded(cls, value: Params) -> Params:
        """Finite JSON of a kernel's parameters' size, as a kernel id's (it comes from
        task payloads and stored results)."""
        try:
            text = canonical_json(value)
        except (TypeError, ValueError, RecursionError):
            raise ValueError("the problem is not finite JSON data") from None
        if len(text) > MAX_PARAMS_JSON:
            raise ValueError(f"the problem takes {len(text)} bytes as JSON, over "
                             f"{MAX_PARAMS_JSON}")
        return value

    # -- identity -------------------------------------------------------------------------
    @property
    def candidates_digest(self) -> str:
        """SHA-256 of the candidate list, in order (the first one is special)."""
        return stable_hash(list(self.candidates), 64)

    def _problem_part(self) -> dict[str, object]:
        return {"format": KEY_FORMAT, "family": self.family, "problem": self.problem,
                "launch": self.launch.model_dump(mode="json"),
                "variant": self.variant.model_dump(mode="json")}

    def key(self) -> Key:
        """Where this problem's measurement over exactly these candidates is stored."""
        return Key(id_hash=stable_hash({**self._problem_part(), "kind": "tune",
                                        "candidates": self.candidates_digest}, 64),
                   build_id=self.build_id)

    def index_key(self) -> Key:
        """Where the problem's latest tuning is stored, whatever its candidates."""
        return Key(id_hash=stable_hash({**self._problem_part(), "kind": "tune-index"}, 64),
                   build_id=self.build_id)

    def same_problem(self, other: TuningSpec) -> bool:
        """Whether ``other`` is a tuning of this problem (any candidate list): what
        :meth:`index_key` hashes, compared as values."""
        return (self.family, self.problem, self.launch, self.variant, self.build_id) == \
            (other.family, other.problem, other.launch, other.variant, other.build_id)

    # -- what it names ------------------------------------------------------------------------
    def params(self, index: int) -> Params:
        """The whole parameters of candidate ``index``."""
        return {**self.problem, **self.candidates[index]}

    def artifact(self, index: int) -> ArtifactId:
        """The artifact id of candidate ``index``."""
        return ArtifactId(kernel=KernelId(family=self.family, params=self.params(index),
                                          launch=self.launch), variant=self.variant)

    def artifacts(self) -> list[ArtifactId]:
        return [self.artifact(i) for i in range(len(self.candidates))]

    def label(self) -> str:
        """The problem as people read it: ``m=64 n=64 k=64 dtype=float`` (and the build
        options, where there are some)."""
        text = " ".join(f"{k}={v}" for k, v in self.problem.items())
        if self.launch.local_size is not None:
            text += f" local_size={list(self.launch.local_size)}"
        if self.variant.options:
            text += f" options={' '.join(self.variant.options)}"
        return text


def candidate_label(params: Mapping[str, Any]) -> str:
    """A candidate as people read it: ``tile_m=16 tile_n=16 ...``."""
    return " ".join(f"{k}={v}" for k, v in params.items())


def split(family: KernelFamily[Any], params: Mapping[str, Any]) -> tuple[Params, Params]:
    """(problem, tuning parameters) of a kernel's validated parameters."""
    tuning = set(family.tuning_params)
    problem = {k: v for k, v in params.items() if k not in tuning}
    choice = {k: params[k] for k in family.tuning_params if k in params}
    return problem, choice


def plan(artifacts: Iterable[ArtifactId], registry: Registry) -> list[TuningSpec]:
    """The tuning keys of a build's kernels: the kernels of families with a tuning
    space grouped by problem, candidates in the order listed, problems with fewer than
    :data:`MIN_CANDIDATES` candidates left out (nothing to choose). Order: a problem's
    first appearance."""
    groups: dict[str, tuple[KernelFamily[Any], Params, ArtifactId, list[Params]]] = {}
    for artifact in artifacts:
        family = registry.get(artifact.kernel.family)
        if not family.tuning_params:
            continue
        problem, choice = split(family, artifact.kernel.params)
        ident = canonical_json([family.name, problem,
                                artifact.kernel.launch.model_dump(mode="json"),
                                artifact.variant.model_dump(mode="json")])
        group = groups.setdefault(ident, (family, problem, artifact, []))
        if choice not in group[3]:
            group[3].append(choice)
    specs = []
    for family, problem, artifact, choices in groups.values():
        if len(choices) >= MIN_CANDIDATES:
            specs.append(TuningSpec(family=family.name, problem=problem,
                                    launch=artifact.kernel.launch, variant=artifact.variant,
                                    candidates=tuple(choices[:MAX_CANDIDATES]),
                                    build_id=family.build_id))
    return specs


def spec_for(registry: Registry, family_name: str, problem: Mapping[str, Any], *,
             candidates: Sequence[Mapping[str, Any]] | None = None,
             launch: LaunchSettings | None = None, variant: Variant | None = None,
             first_only: bool = False) -> TuningSpec:
    """The spec of a problem given by hand (``KernelLoader.tuned``): the family's
    validation fills in defaults; ``candidates`` default to the family's tuning space
    (``first_only``: its first candidate alone, enough for :meth:`TuningSpec.index_key`
    and costing one validation instead of one per candidate).
    :class:`ParameterError` for parameters the family refuses, :class:`InputError` for
    a family without a tuning space or a tuning parameter given as the problem."""
    family = registry.get(family_name)
    if not family.tuning_params:
        raise InputError(f"family {family.name!r} has no tuning space (no tuning_params)")
    chosen = [p for p in problem if p in family.tuning_params]
    if chosen:
        raise InputError(f"{family.name}: {', '.join(chosen)} are tuning choices, not part "
                         "of the problem")
    choices = list(candidates) if candidates is not None else list(family.tuning_space)
    if first_only:
        choices = choices[:1]
    if not choices:
        raise InputError(f"family {family.name!r} names no tuning_space: give the "
                         "candidates")
    if len(choices) > MAX_CANDIDATES:
        raise InputError(f"{len(choices)} candidates; at most {MAX_CANDIDATES}")
    canonical_problem: Params | None = None
    canonical: list[Params] = []
    for choice in choices:
        extra = [p for p in choice if p not in family.tuning_params]
        if extra:
            raise ParameterError(f"{family.name}: candidate {dict(choice)}: "
                                 f"{', '.join(extra)} are not tuning parameters "
                                 f"({', '.join(family.tuning_params)})")
        full = family.kernel_id({**problem, **choice}, launch).params
        got_problem, got_choice = split(family, full)
        if canonical_problem is None:
            canonical_problem = got_problem
        if got_choice not in canonical:
            canonical.append(got_choice)
    assert canonical_problem is not None
    return TuningSpec(family=family.name, problem=canonical_problem,
                      launch=launch or LaunchSettings(), variant=variant or Variant(),
                      candidates=tuple(canonical), build_id=family.build_id)
