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

Every problem is a :class:`~farm.core.errors.ManifestError` of one line,
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
The package, by seam: ``schema`` (the format and its bounds), ``load`` (reading a file,
finding a built-in), ``expand`` (a manifest into kernel instances), ``messages`` (one-line
errors) and ``lines`` (where a field is in the TOML text).
"""

from __future__ import annotations

from farm.manifest.expand import expand, summarize
from farm.manifest.load import load_manifest, resolve_manifest
from farm.manifest.schema import (
    FORMAT_VERSION,
    MATMUL_MAX_DIM,
    MATRIX_SHAPES,
    MAX_FILE_BYTES,
    MAX_KERNELS,
    Entry,
    KernelSpec,
    Manifest,
    MatmulTile,
    ModelSpec,
)
from farm.manifests import BUILTIN_DIR, builtin_manifests

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
