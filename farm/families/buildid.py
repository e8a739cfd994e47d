"""A family's build id: a hash of the code that defines it, and of the farm version.

Artifacts are stored under (id hash, build id), so what the build id covers decides what
a change rekeys. Two rules, by where the family's code lives:

* **The farm's own families** (a module under the ``farm`` package, and any ``farm``
  module named in ``depends_on``): the module's file and, recursively, every ``farm``
  module it imports, read from the source with :mod:`ast` (imports inside functions
  count; a parent package's ``__init__`` counts only when a name is taken from it, so
  ``farm/families/builtin/__init__.py``, which imports every built-in family, does not
  tie them together). Editing ``softmax.py`` rekeys softmax's artifacts and nothing
  else; editing what every family imports (``farm/core/model.py``, ``base.py``) rekeys
  them all. The farm reads no data file for its families (a test keeps it so), so the
  imported modules are the whole definition.
* **A plugin's families**: every file of the outermost regular package of the module
  (and of each module in ``depends_on``), data files included, ``__pycache__`` and
  hidden files left out. A plugin may read its OpenCL C from a ``.cl`` file or build it
  in a helper the imports do not show; hashing the package makes a stale binary
  impossible by construction rather than by its author listing every file it reads.

Both hash the farm version too. Why not the whole ``farm`` package for the built-in
families (as before issue 32): one fix to softmax made a fleet rekey its matmuls.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import sys
from pathlib import Path
from types import ModuleType

from farm.core.hashing import sha256_hex
from farm.version import __version__

#: the farm's own top-level package: modules under it are hashed by their imports
FARM_PACKAGE = "farm"
#: the folder that holds the ``farm`` package (the root its module names resolve under)
FARM_ROOT = Path(__file__).resolve().parents[2]

#: never part of a package's code: byte-code caches, editor and VCS litter
_SKIPPED_DIRS = frozenset({"__pycache__"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo", "~", ".swp")


@functools.cache
def build_id(cls: type) -> str:
    """The build id of the family class ``cls``; cached per process because files do
    not change under a running process (a changed family is seen by the next one)."""
    return build_id_of([cls.__module__, *getattr(cls, "depends_on", ())], FARM_ROOT)


def build_id_of(modules: list[str], farm_root: Path = FARM_ROOT) -> str:
    """Hash of the code of ``modules`` (a family's module and its ``depends_on``) and of
    the farm version. ``farm_root`` is where ``farm`` modules are read from: a test
    points it at a changed copy of the package."""
    parts = [f"farm {__version__}"]
    farm_modules = [m for m in modules if _is_farm(m)]
    if farm_modules:
        parts += [f"{name} {digest}" for name, digest in
                  sorted(farm_closure_digests(tuple(farm_modules), farm_root).items())]
    roots: list[str] = []
    for name in modules:
        if _is_farm(name):
            continue
        module = sys.modules.get(name) or importlib.import_module(name)
        for root in _code_roots(module):
            if root not in roots:
                roots.append(root)
    parts += [_root_digest(root) for root in roots]
    return sha256_hex("\n\0".join(parts))[:24]


def _is_farm(module: str) -> bool:
    return module == FARM_PACKAGE or module.startswith(FARM_PACKAGE + ".")


# -- the farm's own code: a module and what it imports --------------------------------------
def farm_closure_digests(modules: tuple[str, ...], farm_root: Path = FARM_ROOT
                         ) -> dict[str, str]:
    """``{module name: SHA-256 of its file}`` for ``modules`` and every ``farm`` module
    they import, directly or not."""
    found: dict[str, str] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = module_path(name, farm_root)
        if path is None:
            raise ImportError(f"no module {name} under {farm_root}")
        data = path.read_bytes()
        found[name] = hashlib.sha256(data).hexdigest()
        todo += [m for m in _farm_imports(name, path, data, farm_root) if m not in found]
    return found


def module_path(name: str, farm_root: Path) -> Path | None:
    """The file of module ``name`` under ``farm_root`` (a package's ``__init__.py``)."""
    base = farm_root.joinpath(*name.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def _farm_imports(name: str, path: Path, data: bytes, farm_root: Path) -> set[str]:
    """The ``farm`` modules that module ``name`` imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: set[str] = set()
    for node in ast.walk(ast.parse(data, filename=str(path))):
        if isinstance(node, ast.Import):
            wanted.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            origin = _absolute(package, node.level, node.module)
            submodules = {f"{origin}.{a.name}" for a in node.names
                          if module_path(f"{origin}.{a.name}", farm_root) is not None}
            wanted.update(submodules)
            if len(submodules) < len(node.names):  # a name defined by ``origin`` itself
                wanted.add(origin)
    return {m for m in wanted if _is_farm(m) and module_path(m, farm_root) is not None}


def _absolute(package: str, level: int, module: str | None) -> str:
    """The module a (possibly relative) ``from ... import`` names."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([module] if module else []))


# -- a plugin's code: its whole package -----------------------------------------------------
def _code_roots(module: ModuleType) -> list[str]:
    """What can change ``module``'s behaviour: its outermost regular package (folders
    with every file in them), or the module file itself when it is in no package."""
    parts = module.__name__.split(".")
    for depth in range(1, len(parts) + 1):
        outer = sys.modules.get(".".join(parts[:depth]))
        if outer is None:
            break
        outer_file = getattr(outer, "__file__", None)
        if outer_file is None:
            continue  # a namespace package spans unrelated projects: look one level down
        paths = list(getattr(outer, "__path__", []) or [])
        return [str(Path(p).resolve()) for p in paths] or [str(Path(outer_file).resolve())]
    file = getattr(module, "__file__", None)
    return [str(Path(file).resolve())] if file else [f"module:{module.__name__}"]


@functools.cache
def _root_digest(root: str) -> str:
    """SHA-256 over every file under ``root`` (or of the file ``root``): relative names
    and contents, in a fixed order, read in chunks so that size costs no memory."""
    digest = hashlib.sha256()
    path = Path(root)
    if root.startswith("module:") or not path.exists():
        digest.update(root.encode())
        return digest.hexdigest()
    files = [path] if path.is_file() else sorted(
        f for f in path.rglob("*")
        if f.is_file() and not f.name.startswith(".")
        and not f.name.endswith(_SKIPPED_SUFFIXES)
        and not _SKIPPED_DIRS.intersection(f.relative_to(path).parts)
        and not any(part.startswith(".") for part in f.relative_to(path).parts))
    for f in files:
        name = f.name if f == path else f.relative_to(path).as_posix()
        digest.update(name.encode("utf-8", "surrogateescape") + b"\0")
        try:
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:  # unreadable: its name and the reason still count
            digest.update(f"unreadable {exc.errno}".encode())
        digest.update(b"\0")
    return digest.hexdigest()
