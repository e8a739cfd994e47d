"""Shared console plumbing: stdout for results, stderr for progress and errors.

Why both: ``--json`` output must stay machine-readable while people still see progress.

The width is rich's own choice: ``COLUMNS`` when set, else the terminal's (of stdout,
stderr or stdin, so ``farm records sessions | less`` still sees the terminal), else 80
(a CI log). Every listing is made to fit 80 columns (``farm.cli.tables``).
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def print_error(message: str) -> None:
    """``error: MESSAGE`` on stderr: one line in a log or a pipe (grep finds it whole);
    on a terminal wrapped at words to its width, the rest indented, since a terminal
    folds a long line mid-word (``lar|ge``). A word wider than the terminal (a long path)
    stays whole on a line of its own."""
    text = f"error: {message}"
    if sys.stderr.isatty():
        width = shutil.get_terminal_size().columns  # COLUMNS first, as rich's
        text = "\n".join(textwrap.wrap(text, max(20, width), subsequent_indent="  ",
                                        break_long_words=False,
                                        break_on_hyphens=False)) or text
    print(text, file=sys.stderr)


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and a non-zero exit, no traceback."""
    import typer

    print_error(message)
    raise typer.Exit(code)
