"""The command-line front of training jobs: `phalanx train` and `phalanx data prepare`."""

from __future__ import annotations

import json
from typing import Optional

import typer

from phalanx.console import ArgsArg, JsonOpt, print_table, split_config_args
from phalanx.errors import PhalanxError


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(
        no_args_is_help=True, help="Prepare training data.", epilog="Example: phalanx data prepare my.yaml"
    )
    app.add_typer(data_app, name="data")
    # `config show` lives here, not in config/ (a leaf): it resolves a config as train does, presets included.
    config_app = typer.Typer(
        no_args_is_help=True,
        help="Inspect run configs.",
        epilog="Example: phalanx config show my.yaml train.max_steps=100",
    )
    app.add_typer(config_app, name="config")

    @app.command()
    def train(
        args: Optional[list[str]] = ArgsArg,
        nproc: int = typer.Option(1, "--nproc", min=1, help="Ranks on this node (torch elastic launcher)."),
        nnodes: str = typer.Option("1", "--nnodes", help="Number of nodes, or MIN:MAX, as torchrun takes it."),
        node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank (multi-node)."),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT shared by all nodes."),
        rdzv_conf: str = typer.Option("", "--rdzv-conf", help="Rendezvous options, e.g. last_call_timeout=5."),
        launcher: str = typer.Option(
            "local", "--launcher", help="local (this node's agent) or ray (one agent per node on a Ray cluster)."
        ),
        ray_address: Optional[str] = typer.Option(
            None, "--ray-address", help="The Ray cluster (HOST:PORT); default RAY_ADDRESS or a local one."
        ),
        json_out: bool = JsonOpt,
    ) -> None:
        """Train (or resume) the run a config describes; with no arguments, the built-in Shakespeare demo.

        Examples:
        phalanx train
        phalanx train my.yaml train.max_steps=2000 --nproc 2
        phalanx train my.yaml --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint n0:29500
        """
        from phalanx.config.loader import load_config
        from phalanx.job.base_model import resolve_pretrained
        from phalanx.job.train_job import train_job
        from phalanx.launch.local import LaunchSpec

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        resolve_pretrained(config)
        spec = LaunchSpec(nproc, nnodes, node_rank, rdzv_endpoint, rdzv_conf)
        if launcher not in ("local", "ray"):
            raise PhalanxError(f"--launcher must be local or ray, not {launcher!r}")
        if launcher == "ray":
            from phalanx.launch.cluster.ray_launcher import ray_launch

            summary = ray_launch(config, spec, train_job, ray_address)
        elif ray_address:
            raise PhalanxError("--ray-address needs --launcher ray")
        else:
            summary = train_job(config, spec, progress=not json_out)
        if summary is None:
            return
        if json_out:
            print(json.dumps(summary))
        else:
            print_table("training summary", summary)

    @config_app.command("show")
    def config_show(args: Optional[list[str]] = ArgsArg, json_out: bool = JsonOpt) -> None:
        """Print the resolved config: presets, extends and overrides applied, every default filled in, the
        model preset's shape written out.

        Examples:
        phalanx config show
        phalanx config show my.yaml parallel.strategy=fsdp --json
        """
        from phalanx.config.loader import load_config
        from phalanx.run.resolved import resolved, resolved_yaml

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        if json_out:
            print(resolved(config).model_dump_json(indent=2))
        else:
            print(resolved_yaml(config), end="")

    @data_app.command("prepare")
    def data_prepare(
        args: Optional[list[str]] = ArgsArg,
        json_out: bool = JsonOpt,
        ray_address: Optional[str] = typer.Option(
            None, "--ray-address", help="Tokenise as tasks on this Ray cluster (HOST:PORT); shared storage needed."
        ),
    ) -> None:
        """Tokenise the config's corpus into token shards (train the tokenizer first if needed).

        Example:
        phalanx data prepare my.yaml data.vocab_size=8192
        """
        from phalanx.config.loader import load_config
        from phalanx.job.base_model import resolve_pretrained
        from phalanx.job.fresh_run_dir import owned_run_dir
        from phalanx.run.prepare import prepare_run

        path, overrides = split_config_args(args)
        config = load_config(path, overrides)
        resolve_pretrained(config)
        with owned_run_dir(config):  # never under a live run: it rewrites the run's config
            data = prepare_run(config, progress=not json_out, ray_address=ray_address)
        report = {
            "dir": str(data.dir),
            "tokenizer": str(data.tokenizer_path),
            "vocab_size": data.vocab_size,
            "train_tokens": data.train_tokens,
            "val_tokens": data.val_tokens,
            "train_shards": len(data.train_shards),
            "val_shards": len(data.val_shards),
            "kind": data.kind,
            **({"examples": data.examples} if data.kind == "sft" else {}),
        }
        if json_out:
            print(json.dumps(report))
        else:
            print_table("prepared data", report)
