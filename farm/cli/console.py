"""Shared console plumbing: stdout for results, stderr for progress and errors.

Why both: ``--json`` output must stay machine-readable while people still see progress.

The width is rich's own choice: ``COLUMNS`` when set, else the terminal's (of stdout,
stderr or stdin, so ``farm records sessions | less`` still sees the terminal), else 80
(a CI log). Every listing is made to fit 80 columns (``farm.cli.tables``).
"""

from __future__ import annotations

import json
import sys

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and a non-zero exit, no traceback."""
    import typer

    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)
