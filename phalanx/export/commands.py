"""The command-line front of phalanx export: register() adds its command to the main typer app."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from phalanx.console import JsonOpt, print_table


def register(app: typer.Typer) -> None:
    @app.command()
    def export(
        run_dir: Path = typer.Argument(
            ..., help="A run directory (its newest checkpoint), a checkpoint directory, an HF or a GGUF export."
        ),
        fmt: str = typer.Option(
            ...,
            "--format",
            help="hf (transformers), gguf (llama.cpp, Ollama) or peft (a LoRA run's adapters alone, for peft).",
        ),
        out: Path = typer.Option(..., "--out", help="Directory to write; must not exist or be empty."),
        dtype: str = typer.Option(
            "f32",
            "--dtype",
            help="Weight type: f32, f16 or bf16; for GGUF also q8_0, q5_1, q5_0, q4_1, q4_0 (norms stay f32).",
        ),
        force: bool = typer.Option(False, "--force", help="Replace a non-empty --out."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Export a trained model for Hugging Face transformers or for llama.cpp / Ollama (a LoRA run: the
        model with its adapters merged), or a LoRA run's adapters alone for peft.

        Examples:
        phalanx export runs/demo --format hf --out exports/demo-hf
        phalanx export runs/demo --format gguf --out exports/demo-gguf --dtype f16
        phalanx export runs/demo --format gguf --out exports/demo-q8 --dtype q8_0
        phalanx export runs/demo-lora --format peft --out exports/demo-adapter
        """
        from phalanx.extras import require

        require("export", "phalanx export")
        from phalanx.export.export import export_run

        files = export_run(run_dir, fmt, out, dtype, force)
        report = {
            "format": fmt,
            "dtype": dtype,
            "out": str(Path(out).absolute()),
            "files": {f.name: f.stat().st_size for f in files},
        }
        if json_out:
            print(json.dumps(report))
        else:
            print_table(
                f"exported ({fmt}, {dtype})",
                {"out": report["out"], **{n: f"{s:,} bytes" for n, s in report["files"].items()}},
            )
