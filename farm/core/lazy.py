"""Public names of a package imported on first use (PEP 562).

Why: a package's ``__init__`` that imports every public name makes ``import farm`` (or
``farm.records``, ``loader``) pay for numpy, SQLAlchemy or pydantic-settings even when
the caller needs none of them; ``farm --help`` and a loader's start-up would.
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: a name of ``where`` (name -> the module
    that defines it) is imported when first asked for, and kept in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    return __getattr__
