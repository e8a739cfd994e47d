"""Expanding a manifest into kernel instances: its explicit kernels, and a model
description planned into its layers' kernels and tuning candidates."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from farm.core.errors import ManifestError, ParameterError, PluginError, UnknownFamilyError
from farm.core.model import ArtifactId, KernelId, LaunchSettings, Variant
from farm.families.registry import Registry
from farm.manifest.lines import Loc
from farm.manifest.messages import _error, _format_loc
from farm.manifest.schema import (
    MATMUL_MAX_DIM,
    MAX_KERNELS,
    Entry,
    KernelSpec,
    Manifest,
    MatmulTile,
    ModelSpec,
)


# ----------------------------------------------------------------------------------------
# Expansion
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Planned:
    """A kernel instance before its family validates it, with the manifest locations its
    parameters came from (so that a family's complaint points at the right line)."""

    family: str
    params: dict[str, Any]
    origin: str
    loc: Loc
    param_locs: Mapping[str, Loc] = field(default_factory=dict)
    launch: LaunchSettings = field(default_factory=LaunchSettings)
    variant: Variant = field(default_factory=Variant)
    explicit: bool = False


def expand(manifest: Manifest, registry: Registry) -> list[Entry]:
    """The kernel instances ``manifest`` asks for, de-duplicated by id hash.

    Order is stable: the model's kernels (per element type, per token bucket, in the
    order a forward pass runs them), then the explicit ``[[kernels]]``; a duplicate keeps
    its first origin. Unknown families and bad parameters are :class:`ManifestError`
    naming the line and field (the family's message is kept); every kernel is looked at,
    so the error carries each problem of the manifest, not only the first.
    """
    seen: set[str] = set()
    entries: list[Entry] = []
    problems: list[str] = []
    for planned in _plan(manifest):
        try:
            artifact = _artifact(manifest, registry, planned)
        except ManifestError as exc:
            problems += [p for p in exc.problems if p not in problems]
            continue
        id_hash = artifact.id_hash
        if id_hash not in seen:
            seen.add(id_hash)
            entries.append(Entry(artifact=artifact, origin=planned.origin))
    if problems:
        more = len(problems) - 1
        raise ManifestError(problems[0] + (f" (and {more} more error"
                                           f"{'s' if more > 1 else ''})" if more else ""),
                            problems)
    return entries


def summarize(entries: Sequence[Entry]) -> dict[str, int]:
    """Kernel count per family, by family name."""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry.family] = counts.get(entry.family, 0) + 1
    return dict(sorted(counts.items()))


def _artifact(manifest: Manifest, registry: Registry, planned: _Planned) -> ArtifactId:
    """Validate one planned kernel with its family; errors point into the manifest.

    A family whose own validation code fails (raises, exits, hangs: a plugin's bug, not
    bad input) does not stop the expansion: the kernel keeps its parameters as written,
    and fails in the build with the family's message, alone."""
    try:
        family = registry.get(planned.family)
        artifact = family.artifact_id(planned.params, planned.launch, planned.variant)
    except PluginError as exc:
        try:
            return ArtifactId(kernel=KernelId(family=planned.family, params=planned.params,
                                              launch=planned.launch), variant=planned.variant)
        except ValidationError:
            raise _located(manifest, planned.loc, planned, str(exc)) from None
    except UnknownFamilyError as exc:
        loc = (*planned.loc, "family") if planned.explicit else planned.loc
        known = ", ".join(registry.names())
        raise _located(manifest, loc, planned, f"{exc} (known: {known})") from None
    except ParameterError as exc:
        problems = []
        for name, text in _parameter_problems(planned.family, exc):
            if planned.explicit:
                loc = (*planned.loc, "params", name) if name else (*planned.loc, "params")
            else:
                loc = planned.param_locs.get(name, planned.loc)
            problems.append(str(_located(manifest, loc, planned, text)))
        raise ManifestError(problems[0], problems) from None
    if planned.launch.local_size is not None:  # a shape the parameters rule out: bad input
        try:
            family.check_launch(planned.params, planned.launch)
        except ParameterError as exc:
            raise _located(manifest, (*planned.loc, "local_size"), planned, str(exc)) \
                from None
    return artifact


