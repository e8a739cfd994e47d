"""Shared console plumbing: stdout for results, stderr for progress and errors.

Why both: ``--json`` output must stay machine-readable while people still see progress.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

out = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False)


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and a non-zero exit, no traceback."""
    import typer

    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)
