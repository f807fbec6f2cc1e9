"""The `phalanx` command line. Each command parses its arguments and calls one function elsewhere.

Bad input raises PhalanxError anywhere below; `main` prints it as one line and exits 2 (with the
traceback only under --debug).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from phalanx.errors import PhalanxError
from phalanx.export.commands import register as register_export
from phalanx.observe.commands import register as register_observe
from phalanx.plan.commands import register as register_plan
from phalanx.preflight.commands import register as register_preflight
from phalanx.serve.commands import register as register_serve

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train, keep alive, observe and serve Llama-style language models on any accelerator.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect run configs.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare training data.")
app.add_typer(config_app, name="config")
app.add_typer(data_app, name="data")

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


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks (may also follow any command).")):
    pass


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
    from phalanx.data.loader import check_batch_sizes
    from phalanx.launch.local import LaunchSpec, launch
    from phalanx.models.flops import count_params
    from phalanx.models.from_config import model_args
    from phalanx.observe.observer import observe_run
    from phalanx.preflight.gate import preflight_before_training, refuse_if_quarantined
    from phalanx.safe.goodput import run_report
    from phalanx.train.run_dir import prepare_run, read_metrics, run_lock, start_timeline
    from phalanx.train.trainer import SUMMARY_FILE, check_run

    started = time.time()
    path, overrides = split_config_args(args)
    config = load_config(path, overrides)
    spec = LaunchSpec(nproc, nnodes, node_rank, rdzv_endpoint, rdzv_conf)
    spec.validate()
    if spec.world_sizes() != [1] and config.parallel.strategy == "none":
        raise PhalanxError("parallel.strategy=none runs one process; set parallel.strategy=ddp or fsdp for --nproc")
    for world_size in spec.world_sizes():  # an elastic job must fit every size it may shrink or grow to
        check_batch_sizes(config.train.global_batch_size, config.train.micro_batch_size, world_size)
    # Node 0 owns the run directory: it takes the lock and starts a new line of checkpoints if asked.
    with run_lock(config.run_dir) if node_rank == 0 else contextlib.nullcontext():
        if node_rank == 0:
            start_timeline(config)
        refuse_if_quarantined(config)  # before the data work: a quarantined node does nothing
        data = prepare_run(config, progress=not json_out)
        check_run(config, data)
        if config.safe.preflight != "off":
            preflight_before_training(config, spec, progress=not json_out)
        args = model_args(config.model, data.vocab_size, config.train.seq_len)
        model = f"{config.model.preset} ({count_params(args) / 1e6:,.1f}M)"
        with observe_run(config, node_rank, spec.nproc * spec.node_range()[1], model, started):
            if not launch(spec, config):
                return  # global rank 0 ran elsewhere: that node reports
    summary = json.loads((config.run_dir / SUMMARY_FILE).read_text())
    summary.update(run_report(config.run_dir, read_metrics(config.run_dir), started, time.time()))
    (config.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    if json_out:
        print(json.dumps(summary))
    else:
        _print_table("training summary", summary)


@app.command()
def generate(
    run_dir: Path = typer.Argument(..., help="A run directory (its newest checkpoint) or a checkpoint directory."),
    prompt: str = typer.Argument("", help="Text to continue."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0 picks the likeliest token."),
    top_k: int = typer.Option(50, "--top-k", min=0, help="Sample among the k likeliest tokens (0: all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fix the sampling for repeatable output."),
) -> None:
    """Print text sampled from a trained run."""
    from phalanx.serve.generate import generate_text, load_run

    loaded = load_run(run_dir)
    print(generate_text(loaded, prompt, max_new_tokens, temperature, top_k or None, seed))


@config_app.command("show")
def config_show(args: Optional[list[str]] = ArgsArg, json_out: bool = JsonOpt) -> None:
    """Print the resolved config (presets, extends and overrides applied, every default filled in)."""
    from phalanx.config.loader import dump_json, dump_yaml, load_config

    path, overrides = split_config_args(args)
    config = load_config(path, overrides)
    print(dump_json(config) if json_out else dump_yaml(config), end="" if not json_out else "\n")


@data_app.command("prepare")
def data_prepare(args: Optional[list[str]] = ArgsArg, json_out: bool = JsonOpt) -> None:
    """Tokenise the config's corpus into token shards (train the tokenizer first if needed)."""
    from phalanx.config.loader import load_config
    from phalanx.train.run_dir import prepare_run

    path, overrides = split_config_args(args)
    data = prepare_run(load_config(path, overrides), progress=not json_out)
    report = {"dir": str(data.dir), "tokenizer": str(data.tokenizer_path), "vocab_size": data.vocab_size,
              "train_tokens": data.train_tokens, "val_tokens": data.val_tokens,
              "train_shards": len(data.train_shards), "val_shards": len(data.val_shards)}
    if json_out:
        print(json.dumps(report))
    else:
        _print_table("prepared data", report)


@app.command()
def bench(
    preset: str = typer.Argument("tiny", help="Model preset: tiny, 125m, 1b, 8b, 70b."),
    seq_len: int = typer.Option(256, "--seq-len", min=1),
    micro_batch: int = typer.Option(8, "--micro-batch", min=1),
    steps: int = typer.Option(10, "--steps", min=1, help="Timed steps (the median is reported)."),
    warmup: int = typer.Option(3, "--warmup", min=0),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), float32 or bfloat16."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile each block."),
    activation_checkpointing: bool = typer.Option(False, "--activation-checkpointing"),
    peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", help="Device peak, for MFU on CPUs."),
    json_out: bool = JsonOpt,
) -> None:
    """Time forward + backward + optimizer steps of a model preset on this device."""
    from phalanx.train.bench import run_bench

    if device not in ("auto", "cpu", "cuda") or dtype not in ("auto", "float32", "bfloat16"):
        raise PhalanxError(f"--device must be auto|cpu|cuda and --dtype auto|float32|bfloat16 (got {device}, {dtype})")
    result = run_bench(preset, seq_len, micro_batch, steps, warmup, device=device, dtype=dtype, compile=compile,
                       activation_checkpointing=activation_checkpointing, peak=peak_tflops)
    if json_out:
        print(json.dumps(result))
    else:
        _print_table(f"bench {preset}", result)


def _print_table(title: str, values: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    for key, value in values.items():
        table.add_row(key, _fmt(value))
    out.print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return "-" if value is None else str(value)


for register in (register_observe, register_export, register_serve, register_plan, register_preflight):
    register(app)


def main() -> None:
    debug = "--debug" in sys.argv[1:] or os.environ.get("PHALANX_DEBUG") == "1"
    sys.argv = [a for a in sys.argv if a != "--debug"]
    try:
        app()
    except PhalanxError as exc:
        if debug:
            raise
        err.print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
