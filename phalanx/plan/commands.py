"""The command-line front of phalanx plan: register() adds its commands to the main typer app."""

from __future__ import annotations

import json

import typer

from phalanx.console import JsonOpt

STRATEGIES = ("ddp", "fsdp", "none")


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        source: str = typer.Argument(..., metavar="CONFIG|PRESET",
                                     help="A run config (YAML file or config preset) or a model preset: "
                                          "tiny, 125m, 1b, 8b, 70b."),
        gpu: str = typer.Option(None, "--gpu", metavar="NAME",
                                help="Device: mi300x, mi325x, mi350x, mi355x, a100, h100, h200, b200, cpu."),
        gpus: int = typer.Option(1, "--gpus", metavar="N", help="How many devices (data-parallel ranks)."),
        strategy: str = typer.Option(None, "--strategy",
                                     help="ddp or fsdp (default: the config's, or fsdp for a model preset)."),
        micro_batch: int = typer.Option(None, "--micro-batch", metavar="B",
                                        help="Sequences per rank per micro-batch (default: the config's, or 1)."),
        seq_len: int = typer.Option(None, "--seq-len", metavar="T",
                                    help="Tokens per sequence (default: the config's, or the preset's context "
                                         "up to 8192)."),
        activation_checkpointing: bool = typer.Option(
            None, "--activation-checkpointing/--no-activation-checkpointing",
            help="Recompute each block in backward (default: the config's, or off)."),
        mfu: float = typer.Option(0.4, "--mfu", help="Model FLOPs utilisation to project tokens/s at (0-1]."),
        headroom: float = typer.Option(0.1, "--headroom",
                                       help="Fraction of device memory kept free for the runtime, collectives "
                                            "and fragmentation."),
        peak_tflops: float = typer.Option(None, "--peak-tflops",
                                          help="Peak TFLOP/s of one CPU host for --gpu cpu (default: a guess "
                                               "from its cores)."),
        compare: bool = typer.Option(False, "--compare", help="Plan the same job on every known device."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Will a training run fit: memory per device, the largest micro batch, projected tokens/s."""
        from phalanx.errors import PhalanxError
        from phalanx.plan import planner
        from phalanx.plan.devices import all_devices, get_device
        from phalanx.plan.report import print_compare, print_plan

        if strategy is not None and strategy not in STRATEGIES:
            raise PhalanxError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        if gpu is None and not compare:
            raise PhalanxError("name a device with --gpu NAME, or use --compare for every device")
        devices = all_devices(peak_tflops) if compare else [get_device(gpu, peak_tflops)]
        job = planner.resolve_job(source, gpus, strategy=strategy, micro_batch=micro_batch, seq_len=seq_len,
                                  activation_checkpointing=activation_checkpointing)
        if compare:
            rows = planner.compare(job, devices, mfu=mfu, headroom=headroom)
            if json_out:
                print(json.dumps({"job": planner.job_summary(job), "mfu": mfu, "headroom": headroom,
                                  "devices": rows}))
            else:
                print_compare(job, rows, mfu, headroom)
            return
        report = planner.plan(job, devices[0], mfu=mfu, headroom=headroom)
        if json_out:
            print(json.dumps(report))
        else:
            print_plan(report)
