"""``farm manifest``: look at what a manifest asks for before building it.

A manifest can expand to thousands of kernels; ``show`` answers "how many, of which
families" without touching a device or a store, so a typo in a tuning space is caught
(with its file and line) before any worker spends time on it.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from farm.cli.help import examples, new_app
from farm.core.errors import FarmError
from farm.manifests import builtin_manifests

app = new_app("Inspect model manifests: the kernel instances a build would ask for.",
              epilog=examples("farm manifest show medium"))


@app.callback()
def _group() -> None:
    """Keep ``show`` a sub-command even while it is the only one (typer would otherwise
    make a one-command app that command itself)."""


@app.command(epilog=examples("farm manifest show tiny", "farm manifest show model.toml --json"))
def show(
    file: Annotated[str, typer.Argument(
        metavar="FILE",
        help=f"A manifest file, or a built-in manifest: {', '.join(builtin_manifests())}.")],
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the counts as JSON instead of a table.")] = False,
) -> None:
    """How many kernels of which family FILE expands to, and the total."""
    from rich.table import Table
    from rich.text import Text

    from farm.core.settings import load_settings
    from farm.families.registry import Registry
    from farm.manifest import expand, load_manifest, resolve_manifest, summarize

    try:
        path = resolve_manifest(file)
        manifest = load_manifest(path)
        entries = expand(manifest, Registry.load(load_settings().family_modules))
    except FarmError as exc:
        # a line per problem on stderr, no traceback: each names file, line, field
        for line in exc.lines:
            typer.echo(" ".join(line.split()), err=True)
        raise typer.Exit(exc.exit_code) from None
    counts = summarize(entries)
    total = sum(counts.values())
    if as_json:
        typer.echo(json.dumps({"manifest": str(path), "name": manifest.label,
                               "families": counts, "total": total}, indent=2))
        return
    console = Console()
    console.print(Text(f"{manifest.label}: {path}"), soft_wrap=True)
    table = Table(show_footer=True)
    table.add_column("family", footer="total")
    table.add_column("kernels", justify="right", footer=str(total))
    for family, count in counts.items():
        table.add_row(family, str(count))
    console.print(table)
