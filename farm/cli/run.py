"""``farm run -- COMMAND...`` and ``farm capture FILE -- COMMAND...``: an existing
pyopencl application served by the farm with no change to its code.

Every ``pyopencl.Program(...).build(...)`` of every Python process the command starts
gets its binary from the farm (memory, the local tier, MinIO, else a compile here that
is stored); one line on stderr sums the run (``--json FILE`` writes the same counts).
``farm capture`` (or ``farm run --capture FILE``) also writes every program built to a
capture that ``farm build FILE`` builds ahead of time. docs/PYOPENCL.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from farm.core.errors import FarmError

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
    from farm.programs.capture import write_capture
    from farm.programs.counts import summary_line, write_json
    from farm.programs.runner import run_served, signal_name

    for target in (json_path, capture):
        if target is not None and not target.parent.is_dir():
            raise FarmError(f"{target}: its folder does not exist")
    result = run_served(command, capture=capture is not None)
    print(summary_line(result.counts), file=sys.stderr, flush=True)
    if result.unreadable:
        print(f"kernel-farm: warning: {result.unreadable} process(es) left counts or a "
              "capture that could not be read (killed while writing?)", file=sys.stderr)
    if json_path is not None:
        write_json(json_path, result.counts)
    if capture is not None and result.capture is not None:
        write_capture(capture, result.capture)
        print(f"kernel-farm: captured {len(result.capture.programs)} program(s) for "
              f"{', '.join(result.capture.fingerprints()) or 'no device'} in {capture}",
              file=sys.stderr)
    if result.returncode:
        name = signal_name(result.returncode)
        if name:
            print(f"kernel-farm: the command was killed by {name}", file=sys.stderr)
        raise typer.Exit(result.returncode)
