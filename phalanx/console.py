"""What every stage's commands share: the config-and-overrides argument, --json, and printing a report.

Each stage folder registers its own commands from its `commands.py`; phalanx/cli.py only assembles them.
"""

from __future__ import annotations

import os
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

out = Console()
err = Console(stderr=True)

# `phalanx --debug` sets it for the command and every process it starts (ranks show torch's own output).
DEBUG_ENV = "PHALANX_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def say(message: str) -> None:
    """One line on stderr of what a command is doing (stdout stays for results and --json)."""
    err.print(message, markup=False, highlight=False, soft_wrap=True)


ArgsArg = typer.Argument(
    None,
    metavar="[CONFIG] [SECTION.KEY=VALUE]...",
    help="A YAML file or preset name (default: the demo), then overrides.",
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for machines.")


def split_config_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """`[CONFIG] [overrides...]`: the first argument is the config unless it is an override itself."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def fitted_table(
    title: str,
    columns: list[str],
    rows: list[list[str]],
    drop_first: tuple[str, ...] = (),
    right: tuple[str, ...] = (),
    console: Console | None = None,
) -> Table:
    """A table of `rows` that fits the terminal (80 columns where it cannot tell) without cutting cells:
    columns named in `drop_first` are left out, in that order, while it would not fit."""
    from rich.box import SIMPLE_HEAD
    from rich.measure import Measurement

    console = console or out
    keep = list(columns)
    while True:
        table = Table(title=title, box=SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for name in keep:
            table.add_column(name, justify="right" if name in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*(cell for name, cell in zip(columns, row, strict=True) if name in keep))
        droppable = [name for name in drop_first if name in keep]
        wide = console.options.update_width(1 << 16)  # the width it wants, not the width it is allowed
        if not droppable or Measurement.get(console, wide, table).maximum <= console.width:
            return table
        keep.remove(droppable[0])


def print_table(title: str, values: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    for key, value in values.items():
        table.add_row(key, format_value(value))
    out.print(table)


def format_value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {format_value(v)}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return "-" if value is None else str(value)
