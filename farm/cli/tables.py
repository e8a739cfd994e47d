"""Tables that fit the terminal: nothing a person copies is ever cut.

Why a module of its own: every listing of the CLI (sessions, summaries, devices,
workers) has the same problem in an ordinary 80-column terminal or a CI log. Rich shrinks
a table that is too wide by cutting its cells (``kerne… rekey…``), and the cut falls on
ids and fingerprints, the very values people paste into the next command. So:

- one light style (a rule under the header, two spaces between columns, no borders),
  which leaves the width to the values;
- values are never cut: a column either keeps its values on one line (ids, numbers,
  fingerprints) or wraps them (free text: labels, kernel names); when the terminal is
  narrower than even that, they fold onto more lines, never behind a ``…``;
- a table too wide for the terminal loses its *optional* columns first (``--wide``
  brings them back, ``--json`` has everything), and says which ones it left out;
- a one-row summary too wide as a table is printed stacked: label and value pairs,
  as many to a line as fit.

The width is the console's: ``COLUMNS`` when set, else the terminal's, else 80.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from farm.cli.console import out

WRAP_ROOM = 24
"""Characters a line of free text keeps before optional columns get any room."""


@dataclass(frozen=True)
class Column:
    """One column of a listing."""

    header: str
    justify: Literal["left", "right"] = "left"
    #: left out (last ones first) when the table would be wider than the terminal
    optional: bool = False
    #: free text that may wrap onto more lines; otherwise one line, whole
    wrap: bool = False
    #: a value without spaces that may be long (a host name): folded at the column's
    #: width rather than widening the table past the terminal
    fold: bool = False


def new_table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> Table:
    """The house style: header rule, two spaces between columns, no borders. No title:
    a title is printed as a line of its own (see ``print_title``), since a table wraps
    its title to its own width and would fold a fingerprint in it."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1, 0, 0))
    for col in columns:
        table.add_column(col.header, justify=col.justify, no_wrap=not (col.wrap or col.fold),
                         overflow="fold", min_width=len(col.header))
    for row in rows:
        table.add_row(*(Text(value) for value in row))
    return table


def natural_width(console: Console, table: Table) -> int:
    """How wide ``table`` is with nothing wrapped."""
    return console.measure(table, options=console.options.update(width=10_000)).maximum


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], *, width: int,
        console: Console, wide: bool = False) -> tuple[Table, list[str], int]:
    """The table with as many optional columns as fit ``width`` (all with ``wide``),
    the headers of the columns left out, and the width to print it at: ``width``, or
    more where even the columns kept do not fit (a line too long for the terminal wraps
    there, while a cut value would be lost). Free-text columns count at most
    ``WRAP_ROOM`` wide (or their longest word), since they may wrap."""
    keep = list(range(len(columns)))
    optional = [i for i, col in enumerate(columns) if col.optional]

    def needed(indexes: list[int]) -> int:
        squeezed = [[row[i][:WRAP_ROOM] if columns[i].fold else
                     _squeezed(row[i]) if columns[i].wrap else row[i] for i in indexes]
                    for row in rows]
        return natural_width(console, new_table([columns[i] for i in indexes], squeezed))

    while not wide and optional and needed(keep) > width:
        keep.remove(optional.pop())
    dropped = [col.header for i, col in enumerate(columns) if i not in keep]
    table = new_table([columns[i] for i in keep], [[row[i] for i in keep] for row in rows])
    return table, dropped, max(width, needed(keep))


@contextlib.contextmanager
def _at_least(console: Console, width: int) -> Iterator[None]:
    """The console at least ``width`` wide for a moment (``print(width=)`` only narrows)."""
    if width <= console.width:
        yield
        return
    saved = console._width  # None: the terminal's or COLUMNS, read at each print
    console.width = width
    try:
        yield
    finally:
        console._width = saved


def print_title(title: str, console: Console | None = None) -> None:
    """A table's title: bold, wrapped at spaces only (a fingerprint stays whole)."""
    (console or out).print(Text(title, style="bold", overflow="fold"))


def _squeezed(text: str) -> str:
    """The room free text is given before an optional column may take any: its longest
    word, and up to ``WRAP_ROOM`` characters (a label on one line, a kernel's name on
    two or three, not one word a line)."""
    longest = max(text.split(), key=len, default="")
    return text[:max(len(longest), WRAP_ROOM)]


def print_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
                title: str | None = None, wide: bool = False,
                console: Console | None = None) -> None:
    """Print a listing that fits the console, and a line naming the columns left out."""
    console = console or out
    table, dropped, at = fit(columns, rows, width=console.width, console=console, wide=wide)
    if title:
        print_title(title, console)
    with _at_least(console, at):
        console.print(table)
    if dropped and rows:
        console.print(f"({', '.join(dropped)}: --wide, or --json)", markup=False,
                      highlight=False)


def stacked(pairs: Sequence[tuple[str, str]], width: int) -> Table:
    """Label and value pairs, as many to a line as fit ``width``: a one-row table too
    wide to print as one."""
    label_w = max((len(label) for label, _ in pairs), default=0)
    value_w = max((len(value) for _, value in pairs), default=0)
    per_line = max(1, (width + 3) // (label_w + 1 + value_w + 3))
    grid = Table.grid(padding=(0, 1, 0, 0))
    for n in range(per_line):
        grid.add_column(no_wrap=True, min_width=label_w, style="dim")
        grid.add_column(justify="right", overflow="fold", min_width=value_w)
        if n < per_line - 1:
            grid.add_column(min_width=2)
    for start in range(0, len(pairs), per_line):
        cells: list[str] = []
        for n, (label, value) in enumerate(pairs[start:start + per_line]):
            cells += [label, value] + ([""] if n < per_line - 1 else [])
        grid.add_row(*(Text(cell) for cell in cells))
    return grid


def print_one_row(columns: Sequence[Column], row: Sequence[str], *, title: str,
                  console: Console | None = None) -> None:
    """A summary of one row: a table when it fits the console, else stacked pairs."""
    console = console or out
    print_title(title, console)
    table = new_table(columns, [row])
    if natural_width(console, table) <= console.width:
        console.print(table)
        return
    console.print(stacked([(c.header, v) for c, v in zip(columns, row, strict=True)],
                          console.width))


__all__ = ["Column", "fit", "new_table", "print_one_row", "print_table", "print_title",
           "stacked"]