def _parameter_problems(family: str, exc: ParameterError) -> list[tuple[str, str]]:
    """(top-level parameter, message) of each error: from the family's validation, or
    from a message ``family: parameter X: why`` a family raised itself."""
    if exc.fields:
        return [("" if where == "params" else where.split(".")[0],
                 f"{family}: parameter {where}: {why}") for where, why in exc.fields]
    match = re.match(r"^[^:]*: parameter ([^:]+): ", str(exc))
    name = match[1].split(".")[0] if match else ""
    return [("" if name == "params" else name, str(exc))]


def _located(manifest: Manifest, loc: Loc, planned: _Planned, what: str) -> ManifestError:
    if not planned.explicit:
        what = f"{what} ({planned.origin})"
    return _error(manifest.source, manifest.line_of(loc), _format_loc(loc), what)


def _plan(manifest: Manifest) -> Iterator[_Planned]:
    """Every kernel instance the manifest names, duplicates included, stopping with an
    error past :data:`MAX_KERNELS` so a runaway product is refused before it is built."""
    count = 0
    items: Iterator[_Planned] = iter(())
    if manifest.model is not None:
        items = _plan_model(manifest.model)
    for planned in _chain(items, _plan_kernels(manifest.kernels)):
        count += 1
        if count > MAX_KERNELS:
            where = "model" if manifest.model is not None else "kernels"
            raise _error(manifest.source, manifest.line_of((where,)), where,
                         f"expands to more than {MAX_KERNELS} kernels (the limit); use "
                         "fewer token buckets, element types or tuning candidates")
        yield planned


def _chain(*iterators: Iterator[_Planned]) -> Iterator[_Planned]:
    for it in iterators:
        yield from it


def _plan_kernels(kernels: Sequence[KernelSpec]) -> Iterator[_Planned]:
    for i, spec in enumerate(kernels):
        yield _Planned(family=spec.family, params=dict(spec.params), origin=f"kernels[{i}]",
                       loc=("kernels", i), launch=spec.launch(), variant=spec.variant(),
                       explicit=True)


def _widest(n: int, widths: Sequence[int] = (4, 2, 1)) -> int:
    """The widest vector width that divides ``n`` (float4 where the shape allows)."""
    return next(w for w in widths if n % w == 0)


