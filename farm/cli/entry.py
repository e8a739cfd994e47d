"""The ``farm`` console entry point: ``farm run`` starts the application at once.

``farm run`` wraps every launch of an application (a script, each MPI job), so what it
costs before the application starts, and after it ends, is paid on every run. Loading
the whole command line (typer, rich, every command's imports) takes 0.3 to 0.5 s and its
teardown 0.15 s more: about as long as a served application's whole second run on PoCL
(docs/BENCHMARKS.md). So the one plain form,

    farm run [--json FILE] [--capture FILE] -- COMMAND [ARGS...]

(each option also as ``--json=FILE``), runs from here with the same code as the full
command (:func:`farm.programs.runner.run_and_report`), and errors end the same way (one
line, the same exit status). Anything else (``--help``, a missing ``--``, an option this
does not know) goes to the full command line (:mod:`farm.cli.main`), which gives its
help and its usage errors.
"""

from __future__ import annotations

import sys

_OPTIONS = ("--json", "--capture")


def plain_run(args: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """(command, {"--json"|"--capture": path}) for ``farm run``'s plain form, else
    ``None`` (``args`` follow ``run``)."""
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            command = args[i + 1:]
            return (command, options) if command else None
        name, eq, value = arg.partition("=")
        if name not in _OPTIONS:
            return None
        if not eq:
            if i + 1 >= len(args):
                return None
            i += 1
            value = args[i]
        if not value or value.startswith("-"):
            return None
        options[name] = value
        i += 1
    return None


def main() -> None:
    """Console entry point (``farm``, ``python -m farm``)."""
    plain = plain_run(sys.argv[2:]) if sys.argv[1:2] == ["run"] else None
    if plain is None:
        from farm.cli.main import main as full

        full()
        return
    from farm.core.errors import FarmError
    from farm.programs.runner import run_and_report

    command, options = plain
    try:
        code = run_and_report(command, options.get("--json"), options.get("--capture"))
    except FarmError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)  # as farm.cli.main
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except OSError as exc:  # the machine (a temporary folder that cannot be made)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code)
