"""What every stage's commands share: the config-and-overrides argument, --json, and printing a report.

Each stage folder registers its own commands from its `commands.py`; phalanx/cli.py only assembles them.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.table import Table

out = Console()
err = Console(stderr=True)

ArgsArg = typer.Argument(None, metavar="[CONFIG] [SECTION.KEY=VALUE]...",
                         help="A YAML file or preset name (default: the demo), then overrides.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object for machines.")


def split_config_args(args: list[str] | None) -> tuple[str | None, list[str]]:
    """`[CONFIG] [overrides...]`: the first argument is the config unless it is an override itself."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


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
