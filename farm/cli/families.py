"""``farm families``: which kernel families this farm knows, and whether they compute
what numpy says they should on the local device.

For a plugin author these are the first two questions (is my entry point found? does
my kernel work?), answered without writing a test or a manifest. Heavy imports
(pyopencl, the device) happen inside the commands, so ``farm --help`` does not pay.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from farm.cli.help import examples, new_app

app = new_app("List the registered kernel families and check them against numpy.",
              epilog=examples("farm families list", "farm families check matmul"))


@app.callback()
def _group() -> None:
    """Kernel families: ``list`` and ``check``."""


@app.command("list", epilog=examples("farm families list", "farm families list --json"))
def list_families(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of lines.")
                       ] = False,
) -> None:
    """List the registered families, their build ids and origins.

    Also every entry point that could not be loaded, with the reason.
    """
    from farm.core.settings import load_settings
    from farm.families.registry import Registry

    settings = load_settings()
    registry = Registry.load(settings.family_modules)
    origins = _origins(settings.family_modules)
    base_example = _base_example()
    rows: list[dict[str, Any]] = [
        {"name": f.name, "source": origins.get(type(f), type(f).__module__),
         "module": type(f).__module__, "build_id": f.build_id,
         "example": type(f).example is not base_example}
        for f in registry]
    if as_json:
        typer.echo(json.dumps({"families": rows, "broken": registry.broken}, indent=2))
        return
    from farm.cli.console import out
    from farm.cli.tables import Column, print_table

    print_table([Column("family"), Column("build id"), Column("from", wrap=True)],
                [[r["name"], r["build_id"],
                  r["source"] + ("" if r["example"] else "; no example")] for r in rows])
    out.print("build id: a hash of the family's code and of the farm version: for a "
              "built-in family its module and the farm modules it imports, for a plugin "
              "its whole package. Artifacts are stored under it, so a changed family is "
              "compiled anew (or rekeyed, when its source did not change) and its old "
              "artifacts are never served; the other families keep theirs. No example: "
              "`farm families check` cannot run it.", markup=False, highlight=False)
    for name, why in registry.broken.items():
        out.print(f"not loaded: entry point {name}: {why}", markup=False, highlight=False,
                  soft_wrap=True)


@app.command(epilog=examples("farm families check", "farm families check matmul softmax",
                             "farm families check --device pocl --json"))
def check(
    names: Annotated[list[str] | None, typer.Argument(
        metavar="NAME", help="Families to check (default: every registered one).")
    ] = None,
    device: Annotated[str | None, typer.Option(
        metavar="FINGERPRINT|NAME", help="the local device (default: FARM_DEVICE, else the "
        "first)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of lines.")
                       ] = False,
) -> None:
    """Run each family's example on the local device against numpy.

    One line per family; exit status 1 when one differs or fails to compile.
    """
    import pyopencl as cl

    from farm.compilation.family_check import check_family
    from farm.core.device import discover_devices, open_device
    from farm.core.device_probe import choose_device
    from farm.core.settings import load_settings
    from farm.families.registry import Registry

    settings = load_settings(**({"device": device} if device else {}))
    registry = Registry.load(settings.family_modules)
    families = [registry.get(n) for n in names] if names else list(registry)
    info = choose_device(settings, discover_devices())
    ctx, _ = open_device(info)
    queue = cl.CommandQueue(ctx)
    results = [check_family(family, queue, info) for family in families]
    if as_json:
        typer.echo(json.dumps({"device": info.fingerprint, "families": [
            {"name": r.family, "status": r.status, "examples": r.examples,
             "problems": r.problems, "build_log": r.build_log} for r in results]}, indent=2))
    else:
        width = max((len(r.family) for r in results), default=0)
        for r in results:
            detail = "; ".join(r.problems) if r.problems else \
                (f"{r.examples} examples match numpy" if r.examples != 1 else
                 "its example matches numpy")
            typer.echo(f"{r.status:<11} {r.family:<{width}}  {detail}")
            for line in r.build_log.splitlines()[:40]:  # the compiler's whole message
                typer.echo(f"    | {line}")
    if any(r.failed for r in results):
        raise typer.Exit(1)


def _base_example() -> object:
    from farm.families.base import KernelFamily

    return KernelFamily.example


def _origins(modules: list[str]) -> dict[type, str]:
    """Family class -> ``entry point NAME (DISTRIBUTION)`` or ``module NAME``: what made
    it known. An entry point that cannot be loaded is the registry's to report."""
    from importlib.metadata import entry_points

    from farm.families.registry import ENTRY_POINT_GROUP

    found: dict[type, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            provided = ep.load()
        except Exception:  # Registry.load has reported it already
            continue
        dist = f" ({ep.dist.name})" if ep.dist is not None else ""
        for cls in provided if not isinstance(provided, type) else [provided]:
            found.setdefault(cls, f"entry point {ep.name}{dist}")
    for name in modules:
        import importlib

        for cls in getattr(importlib.import_module(name), "FAMILIES", []):
            found.setdefault(cls, f"module {name} (FARM_FAMILY_MODULES)")
    return found
