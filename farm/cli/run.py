"""``farm run -- COMMAND...`` and ``farm capture FILE -- COMMAND...``: an existing
pyopencl application served by the farm with no change to its code.

Every ``pyopencl.Program(...).build(...)`` of every Python process the command starts
gets its binary from the farm (memory, the local tier, MinIO, else a compile here that
is stored); one line on stderr sums the run (``--json FILE`` writes the same counts).
``farm capture`` (or ``farm run --capture FILE``) also writes every program built to a
capture that ``farm build FILE`` builds ahead of time. docs/PYOPENCL.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

_COMMAND = typer.Argument(help="the command to run, after --", show_default=False)


def run(
    command: Annotated[list[str], _COMMAND],
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="write the counts to this file as JSON")] = None,
    capture: Annotated[Path | None, typer.Option(
        "--capture", help="write every program built to this capture file")] = None,
) -> None:
    """Run COMMAND with its pyopencl programs served by the farm."""
    _run(command, json_path, capture)


def capture_cmd(
    capture: Annotated[Path, typer.Argument(help="the capture file to write")],
    command: Annotated[list[str], _COMMAND],
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="write the counts to this file as JSON")] = None,
) -> None:
    """Run COMMAND; write every program it built to a capture file."""
    _run(command, json_path, capture)


def _run(command: list[str], json_path: Path | None, capture: Path | None) -> None:
    from farm.programs.runner import run_and_report

    code = run_and_report(command, json_path, capture)
    if code:
        raise typer.Exit(code)
