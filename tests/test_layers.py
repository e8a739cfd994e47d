"""No import cycles, and every package in the one layering of ``pyproject.toml``.

`lint-imports` keeps the contracts (the layers, and ``acyclic_siblings``); this test says
the same in the suite, with the cycle spelt out import by import, and checks what a
contract cannot: that a new package of ``farm/`` has a place in the layers (a package
left out of them would be checked by nothing).

The graph is grimp's (what import-linter builds): every import, at the top of a module,
inside a function or under ``TYPE_CHECKING``. A cycle through a function-level import
is still two modules that need each other.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOTS = ("farm", "worker", "loader")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

Edges = Mapping[str, set[str]]


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, succ = work[-1]
            for nxt in succ:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*ROOTS, cache_dir=None)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return _graph()


def _child(parent: str, module: str) -> str | None:
    """The child of ``parent`` that ``module`` is or lies under (``None``: not under it)."""
    if not module.startswith(parent + "."):
        return None
    return parent + "." + module[len(parent) + 1:].split(".")[0]


def sibling_edges(graph: grimp.ImportGraph, parent: str) -> dict[str, set[str]]:
    """The imports between the children of ``parent`` (a child stands for itself and
    everything under it)."""
    edges: dict[str, set[str]] = {}
    for module in graph.find_descendants(parent):
        a = _child(parent, module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = _child(parent, imported)
            if a is not None and b is not None and a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def _why(graph: grimp.ImportGraph, a: str, b: str) -> str:
    """The first import that makes child ``a`` import child ``b``, with its line."""
    for module in sorted({a, *graph.find_descendants(a)} & set(graph.modules)):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported == b or imported.startswith(b + "."):
                line = graph.get_import_details(importer=module, imported=imported)
                at = f" (line {line[0]['line_number']})" if line else ""
                return f"{module} -> {imported}{at}"
    return f"{a} -> {b}"


def describe(graph: grimp.ImportGraph, edges: Edges, component: Iterable[str]) -> str:
    members = set(component)
    return "; ".join(_why(graph, a, b) for a in sorted(members)
                     for b in sorted(edges.get(a, set()) & members))


def test_no_two_packages_nor_two_modules_import_each_other(graph: grimp.ImportGraph) -> None:
    """At every level (the farm's packages, a package's modules, a subpackage's), the
    children of a package import each other in one direction only."""
    parents = [p for root in ROOTS for p in (root, *graph.find_descendants(root))
               if graph.find_children(p)]
    found = []
    for parent in sorted(parents):
        edges = sibling_edges(graph, parent)
        found += [f"{' <-> '.join(c)}: {describe(graph, edges, c)}" for c in cycles(edges)]
    assert found == []


def test_no_module_is_in_a_cycle(graph: grimp.ImportGraph) -> None:
    """Module by module, across packages too (a package's ``__init__`` and a module
    under it that imports the package, say)."""
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert [f"{' <-> '.join(c)}: {describe(graph, edges, c)}" for c in cycles(edges)] == []


def _layers() -> list[str]:
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [name.strip() for layer in layers for name in layer.replace(":", "|").split("|")]


def test_every_package_has_its_place_in_the_layers(graph: grimp.ImportGraph) -> None:
    named = _layers()
    assert len(named) == len(set(named))
    wanted = {c for c in graph.find_children("farm")} | {"worker", "loader"}
    assert wanted - set(named) == set()
    assert set(named) - wanted == set()


def test_the_check_finds_a_cycle_between_packages_and_between_modules() -> None:
    """The checks above on a graph with cycles: they name them, import by import."""
    fake = grimp.ImportGraph()
    for module in ("top", "top.a", "top.a.x", "top.b", "top.b.y", "top.c", "top.d"):
        fake.add_module(module)
    fake.add_import(importer="top.a.x", imported="top.b.y", line_number=3, line_contents="")
    fake.add_import(importer="top.b.y", imported="top.a", line_number=7, line_contents="")
    fake.add_import(importer="top.c", imported="top.d", line_number=1, line_contents="")
    fake.add_import(importer="top.d", imported="top.c", line_number=2, line_contents="")
    edges = sibling_edges(fake, "top")
    assert cycles(edges) == [["top.a", "top.b"], ["top.c", "top.d"]]
    assert describe(fake, edges, ["top.a", "top.b"]) == \
        "top.a.x -> top.b.y (line 3); top.b.y -> top.a (line 7)"
    modules = {m: set(fake.find_modules_directly_imported_by(m)) for m in fake.modules}
    assert cycles(modules) == [["top.c", "top.d"]]  # a package cycle need not be a module one
