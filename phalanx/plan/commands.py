"""The command-line front of phalanx plan: register() adds its commands to the main typer app."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import typer

from phalanx.console import JsonOpt
from phalanx.models.preset_names import PRESET_NAMES

STRATEGIES = ("ddp", "fsdp", "none")


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        source: str = typer.Argument(
            ...,
            metavar="CONFIG|PRESET",
            help=f"A run config (YAML file or config preset) or a model preset: {', '.join(PRESET_NAMES)}.",
        ),
        overrides: Optional[list[str]] = typer.Argument(
            None, metavar="[SECTION.KEY=VALUE]...", help="Overrides of a run config, as phalanx train takes them."
        ),
        gpu: str = typer.Option(
            None, "--gpu", metavar="NAME", help="Device: mi300x, mi325x, mi350x, mi355x, a100, h100, h200, b200, cpu."
        ),
        gpus: int = typer.Option(1, "--gpus", metavar="N", help="How many devices (data-parallel ranks)."),
        strategy: str = typer.Option(
            None, "--strategy", help="ddp or fsdp (default: the config's, or fsdp for a model preset)."
        ),
        micro_batch: int = typer.Option(
            None, "--micro-batch", metavar="B", help="Sequences per rank per micro-batch (default: the config's, or 1)."
        ),
        seq_len: int = typer.Option(
            None,
            "--seq-len",
            metavar="T",
            help="Tokens per sequence (default: the config's, or the preset's context up to 8192).",
        ),
        # Two flags rather than one --x/--no-x pair: the pair's names do not fit an 80-column --help.
        activation_checkpointing: bool = typer.Option(
            False,
            "--activation-checkpointing",
            help="Recompute each block in backward (default: the config's, or off).",
        ),
        no_activation_checkpointing: bool = typer.Option(
            False, "--no-activation-checkpointing", help="Do not, whatever the config says."
        ),
        mfu: float = typer.Option(0.4, "--mfu", help="Model FLOPs utilisation to project tokens/s at (0-1]."),
        headroom: float = typer.Option(
            0.1,
            "--headroom",
            help="Fraction of device memory kept free for the runtime, collectives and fragmentation.",
        ),
        peak_tflops: float = typer.Option(
            None, "--peak-tflops", help="Peak TFLOP/s of one CPU host for --gpu cpu (default: a guess from its cores)."
        ),
        compare: bool = typer.Option(False, "--compare", help="Plan the same job on every known device."),
        tp: int = typer.Option(None, "--tp", metavar="N", help="Tensor-parallel ranks (heads and FFN split)."),
        pp: int = typer.Option(None, "--pp", metavar="N", help="Pipeline stages."),
        cp: int = typer.Option(None, "--cp", metavar="N", help="Context-parallel ranks (sequence split)."),
        dp_shard: int = typer.Option(None, "--dp-shard", metavar="N", help="FSDP shard group (default: the rest)."),
        dp_replicate: int = typer.Option(None, "--dp-replicate", metavar="N", help="Replicas (HSDP's outer dim)."),
        ep: int = typer.Option(None, "--ep", metavar="N", help="Expert-parallel ranks within dp_shard (MoE)."),
        pp_schedule: str = typer.Option(None, "--pp-schedule", help="1f1b, interleaved_1f1b or gpipe."),
        no_trace: bool = typer.Option(
            False,
            "--no-trace",
            help="Hand model only: skip tracing the layout's real step on fake tensors (seconds to a minute for 70B).",
        ),
        json_out: bool = JsonOpt,
    ) -> None:
        """Will a training run fit: memory per device, the largest micro batch, projected tokens/s.

        With no layout (--tp/--pp/--cp/--dp-*) and no --strategy, it proposes a 4-D layout for --gpus.

        Examples:
          phalanx plan 70b --gpu mi300x --gpus 64
          phalanx plan 70b --gpu mi300x --gpus 64 --tp 8 --pp 2
          phalanx plan 8b --gpu mi300x --gpus 8 --strategy fsdp
          phalanx plan 70b --gpus 8 --compare
          phalanx plan demo --gpu cpu --gpus 2 train.global_batch_size=32
        """
        from phalanx.errors import PhalanxError
        from phalanx.plan import planner
        from phalanx.plan.devices import all_devices, get_device
        from phalanx.plan.report import print_compare, print_plan

        if activation_checkpointing and no_activation_checkpointing:
            raise PhalanxError("give --activation-checkpointing or --no-activation-checkpointing, not both")
        ac = True if activation_checkpointing else False if no_activation_checkpointing else None
        if strategy is not None and strategy not in STRATEGIES:
            raise PhalanxError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        if gpu is None and not compare:
            raise PhalanxError("name a device with --gpu NAME, or use --compare for every device")
        devices = all_devices(peak_tflops) if compare else [get_device(gpu, peak_tflops)]
        job = planner.resolve_job(
            source,
            gpus,
            strategy=strategy,
            micro_batch=micro_batch,
            seq_len=seq_len,
            activation_checkpointing=ac,
            overrides=overrides or [],
        )
        layout_given = any(v is not None for v in (tp, pp, cp, dp_shard, dp_replicate, ep))
        if not layout_given and job.config_layout is not None and strategy is None and not compare:
            layout_given = True  # a run config's own layout, planned as the flags would plan it
            tp, pp, dp_shard, dp_replicate, ep = (
                job.config_layout[k] for k in ("tp", "pp", "dp_shard", "dp_replicate", "ep")
            )
        if layout_given and (compare or strategy is not None):
            raise PhalanxError(
                "a layout (--tp/--pp/--cp/--dp-shard/--dp-replicate/--ep) is planned on one device and "
                "replaces --strategy; drop --compare / --strategy"
            )
        # A model preset with no layout and no strategy: propose one. A run config keeps its strategy.
        from phalanx.models.presets import MODEL_PRESETS

        propose_one = strategy is None and source in MODEL_PRESETS and job.name == source
        if not compare and (layout_given or propose_one):
            from phalanx.plan import propose
            from phalanx.plan.report import print_layouts

            job = dataclasses.replace(job, cp=cp or job.cp, pp_schedule=pp_schedule or job.pp_schedule)
            if layout_given:
                par = propose.given_layout(job, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, ep=ep)
                result = propose.plan_layout(job, devices[0], par, mfu=mfu, headroom=headroom, do_trace=not no_trace)
            else:
                result = propose.propose(job, devices[0], mfu=mfu, headroom=headroom, do_trace=not no_trace)
            print(json.dumps(result)) if json_out else print_layouts(result)
            return
        if compare:
            rows = planner.compare(job, devices, mfu=mfu, headroom=headroom)
            if json_out:
                print(json.dumps({"job": planner.job_summary(job), "mfu": mfu, "headroom": headroom, "devices": rows}))
            else:
                print_compare(job, rows, mfu, headroom)
            return
        report = planner.plan(job, devices[0], mfu=mfu, headroom=headroom)
        if json_out:
            print(json.dumps(report))
        else:
            print_plan(report)
