"""The command-line front of the training step itself: `phalanx bench`."""

from __future__ import annotations

import json
from typing import Optional

import typer

from phalanx.console import JsonOpt, print_table
from phalanx.models.preset_names import PRESET_NAMES


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        preset: str = typer.Argument("tiny", help=f"Model preset: {', '.join(PRESET_NAMES)}."),
        seq_len: int = typer.Option(256, "--seq-len", min=1, metavar="T", help="Tokens per sequence."),
        micro_batch: int = typer.Option(8, "--micro-batch", min=1, metavar="B", help="Sequences per step."),
        steps: int = typer.Option(10, "--steps", min=1, metavar="N", help="Timed steps (the median is reported)."),
        warmup: int = typer.Option(3, "--warmup", min=0, metavar="N", help="Untimed steps first."),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
        dtype: str = typer.Option(
            "auto",
            "--dtype",
            help="auto (bf16 on GPUs and on CPUs with bf16 matrix units, else fp32), float32 or bfloat16.",
        ),
        compile: bool = typer.Option(False, "--compile", help="torch.compile each block."),
        activation_checkpointing: bool = typer.Option(
            False, "--activation-checkpointing", help="Recompute each block in backward."
        ),
        peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", help="Device peak, for MFU on CPUs."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Time forward + backward + optimizer steps of a model preset on this device.

        Examples:
        phalanx bench tiny --seq-len 256 --micro-batch 16
        phalanx bench 1b --seq-len 2048 --micro-batch 4 --json
        """
        from phalanx.errors import PhalanxError
        from phalanx.train.bench import run_bench

        if device not in ("auto", "cpu", "cuda") or dtype not in ("auto", "float32", "bfloat16"):
            raise PhalanxError(
                f"--device must be auto|cpu|cuda and --dtype auto|float32|bfloat16 (got {device}, {dtype})"
            )
        result = run_bench(
            preset,
            seq_len,
            micro_batch,
            steps,
            warmup,
            device=device,
            dtype=dtype,
            compile=compile,
            activation_checkpointing=activation_checkpointing,
            peak=peak_tflops,
        )
        if json_out:
            print(json.dumps(result))
        else:
            print_table(f"bench {preset}", result)
