"""Model manifests: which kernel instances a build asks for.

A manifest is a TOML file (read with the standard library's ``tomllib``) validated by
the pydantic models below, so a typo is refused where it enters rather than surfacing
as a strange kernel on a worker. It says what to build in one or both of two ways:

* ``[[kernels]]`` entries list kernel instances explicitly (family, parameters, an
  optional ``local_size`` and build ``options``, which are the variant);
* a ``[model]`` table describes a transformer (dimensions, element types, token-count
  buckets, matmul tuning candidates per matrix shape) and expands to the kernels one
  forward pass of that model needs for every element type and bucket.

Explicit kernels come after the model's. :func:`expand` turns a manifest into
:class:`Entry` values (artifact id + where it came from), de-duplicated by id hash in a
stable order, so two expansions of one file ask the farm for the same keys in the same
order on every machine.

Every problem is a :class:`~farm.errors.ManifestError` of one line,
``<file>:<line>: <field.path>: <what is wrong>``: a person fixing a manifest wants to
jump to the line, and the CLI prints it as is. tomllib reports no positions for valid
TOML, so :class:`_LineIndex` scans the text once to find the line of every table, key
and array element.

Format version 1, in short (``docs/FAMILIES.md`` has each family's parameters)::

    format = 1
    name = "example"                      # optional

    [model]
    name = "llama-8b"
    hidden = 4096                         # model width
    heads = 32
    kv_heads = 8                          # grouped-query attention (default: heads)
    head_dim = 128
    intermediate = 14336                  # MLP width
    vocab = 128256
    dtypes = ["float", "half"]            # element types (default ["float"])
    tokens = [1, 16, 128]                 # shape buckets: token counts
    options = []                          # build options of every model kernel

    [model.tuning]                        # matmul candidates per matrix shape
    "*" = [{ tile_m = 16, tile_n = 16, tile_k = 16 }]   # shapes not named below
    lm_head = [{ tile_m = 32, tile_n = 64, tile_k = 16, wpt_m = 2, wpt_n = 4 }]

    [[kernels]]
    family = "matmul"
    params = { m = 64, n = 64, k = 64 }
    local_size = [16, 16]                 # optional
    options = ["-cl-mad-enable"]          # optional
"""

from __future__ import annotations

import bisect
import re
import stat
import tomllib
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from farm.errors import ManifestError, ParameterError, UnknownFamilyError
from farm.families.registry import Registry
from farm.model import ArtifactId, Frozen, LaunchSettings, Variant

__all__ = [
    "BUILTIN_DIR",
    "FORMAT_VERSION",
    "MATMUL_MAX_DIM",
    "MATRIX_SHAPES",
    "MAX_FILE_BYTES",
    "MAX_KERNELS",
    "Entry",
    "KernelSpec",
    "Manifest",
    "MatmulTile",
    "ModelSpec",
    "builtin_manifests",
    "expand",
    "load_manifest",
    "resolve_manifest",
    "summarize",
]

#: the manifest format this farm reads (the ``format`` key)
FORMAT_VERSION = 1
#: a manifest is a hand-written text; anything bigger is a mistake or an attack
MAX_FILE_BYTES = 16 * 1024 * 1024
#: kernels one manifest may ask for (counted before de-duplication); a build of more is
#: almost surely a runaway product of buckets x candidates, and would swamp the farm
MAX_KERNELS = 100_000
#: docs/FAMILIES.md: matmul's m, n and k are 1..65536. A projection wider than that (an
#: LM head over a 128k vocabulary) is planned as the fewest near-equal column parts.
MATMUL_MAX_DIM = 65536
#: the matrix shapes of a transformer layer (and its head) that take tuning candidates
MATRIX_SHAPES: tuple[str, ...] = ("qkv", "o", "gate_up", "down", "lm_head")
#: the built-in manifests (``tiny``, ``medium``, ``large``) shipped as package data
BUILTIN_DIR = Path(__file__).with_name("manifests")

