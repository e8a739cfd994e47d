"""``farm gc``: delete artifacts of earlier builds of the registered families."""

from __future__ import annotations

from typing import Annotated

import typer

from farm.cli.console import out, print_json
from farm.core.errors import InputError, first_error


def gc(
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="list what would go, delete nothing")] = False,
    namespace: Annotated[list[str] | None, typer.Option(
        metavar="NAMESPACE", help="only this namespace (repeatable); default all")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="as JSON")] = False,
) -> None:
    """Delete stored artifacts of families whose code has changed.

    An artifact is kept under its family's build id (a hash of the family's code); one
    of an earlier build id is never served again, so it only takes room.
    """
    from pydantic import ValidationError

    from farm.core.keys import Namespace
    from farm.core.settings import load_settings
    from farm.families import Registry
    from farm.store.gc import collect
    from farm.store.open import open_store

    settings = load_settings()
    try:
        spaces = [Namespace.parse(n) for n in namespace] if namespace else None
    except ValidationError as exc:
        raise InputError(f"--namespace: {first_error(exc)[1]}") from None
    except ValueError as exc:
        raise InputError(f"--namespace: {exc}") from None
    store = open_store(settings)
    try:
        stale = collect(store, Registry.load(settings.family_modules), dry_run=dry_run,
                        namespaces=spaces)
    finally:
        store.close()
    if json_out:
        print_json({"dry_run": dry_run, "stale": [s.__dict__ | {"namespace": str(s.namespace)}
                                                  for s in stale]})
        return
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} {len(stale)} artifact(s) of earlier builds")
    for s in stale[:50]:
        out.print(f"  {s.namespace} {s.key} ({s.family}: current build {s.current_build_id})",
                  markup=False)
