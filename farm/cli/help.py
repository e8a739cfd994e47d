"""How ``--help`` reads: plain text that fits 80 columns, with examples.

Why plain (click's own formatter) rather than typer's rich panels: at 80 columns the
panels cut option names (``--wait-for-work…``), give every flag a ``<bool>`` value it
does not take, and keep the docstrings' line breaks mid-sentence. Click's formatter puts
a long option name on a line of its own, shows a flag as a flag, and re-wraps each
paragraph to the terminal. Every command ends with examples (``examples``), which click
leaves as written.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup, _click  # typer's own click: the types its group takes

EXIT_CODES = ("0 done; 1 something failed (a kernel, the store, the cluster, the device); "
              "2 bad input (a manifest, a setting, an option, a file); 130 interrupted.")
"""What every command's exit status means (``farm.core.errors``: each error's
``exit_code``); printed in ``farm --help``."""


def new_app(help: str, **options: Any) -> typer.Typer:
    """A command group in the house style: plain help, no shell-completion options, no
    rich tracebacks (``farm.cli.main`` turns errors into one line)."""
    options.setdefault("no_args_is_help", True)
    return typer.Typer(help=help, rich_markup_mode=None, add_completion=False,
                       pretty_exceptions_enable=False, **options)


class GroupedHelp(TyperGroup):
    """Plain help that lists the commands under their headings (``rich_help_panel``), in
    the order of ``ORDER`` (a subclass's: the order a person meets them, not the
    alphabet's nor typer's, which lists command groups after single commands)."""

    ORDER: tuple[str, ...] = ()

    def list_commands(self, ctx: _click.Context) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(self.ORDER)}
        return sorted(names, key=lambda name: rank.get(name, len(rank)))

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            heading = getattr(command, "rich_help_panel", None) or "Commands"
            sections.setdefault(heading, []).append(
                (name, command.get_short_help_str(formatter.width - 6 - len(name))))
        for heading, rows in sections.items():
            with formatter.section(heading):
                formatter.write_dl(rows)


def examples(*lines: str) -> str:
    """An epilog listing example command lines, printed as written (``\\b`` tells click
    not to re-wrap the paragraph). A line starting with ``#`` is a comment."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


__all__ = ["EXIT_CODES", "GroupedHelp", "examples", "new_app"]