Loc = tuple[str | int, ...]
DType = Literal["float", "half", "double"]
MatrixShape = Literal["qkv", "o", "gate_up", "down", "lm_head", "*"]
PositiveInt = Annotated[int, Field(ge=1)]
#: the largest model dimension (hidden, heads, vocab, tokens...) a manifest may give:
#: far beyond any real model (a 128k vocabulary is 2**17), small enough that planning
#: (e.g. splitting an LM head into matmul parts) stays small before the kernel cap counts
MAX_DIM = 2**24
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
#: matmul tiles and work per thread are powers of two well below this
TileInt = Annotated[int, Field(ge=1, le=2**16)]


# ----------------------------------------------------------------------------------------
# The file format (pydantic at the boundary)
# ----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    """Base of the manifest tables: unknown keys are errors, and no type coercion.

    Strict because a manifest is typed TOML: ``hidden = "4096"`` is a mistake to point
    at, not a value to guess about.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class MatmulTile(_Strict):
    """One tuning candidate for a matrix shape: the matmul family's tile parameters.

    Keys left out take the matmul family's defaults. Ranges (powers of two, work per
    thread) are the family's to check, so they are written down in one place only; an
    out-of-range candidate is reported at its line here when the manifest is expanded.
    """

    tile_m: TileInt | None = None
    tile_n: TileInt | None = None
    tile_k: TileInt | None = None
    wpt_m: TileInt | None = None
    wpt_n: TileInt | None = None

    def params(self) -> dict[str, int]:
        """The matmul parameters this candidate sets."""
        return self.model_dump(exclude_none=True)


class ModelSpec(_Strict):
    """A Llama-style decoder described by its dimensions; expands to its kernels."""

    name: str = Field(min_length=1, max_length=200)
    hidden: Dim
    heads: Dim
    kv_heads: Dim | None = None
    head_dim: Dim
    intermediate: Dim
    vocab: Dim
    dtypes: list[DType] = Field(default_factory=lambda: list[DType](["float"]), min_length=1,
                                max_length=3)
    tokens: list[Dim] = Field(min_length=1, max_length=64)
    tuning: dict[MatrixShape, Annotated[list[MatmulTile],
                                        Field(min_length=1, max_length=1024)]] = Field(
        default_factory=dict)
    options: list[str] = Field(default_factory=list)

    @field_validator("options")
    @classmethod
    def _options_are_flags(cls, value: list[str]) -> list[str]:
        return _check_options(value)

    @model_validator(mode="after")
    def _grouped_heads(self) -> ModelSpec:
        if self.heads % self.group_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.group_kv_heads})")
        return self

    @property
    def group_kv_heads(self) -> int:
        """Key/value heads (grouped-query attention); ``heads`` when not given."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    def candidates(self, shape: str) -> tuple[str, list[MatmulTile | None]]:
        """(tuning key used, candidates) for a matrix shape: its own list, else ``*``,
        else one candidate with the family's default tiles."""
        for key in (shape, "*"):
            if key in self.tuning:
                return key, list(self.tuning[key])
        return "", [None]


