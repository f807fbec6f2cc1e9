"""The command-line front of training jobs: `phalanx train` and `phalanx data prepare`."""

from __future__ import annotations

import json
from typing import Optional

import typer

from phalanx.console import ArgsArg, JsonOpt, print_table, split_config_args


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(no_args_is_help=True, help="Prepare training data.")
    app.add_typer(data_app, name="data")

    @app.command()
    def train(
        args: Optional[list[str]] = ArgsArg,
        nproc: int = typer.Option(1, "--nproc", min=1, help="Ranks on this node (torch elastic launcher)."),
        nnodes: str = typer.Option("1", "--nnodes", help="Number of nodes, or MIN:MAX, as torchrun takes it."),
        node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (multi-node)."),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT shared by all nodes."),
        rdzv_conf: str = typer.Option("", "--rdzv-conf", help="Rendezvous options, e.g. last_call_timeout=5."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Train (or resume) the run a config describes; with no arguments, the built-in Shakespeare demo."""
        from phalanx.config.loader import load_config
        from phalanx.job.train_job import train_job
        from phalanx.launch.local import LaunchSpec

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        summary = train_job(config, LaunchSpec(nproc, nnodes, node_rank, rdzv_endpoint, rdzv_conf),
                            progress=not json_out)
        if summary is None:
            return
        if json_out:
            print(json.dumps(summary))
        else:
            print_table("training summary", summary)

    @data_app.command("prepare")
    def data_prepare(args: Optional[list[str]] = ArgsArg, json_out: bool = JsonOpt) -> None:
        """Tokenise the config's corpus into token shards (train the tokenizer first if needed)."""
        from phalanx.config.loader import load_config
        from phalanx.run.prepare import prepare_run

        path, overrides = split_config_args(args)
        data = prepare_run(load_config(path, overrides), progress=not json_out)
        report = {"dir": str(data.dir), "tokenizer": str(data.tokenizer_path), "vocab_size": data.vocab_size,
                  "train_tokens": data.train_tokens, "val_tokens": data.val_tokens,
                  "train_shards": len(data.train_shards), "val_shards": len(data.val_shards)}
        if json_out:
            print(json.dumps(report))
        else:
            print_table("prepared data", report)
