"""The manifest format: the pydantic models a manifest file validates into, and its
bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from farm.core.errors import first_error
from farm.core.model import ArtifactId, Frozen, LaunchSettings, Variant
from farm.manifest.lines import Loc, _LineIndex

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

DType = Literal["float", "half", "double"]
MatrixShape = Literal["qkv", "o", "gate_up", "down", "lm_head", "*"]
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
                raise ValueError(first_error(exc)[1]) from None
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
        raise ValueError(first_error(exc)[1]) from None
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