class KernelSpec(_Strict):
    """One explicitly listed kernel instance: family, parameters, launch and variant."""

    family: str = Field(min_length=1, max_length=200)
    params: dict[str, Any] = Field(default_factory=dict)
    local_size: list[int] | None = None
    options: list[str] = Field(default_factory=list, max_length=256)
    alignment: int = Field(default=0, ge=0, le=2**20)

    @field_validator("local_size")
    @classmethod
    def _launchable(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            try:
                LaunchSettings(local_size=tuple(value))
            except ValidationError as exc:
                raise ValueError(_first_message(exc)) from None
        return value

    @field_validator("options")
    @classmethod
    def _options_are_flags(cls, value: list[str]) -> list[str]:
        return _check_options(value)

    def launch(self) -> LaunchSettings:
        """The launch settings part of the kernel id."""
        return LaunchSettings(local_size=tuple(self.local_size) if self.local_size else None)

    def variant(self) -> Variant:
        """The variant part of the artifact id."""
        return Variant(options=tuple(self.options), alignment=self.alignment)


class Manifest(_Strict):
    """A whole manifest file. Remembers the file it came from, for error messages."""

    format: int
    name: str | None = None
    description: str = ""
    model: ModelSpec | None = None
    kernels: list[KernelSpec] = Field(default_factory=list, max_length=MAX_KERNELS)

    _source: str = PrivateAttr(default="<manifest>")
    _text: str = PrivateAttr(default="")
    _lines: _LineIndex | None = PrivateAttr(default=None)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(f"format {value} is not supported; this farm reads format "
                             f"{FORMAT_VERSION}")
        return value

    @model_validator(mode="after")
    def _asks_for_something(self) -> Manifest:
        if self.model is None and not self.kernels:
            raise ValueError("the manifest asks for no kernels: add a [model] table or "
                             "[[kernels]] entries")
        return self

    @property
    def source(self) -> str:
        """The file this manifest was read from, as given (``<manifest>`` if none)."""
        return self._source

    @property
    def label(self) -> str:
        """A short name for tables: the manifest's name, its model's, or its file's."""
        if self.name:
            return self.name
        if self.model is not None:
            return self.model.name
        return Path(self._source).stem

    def line_of(self, loc: Loc) -> int | None:
        """The line of ``loc`` (or of its nearest ancestor) in the source text.

        The index is built on the first call: only a manifest with an error needs it.
        """
        if self._lines is None:
            self._lines = _LineIndex(self._text)
            self._text = ""
        return self._lines.line_of(loc)


def _check_options(value: list[str]) -> list[str]:
    """Build options must be what :class:`Variant` accepts; say so at load time."""
    try:
        Variant(options=tuple(value))
    except ValidationError as exc:
        raise ValueError(_first_message(exc)) from None
    return value


class Entry(Frozen):
    """One kernel instance a manifest asks for, and where in the manifest it came from.

    ``origin`` is for people: ``"model float qkv tokens=16 cand=2"`` or ``"kernels[3]"``
    (0-based, like the paths in error messages).
    """

    artifact: ArtifactId
    origin: str

    @property
    def family(self) -> str:
        return self.artifact.kernel.family

    @property
    def id_hash(self) -> str:
        return self.artifact.id_hash


# ----------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------
def load_manifest(path: Path) -> Manifest:
    """Read, parse and validate a manifest file.

    Raises :class:`ManifestError` (one line naming the file, the line and the field) for
    anything wrong with the file: unreadable, not a file, too large, not UTF-8, binary,
    empty, bad TOML, a field of the wrong type or range, an unknown key, or a model whose
    expansion would exceed :data:`MAX_KERNELS`.
    """
    path = Path(path)
    shown = str(path)
    text = _read_text(path, shown)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, what = _toml_position(str(exc), text)
        raise _error(shown, line, "", f"TOML syntax error: {what}") from None
    except RecursionError:
        raise _error(shown, None, "", "TOML nesting too deep") from None
    except ValueError as exc:  # tomllib's int() of a number of more than 4300 digits
        raise _error(shown, None, "", f"TOML value out of range ({_one_line(str(exc))[:120]})"
                     ) from None
    if not data:
        raise _error(shown, None, "", "no keys (only comments or blank lines); a manifest "
                     f"needs format = {FORMAT_VERSION} and a [model] table or [[kernels]] "
                     "entries")
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, shown, _LineIndex(text)) from None
    manifest._source = shown
    manifest._text = text
    for _ in _plan(manifest):  # refuses a runaway expansion now, not in the middle of a build
        pass
    return manifest


