"""The model manifests shipped with the farm (``tiny``, ``medium``, ``large``).

A package of its own, holding only data and this look-up, so that naming the built-ins
(``farm manifest --help``, ``farm build --help``) imports nothing of the manifest schema,
the kernel families or numpy.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent


def builtin_manifests() -> dict[str, Path]:
    """Name -> path of the manifests shipped with the farm."""
    return {p.stem: p for p in sorted(BUILTIN_DIR.glob("*.toml"))}
