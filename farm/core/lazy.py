"""Public names of a package imported on first use (PEP 562), listed once.

Why lazy: a package's ``__init__`` that imports every public name makes ``import farm``
(or ``farm.records``, ``loader``) pay for numpy, SQLAlchemy or pydantic-settings even
when the caller needs none of them; ``farm --help`` and a loader's start-up would.

Why from the ``if TYPE_CHECKING:`` block: a type checker needs the names as imports (a
user's ``farm.KernelError`` is then the real class to mypy), and a table of the same
names beside them was the same list again (with ``__all__`` a third time). So the block
is the one list: :func:`public_names` reads it, once, when the package is first asked
for a name it does not hold, and answers ``__all__`` and ``__dir__`` from it.
"""

from __future__ import annotations

import importlib
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (farm run)
if TYPE_CHECKING:
    from collections.abc import Callable


def type_checking_imports(source: str) -> dict[str, str]:
    """Name -> module of every ``from M import N`` in the top-level ``if TYPE_CHECKING:``
    blocks of ``source`` (a module's text)."""
    import ast

    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                    found.update({a.asname or a.name: stmt.module for a in stmt.names})
    return found


def public_names(package: str) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` of ``package``: its public names are the imports of
    its ``if TYPE_CHECKING:`` block; each is imported when first used and kept in the
    package, and ``__all__`` (sorted) is every one of them."""
    namespace = sys.modules[package].__dict__
    where: dict[str, str] = {}

    def table() -> dict[str, str]:
        if not where:
            with open(namespace["__file__"], encoding="utf-8") as fh:
                where.update(type_checking_imports(fh.read()))
        return where

    def __getattr__(name: str) -> object:
        if name == "__all__":
            value: object = sorted(table())
        else:
            module = table().get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table()})

    return __getattr__, __dir__