def _read_text(path: Path, shown: str) -> str:
    """The file's text, refusing what is not a manifest before reading much of it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise _error(shown, None, "", "no such file") from None
    except OSError as exc:
        raise _error(shown, None, "", f"cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise _error(shown, None, "", "is a directory, not a manifest file")
    if not stat.S_ISREG(info.st_mode):
        raise _error(shown, None, "", "not a regular file")
    if info.st_size > MAX_FILE_BYTES:
        raise _error(shown, None, "", f"{info.st_size} bytes; a manifest may have at most "
                     f"{MAX_FILE_BYTES} bytes (16 MiB)")
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise _error(shown, None, "", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:  # grew since stat
        raise _error(shown, None, "", f"a manifest may have at most {MAX_FILE_BYTES} bytes")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise _error(shown, raw.count(b"\n", 0, nul) + 1, "",
                     "binary data (a NUL byte), not a TOML text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _error(shown, raw.count(b"\n", 0, exc.start) + 1, "",
                     f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
                     ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise _error(shown, None, "", "empty file; a manifest needs format = "
                     f"{FORMAT_VERSION} and a [model] table or [[kernels]] entries")
    return text


_TOML_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_END = re.compile(r"\s*\(at end of document\)\s*$")


def _toml_position(message: str, text: str) -> tuple[int | None, str]:
    """Split tomllib's message into (line, message with the column kept)."""
    match = _TOML_AT.search(message)
    if match:
        return int(match[1]), f"{message[:match.start()]} (column {match[2]})"
    match = _TOML_END.search(message)
    if match:
        return text.count("\n") + (0 if text.endswith("\n") else 1) or 1, \
            f"{message[:match.start()]} (at end of file: truncated?)"
    return None, message


def _validation_error(exc: ValidationError, shown: str, lines: _LineIndex) -> ManifestError:
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = _clean_loc(err["loc"])
    what = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        what = "unknown key" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    if len(errors) > 1:
        what += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return _error(shown, lines.line_of(loc), _format_loc(loc), what)


# ----------------------------------------------------------------------------------------
# Built-in manifests
# ----------------------------------------------------------------------------------------
def builtin_manifests() -> dict[str, Path]:
    """Name -> path of the manifests shipped with the farm (``tiny``, ``medium``...)."""
    return {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.toml"))}


def resolve_manifest(name_or_path: str) -> Path:
    """A path when one exists, else the built-in manifest of that name.

    A path wins so that a file the user wrote is never shadowed by a built-in of the same
    name; a built-in is named without ``.toml`` (``tiny``) or with it.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    builtins = builtin_manifests()
    name = name_or_path.removesuffix(".toml")
    if name in builtins and "/" not in name_or_path and "\\" not in name_or_path:
        return builtins[name]
    names = ", ".join(builtins) or "none installed"
    raise ManifestError(_one_line(f"{name_or_path}: no such file, and no built-in manifest "
                                  f"of that name (built-in: {names})"))


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
    naming the line and field (the family's message is kept).
    """
    seen: set[str] = set()
    entries: list[Entry] = []
    for planned in _plan(manifest):
        artifact = _artifact(manifest, registry, planned)
        id_hash = artifact.id_hash
        if id_hash not in seen:
            seen.add(id_hash)
            entries.append(Entry(artifact=artifact, origin=planned.origin))
    return entries


def summarize(entries: Sequence[Entry]) -> dict[str, int]:
    """Kernel count per family, by family name."""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry.family] = counts.get(entry.family, 0) + 1
    return dict(sorted(counts.items()))


