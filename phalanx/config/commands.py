"""The command-line front of configs: `phalanx config show`."""

from __future__ import annotations

from typing import Optional

import typer

from phalanx.console import ArgsArg, JsonOpt, split_config_args


def register(app: typer.Typer) -> None:
    config_app = typer.Typer(no_args_is_help=True, help="Inspect run configs.")
    app.add_typer(config_app, name="config")

    @config_app.command("show")
    def config_show(args: Optional[list[str]] = ArgsArg, json_out: bool = JsonOpt) -> None:
        """Print the resolved config (presets, extends and overrides applied, every default filled in)."""
        from phalanx.config.loader import dump_json, dump_yaml, load_config

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        print(dump_json(config) if json_out else dump_yaml(config), end="" if not json_out else "\n")
