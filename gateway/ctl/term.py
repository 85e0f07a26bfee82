"""Terminal output for gatewayctl, through rich: colour and the terminal's width on a
terminal; plain, unwrapped text everywhere else, so that scripts and tests read stable lines."""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

# Wide enough that no table or message is wrapped or cut when the output is not a terminal.
PLAIN_WIDTH = 1000


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(
        file=stream,
        width=None if tty else PLAIN_WIDTH,
        highlight=False,
        markup=False,
        soft_wrap=not tty,
    )


def table(header: Sequence[str]) -> Table:
    """A borderless table: columns two spaces apart, a bold header on a terminal."""
    grid = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold", show_edge=False)
    for name in header:
        grid.add_column(name, no_wrap=True)
    return grid


def plain(grid: Table) -> str:
    """The table as text with no styles and no trailing spaces."""
    buffer = io.StringIO()
    out = Console(file=buffer, width=PLAIN_WIDTH, color_system=None, highlight=False, markup=False)
    out.print(grid)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def show(grid: Table, notes: Sequence[str] = ()) -> None:
    """Print a table and the notes under it (styled on a terminal, plain elsewhere)."""
    out = console()
    if out.is_terminal:
        out.print(grid)
    else:
        print(plain(grid))
    for note in notes:
        out.print(note)