def _artifact(manifest: Manifest, registry: Registry, planned: _Planned) -> ArtifactId:
    """Validate one planned kernel with its family; errors point into the manifest."""
    try:
        family = registry.get(planned.family)
        return family.artifact_id(planned.params, planned.launch, planned.variant)
    except UnknownFamilyError as exc:
        loc = (*planned.loc, "family") if planned.explicit else planned.loc
        known = ", ".join(registry.names())
        raise _located(manifest, loc, planned, f"{exc} (known: {known})") from None
    except ParameterError as exc:
        match = re.match(r"^[^:]*: parameter ([^:]+): ", str(exc))
        name = match[1].split(".")[0] if match else ""
        if planned.explicit:
            loc = (*planned.loc, "params", name) if name and name != "params" else \
                (*planned.loc, "params")
        else:
            loc = planned.param_locs.get(name, planned.loc)
        raise _located(manifest, loc, planned, str(exc)) from None


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


# ----------------------------------------------------------------------------------------
# Error messages: one line, file:line: field.path: what
# ----------------------------------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error(source: str, line: int | None, path: str, what: str) -> ManifestError:
    where = f"{source}:{line}" if line else source
    return ManifestError(_one_line(": ".join(p for p in (where, path, what) if p)))


def _first_message(exc: ValidationError) -> str:
    return str(exc.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")


_PYDANTIC_TAG = re.compile(r"^\[key\]$|^[\w-]+\[.*\]$")


def _clean_loc(loc: Sequence[str | int]) -> Loc:
    """Drop pydantic's own location segments (``[key]``, ``list[int]``...)."""
    return tuple(p for p in loc if isinstance(p, int) or not _PYDANTIC_TAG.match(p))


def _format_loc(loc: Loc) -> str:
    """``("kernels", 3, "params", "op")`` -> ``kernels[3].params.op``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[\w-]+", part) else f'"{part}"'
            out += f".{text}" if out else text
    return out


def _allowed_keys(loc: Loc) -> list[str]:
    """The keys of the table at ``loc`` (for 'unknown key' messages), if it is a model."""
    tp: Any = Manifest
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if not isinstance(part, str) or part not in tp.model_fields:
                return []
            tp = tp.model_fields[part].annotation
        else:
            origin, args = get_origin(tp), get_args(tp)
            if origin is list and args:
                tp = args[0]
            elif origin is dict and len(args) == 2:
                tp = args[1]
            else:
                return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in get_args(tp) if a is not type(None)]
            if len(rest) != 1:
                return tp
            tp = rest[0]
        else:
            return tp


# ----------------------------------------------------------------------------------------
# Line numbers for valid TOML
# ----------------------------------------------------------------------------------------
class _LineIndex:
    """The line where each table, key and array element of a TOML text starts.

    tomllib gives positions only for syntax errors. A validation error names a path
    (``kernels[3].params.op``); this index finds its line. The text has already parsed,
    so the scanner can assume valid TOML; it never raises, and a path it did not record
    falls back to its nearest recorded ancestor (a missing key: its table's header).
    Arrays of tables count from 0 like pydantic's locations.
    """

    def __init__(self, text: str = "") -> None:
        self._lines: dict[Loc, int] = {}
        self._aot: dict[Loc, int] = {}
        self._text = text
        self._pos = 0
        self._newlines = [i for i, c in enumerate(text) if c == "\n"]
        try:
            self._scan()
        except (ValueError, IndexError, RecursionError):
            pass  # keep what was found; callers fall back to ancestors
        self._text = ""
        self._newlines = []

    def line_of(self, loc: Loc) -> int | None:
        """The line of ``loc`` or of its nearest recorded ancestor."""
        for n in range(len(loc), 0, -1):
            line = self._lines.get(tuple(loc[:n]))
            if line is not None:
                return line
        return None

    # -- scanning ---------------------------------------------------------------------
    def _line(self) -> int:
        return bisect.bisect_left(self._newlines, self._pos) + 1

    def _mark(self, path: Loc) -> None:
        for n in range(1, len(path) + 1):
            self._lines.setdefault(path[:n], self._line())

    def _skip(self, newlines: bool) -> None:
        """Skip blanks and comments (and line ends, when ``newlines``)."""
        t = self._text
        while self._pos < len(t):
            c = t[self._pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self._pos += 1
            elif c == "#":
                end = t.find("\n", self._pos)
                self._pos = len(t) if end < 0 else end
            else:
                return

    def _expect(self, token: str) -> None:
        self._skip(newlines=False)
        if not self._text.startswith(token, self._pos):
            raise ValueError(f"expected {token!r}")
        self._pos += len(token)

    def _scan(self) -> None:
        t = self._text
        table: Loc = ()
        while True:
            self._skip(newlines=True)
            if self._pos >= len(t):
                return
            if t.startswith("[[", self._pos):
                self._pos += 2
                base = self._resolve(self._key())
                self._expect("]]")
                index = self._aot.get(base, 0)
                self._aot[base] = index + 1
                table = (*base, index)
                self._mark(table)
            elif t[self._pos] == "[":
                self._pos += 1
                table = self._resolve(self._key())
                self._expect("]")
                self._mark(table)
            else:
                path = (*table, *self._key())
                self._mark(path)
                self._expect("=")
                self._value(path)

    def _resolve(self, parts: list[str]) -> Loc:
        """A header's path, with the current index of each array of tables in it."""
        out: list[str | int] = []
        for i, part in enumerate(parts):
            out.append(part)
            if i < len(parts) - 1 and tuple(out) in self._aot:
                out.append(self._aot[tuple(out)] - 1)
        return tuple(out)

    def _key(self) -> list[str]:
        t = self._text
        parts: list[str] = []
        while True:
            self._skip(newlines=False)
            c = t[self._pos]
            if c == '"':
                start = self._pos + 1
                self._string('"')
                parts.append(t[start:self._pos - 1])
            elif c == "'":
                end = t.index("'", self._pos + 1)
                parts.append(t[self._pos + 1:end])
                self._pos = end + 1
            else:
                match = re.compile(r"[A-Za-z0-9_-]+").match(t, self._pos)
                if not match:
                    raise ValueError("expected a key")
                parts.append(match[0])
                self._pos = match.end()
            self._skip(newlines=False)
            if t.startswith(".", self._pos):
                self._pos += 1
                continue
            return parts

    def _string(self, quote: str) -> None:
        """Skip a one-line string whose opening quote is at the cursor."""
        t = self._text
        self._pos += 1
        while t[self._pos] != quote:
            self._pos += 2 if quote == '"' and t[self._pos] == "\\" else 1
        self._pos += 1

    def _long_string(self, quote: str) -> None:
        t = self._text
        self._pos += 3
        while not t.startswith(quote * 3, self._pos):
            self._pos += 2 if quote == '"' and t[self._pos] == "\\" else 1
        self._pos += 3
        for _ in range(2):  # up to two quotes may end the content
            if t.startswith(quote, self._pos):
                self._pos += 1

    def _value(self, path: Loc) -> None:
        t = self._text
        self._skip(newlines=False)
        c = t[self._pos]
        if c == "{":
            self._pos += 1
            while True:
                self._skip(newlines=True)
                if t[self._pos] == "}":
                    self._pos += 1
                    return
                sub = (*path, *self._key())
                self._mark(sub)
                self._expect("=")
                self._value(sub)
                self._skip(newlines=True)
                if t[self._pos] == ",":
                    self._pos += 1
        elif c == "[":
            self._pos += 1
            index = 0
            while True:
                self._skip(newlines=True)
                if t[self._pos] == "]":
                    self._pos += 1
                    return
                self._mark((*path, index))
                self._value((*path, index))
                self._skip(newlines=True)
                if t[self._pos] == ",":
                    self._pos += 1
                    index += 1
        elif t.startswith('"""', self._pos) or t.startswith("'''", self._pos):
            self._long_string(c)
        elif c in "\"'":
            self._string(c)
        else:
            start = self._pos
            while self._pos < len(t) and t[self._pos] not in ",]}\r\n#":
                self._pos += 1
            if self._pos == start:
                raise ValueError("expected a value")
