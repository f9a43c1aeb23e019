"""The rich console every `shellrl` command prints with, and its live tables.

On a terminal both are rich's own: the terminal's width, a table redrawn in place. Off a terminal
(stdout piped or sent to a log file) rich assumes 80 columns and a live table is printed once, when
it stops; two things then went wrong: a table wider than 80 columns had its headers cut
(`stalene…`) and its rows wrapped, and the live table's bottom border ended without a newline, so
whatever was printed next ran into it (`└──┘down: rollout`). Here, off a terminal, each table is
printed as wide as its widest row (`CliConsole.print`, at most MAX_WIDTH columns: past that its
cells wrap inside their borders) and a live table ends its last line (`live_table`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

MAX_WIDTH = 400
"""Columns a table may take off a terminal (a wider one wraps its cells, borders kept whole)."""


class CliConsole(Console):
    """A rich Console that, off a terminal, prints a table (or a Group holding one) as wide as
    its widest row, up to MAX_WIDTH columns, instead of squeezing it into `width`."""

    def print(self, *objects, **kwargs) -> None:
        widest = 0
        if not self.is_terminal and kwargs.get("width") is None:
            widest = max((self._table_width(o) for o in objects), default=0)
        if widest <= self.width:
            super().print(*objects, **kwargs)
            return
        width = self._width  # rich clamps print's `width` to the console's: widen the console
        self.width = min(widest, MAX_WIDTH)
        try:
            super().print(*objects, **kwargs)
        finally:
            self._width = width

    def _table_width(self, renderable) -> int:
        """Columns the tables of `renderable` need unwrapped (0: it holds no table)."""
        if isinstance(renderable, Table):
            return self.measure(renderable, options=self.options.update_width(MAX_WIDTH)).maximum
        if isinstance(renderable, Group):
            return max((self._table_width(r) for r in renderable.renderables), default=0)
        return 0


def cli_console(stderr: bool = False, **kwargs) -> CliConsole:
    """The console of a `shellrl` command (`stderr`: print to standard error)."""
    return CliConsole(stderr=stderr, **kwargs)


class _LastRenderable:
    """`Live`'s `update` off a terminal: keeps the renderable, printed once when the table stops."""

    def __init__(self) -> None:
        self.renderable = None

    def update(self, renderable, *, refresh: bool = False) -> None:
        self.renderable = renderable


@contextlib.contextmanager
def live_table(console: Console, refresh_per_second: float = 1) -> Iterator[Live | _LastRenderable]:
    """A live table: `.update(renderable)` redraws it. On a terminal it is rich's `Live`; off
    one, the last renderable given is printed (with `console.print`, a newline after it) when the
    block ends, as rich prints a live display's final state there, even when the block raises."""
    if console.is_terminal:
        with Live(console=console, refresh_per_second=refresh_per_second) as live:
            yield live
        return
    last = _LastRenderable()
    try:
        yield last
    finally:
        if last.renderable is not None:
            console.print(last.renderable)
