"""Finding kernel families by name.

Families come from the entry-point group ``kernel_farm.families`` (the farm's own
built-in library registers itself there too) and from modules named in settings
(``FARM_FAMILY_MODULES``), so a user's package of kernels installed on the workers is
picked up without any change to the farm. An entry point or module provides either a
``KernelFamily`` subclass or an iterable of them (a module: its ``FAMILIES`` attribute).

A registry is built once per process and passed explicitly; there is no global one.

A plugin is code from outside the farm, so loading one is a trust boundary of its own:
an entry point that names a missing module or attribute, that fails while importing, or
that provides something other than ``KernelFamily`` subclasses is *skipped* with one
warning line (kept in :attr:`Registry.broken`), never a traceback from every command:
a manifest that does not use it must still build. Asking for a family such a plugin
would have provided says which entry point failed and why.

A plugin that names a family after one already registered (a built-in's, or another
plugin's) is skipped the same way, its clash named: the built-in families are
registered first and always win, so an installed package can neither break every
command nor replace a built-in family's code. The taken names are listed in
docs/PLUGINS.md.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from collections.abc import Iterable, Iterator
from importlib.metadata import entry_points
from typing import Any

from farm.core.errors import SettingsError, UnknownFamilyError
from farm.families.base import KernelFamily

ENTRY_POINT_GROUP = "kernel_farm.families"
#: the farm's own entry point (pyproject.toml): registered first, from the module itself
BUILTIN_ENTRY_POINT = "farm.families.builtin:FAMILIES"

log = logging.getLogger(__name__)


class Registry:
    """Name -> family instance. Two families of one name is a configuration error."""

    def __init__(self, families: Iterable[KernelFamily[Any]] = ()) -> None:
        self._families: dict[str, KernelFamily[Any]] = {}
        #: entry point name -> why it could not be loaded
        self.broken: dict[str, str] = {}
        for family in families:
            self.add(family)

    def add(self, family: KernelFamily[Any]) -> None:
        have = self._families.get(family.name)
        if have is not None and type(have) is not type(family):
            raise SettingsError(f"two kernel families named {family.name!r}: "
                                f"{type(have).__module__} and {type(family).__module__}")
        self._families[family.name] = family

    def _check_free(self, families: list[KernelFamily[Any]]) -> None:
        """A SettingsError naming the first family whose name is taken already."""
        for family in families:
            have = self._families.get(family.name)
            if have is not None and type(have) is not type(family):
                origin = ("a built-in family" if type(have).__module__.startswith(
                    "farm.families.builtin") else f"the family of {type(have).__module__}")
                raise SettingsError(f"family {family.name!r} of {type(family).__module__} "
                                    f"clashes with {origin} of that name: rename it")

    def get(self, name: str) -> KernelFamily[Any]:
        try:
            return self._families[name]
        except KeyError:
            hint = ""
            close = difflib.get_close_matches(str(name), list(self._families), n=1)
            if close:
                hint = f" (did you mean {close[0]!r}?)"
            elif self.broken:
                first = next(iter(self.broken.items()))
                hint = (f" (the family plugin {first[0]!r} could not be loaded: "
                        f"{first[1]})")
            raise UnknownFamilyError(f"unknown kernel family {str(name)[:100]!r}{hint}"
                                     ) from None

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
        from farm.families.builtin import FAMILIES  # first: a plugin never replaces one

        for family_cls in FAMILIES:
            registry.add(family_cls())
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.value == BUILTIN_ENTRY_POINT:
                continue
            try:
                provided = _family_classes(ep.load(), f"entry point {ep.name}")
                instances = [family_cls() for family_cls in provided]
                registry._check_free(instances)
            except (Exception, SystemExit) as exc:  # plugin code: anything it raises
                why = _why(exc)                       # (sys.exit too) is its own fault
                registry.broken[ep.name] = why
                log.warning("family plugin %s (%s) skipped: %s", ep.name, ep.value, why)
                continue
            for family in instances:
                registry.add(family)
        for name in extra_modules:
            try:
                module = importlib.import_module(name)
            except (Exception, SystemExit) as exc:  # the module's own code runs here
                raise SettingsError(f"family module {name!r} cannot be imported: "
                                    f"{_why(exc)}") from None
            listed = getattr(module, "FAMILIES", None)
            if listed is None:
                raise SettingsError(f"family module {name!r} has no FAMILIES list")
            try:
                instances = [c() for c in _family_classes(listed, f"module {name}")]
            except SettingsError:
                raise
            except Exception as exc:
                raise SettingsError(f"family module {name!r}: {_why(exc)}") from None
            for family in instances:
                registry.add(family)
        return registry


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def _family_classes(obj: object, where: str) -> list[type[KernelFamily[Any]]]:
    if isinstance(obj, type):
        items: list[Any] = [obj]
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    else:  # a module, a function, a string: not what the entry point should name
        raise SettingsError(f"{where} provides {type(obj).__name__} {obj!r:.80}, not a "
                            "KernelFamily subclass or a list of them")
    for item in items:
        if not (isinstance(item, type) and issubclass(item, KernelFamily)):
            raise SettingsError(f"{where} provides {item!r:.80}, not a KernelFamily subclass")
        name = getattr(item, "name", None)
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise SettingsError(f"{where}: {item.__name__} has no family name (a `name` "
                                "class attribute of 1 to 200 characters)")
    return items