def _parts(n: int) -> list[int]:
    """Split ``n`` columns into the fewest near-equal parts matmul accepts."""
    count = -(-n // MATMUL_MAX_DIM)
    size = -(-n // count)
    return [min(size, n - i * size) for i in range(count)]


def _plan_model(model: ModelSpec) -> Iterator[_Planned]:
    """A forward pass of a Llama-style decoder per element type and token bucket.

    Per bucket of ``T`` tokens, in execution order: rmsnorm, the fused QKV projection,
    rotary embedding of queries and keys, attention with a softmax over the ``T``
    positions, the output projection, the residual add, rmsnorm, the fused gate/up
    projection, SwiGLU, the down projection, the residual add; then the LM head and a
    softmax over the vocabulary. Kernels whose shape does not depend on ``T`` are
    planned for the first bucket only. Every matmul is planned once per tuning candidate.
    """
    kv = model.group_kv_heads
    m: Loc = ("model",)
    dims = {
        "qkv": ((model.heads + 2 * kv) * model.head_dim, (*m, "heads"), model.hidden,
                (*m, "hidden")),
        "o": (model.hidden, (*m, "hidden"), model.heads * model.head_dim, (*m, "heads")),
        "gate_up": (2 * model.intermediate, (*m, "intermediate"), model.hidden,
                    (*m, "hidden")),
        "down": (model.hidden, (*m, "hidden"), model.intermediate, (*m, "intermediate")),
        "lm_head": (model.vocab, (*m, "vocab"), model.hidden, (*m, "hidden")),
    }
    base = Variant(options=tuple(model.options))

    def kernel(family: str, params: dict[str, Any], origin: str,
               locs: dict[str, Loc]) -> _Planned:
        return _Planned(family=family, params=params, origin=f"model {origin}", loc=m,
                        param_locs=locs, variant=base)

    for di, dtype in enumerate(model.dtypes):
        d_loc: Loc = (*m, "dtypes", di)

        def matmuls(shape: str, tokens: int, t_loc: Loc, *, dtype: str = dtype,
                    d_loc: Loc = d_loc) -> Iterator[_Planned]:
            n_total, n_loc, k, k_loc = dims[shape]
            key, cands = model.candidates(shape)
            parts = _parts(n_total) if shape == "lm_head" else [n_total]
            for ci, cand in enumerate(cands):
                c_loc: Loc = (*m, "tuning", key, ci) if cand is not None else m
                locs: dict[str, Loc] = {"m": t_loc, "n": n_loc, "k": k_loc, "dtype": d_loc}
                locs.update({f: (*c_loc, f) for f in MatmulTile.model_fields})
                tiles = cand.params() if cand is not None else {}
                for pi, n in enumerate(parts):
                    part = f" part={pi}" if len(parts) > 1 else ""
                    yield kernel("matmul", {"m": tokens, "n": n, "k": k, "dtype": dtype,
                                            **tiles},
                                 f"{dtype} {shape} tokens={tokens} cand={ci}{part}", locs)

        for ti, tokens in enumerate(model.tokens):
            t_loc: Loc = (*m, "tokens", ti)
            first = ti == 0
            if first:
                yield kernel("rmsnorm", {"hidden": model.hidden, "dtype": dtype},
                             f"{dtype} rmsnorm", {"hidden": (*m, "hidden"), "dtype": d_loc})
            yield from matmuls("qkv", tokens, t_loc)
            if first:
                for heads, which in ((model.heads, "heads"), (kv, "kv_heads")):
                    yield kernel("rotary", {"head_dim": model.head_dim, "heads": heads,
                                            "dtype": dtype},
                                 f"{dtype} rotary {which}={heads}",
                                 {"head_dim": (*m, "head_dim"), "heads": (*m, which),
                                  "dtype": d_loc})
                yield kernel("attention", {"head_dim": model.head_dim, "causal": True,
                                           "dtype": dtype},
                             f"{dtype} attention",
                             {"head_dim": (*m, "head_dim"), "dtype": d_loc})
            yield kernel("softmax", {"cols": tokens, "dtype": dtype},
                         f"{dtype} attention softmax tokens={tokens}",
                         {"cols": t_loc, "dtype": d_loc})
            yield from matmuls("o", tokens, t_loc)
            if first:
                width = _widest(model.hidden)
                yield kernel("elementwise_binary", {"op": "add", "dtype": dtype,
                                                    "width": width},
                             f"{dtype} residual add",
                             {"width": (*m, "hidden"), "dtype": d_loc})
            yield from matmuls("gate_up", tokens, t_loc)
            if first:
                width = _widest(model.intermediate)
                yield kernel("swiglu", {"hidden": model.intermediate, "dtype": dtype,
                                        "width": width},
                             f"{dtype} swiglu",
                             {"hidden": (*m, "intermediate"), "width": (*m, "intermediate"),
                              "dtype": d_loc})
            yield from matmuls("down", tokens, t_loc)
            yield from matmuls("lm_head", tokens, t_loc)
        yield kernel("softmax", {"cols": model.vocab, "dtype": dtype},
                     f"{dtype} vocab softmax", {"cols": (*m, "vocab"), "dtype": d_loc})
