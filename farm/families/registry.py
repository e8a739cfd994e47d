"""Finding kernel families by name.

Families come from the entry-point group ``kernel_farm.families`` (the farm's own
built-in library registers itself there too) and from modules named in settings
(``FARM_FAMILY_MODULES``), so a user's package of kernels installed on the workers is
picked up without any change to the farm. An entry point or module provides either a
``KernelFamily`` subclass or an iterable of them (a module: its ``FAMILIES`` attribute).

A registry is built once per process and passed explicitly; there is no global one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from importlib.metadata import entry_points
from typing import Any

from farm.errors import SettingsError, UnknownFamilyError
from farm.families.base import KernelFamily

ENTRY_POINT_GROUP = "kernel_farm.families"


class Registry:
    """Name -> family instance. Two families of one name is a configuration error."""

    def __init__(self, families: Iterable[KernelFamily[Any]] = ()) -> None:
        self._families: dict[str, KernelFamily[Any]] = {}
        for family in families:
            self.add(family)

    def add(self, family: KernelFamily[Any]) -> None:
        have = self._families.get(family.name)
        if have is not None and type(have) is not type(family):
            raise SettingsError(f"two kernel families named {family.name!r}: "
                                f"{type(have).__module__} and {type(family).__module__}")
        self._families[family.name] = family

    def get(self, name: str) -> KernelFamily[Any]:
        try:
            return self._families[name]
        except KeyError:
            raise UnknownFamilyError(f"unknown kernel family {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._families

    def __iter__(self) -> Iterator[KernelFamily[Any]]:
        return iter(sorted(self._families.values(), key=lambda f: f.name))

    def __len__(self) -> int:
        return len(self._families)

    def names(self) -> list[str]:
        return sorted(self._families)

    @classmethod
    def load(cls, extra_modules: Iterable[str] = ()) -> Registry:
        """Built-in families, every entry point, and ``extra_modules``."""
        registry = cls()
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            for family_cls in _family_classes(ep.load(), f"entry point {ep.name}"):
                registry.add(family_cls())
        if "builtin" not in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}:
            from farm.families.builtin import FAMILIES  # not installed as a distribution

            for family_cls in FAMILIES:
                registry.add(family_cls())
        for name in extra_modules:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise SettingsError(f"family module {name!r} cannot be imported: {exc}") from None
            provided = getattr(module, "FAMILIES", None)
            if provided is None:
                raise SettingsError(f"family module {name!r} has no FAMILIES list")
            for family_cls in _family_classes(provided, f"module {name}"):
                registry.add(family_cls())
        return registry


def _family_classes(obj: object, where: str) -> list[type[KernelFamily[Any]]]:
    items = [obj] if isinstance(obj, type) else list(obj)  # type: ignore[call-overload]
    for item in items:
        if not (isinstance(item, type) and issubclass(item, KernelFamily)):
            raise SettingsError(f"{where} provides {item!r}, not a KernelFamily subclass")
    return items
