"""The command-line front of phalanx eval: register() adds its command to the main typer app."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from phalanx.console import JsonOpt, say
from phalanx.errors import PhalanxError


def register(app: typer.Typer) -> None:
    @app.command(name="eval")
    def eval_command(
        path: Path = typer.Argument(
            ...,
            metavar="RUN_DIR|EXPORT",
            help="A run directory (its newest checkpoint), a checkpoint, an HF or a GGUF export.",
        ),
        tasks: Optional[str] = typer.Option(
            None, "--tasks", help="lm-evaluation-harness tasks, separated by commas (hellaswag,arc_easy)."
        ),
        text: Optional[Path] = typer.Option(
            None, "--text", help="A UTF-8 text file: report bits per byte and perplexity on it instead of tasks."
        ),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most this many samples per task."),
        batch_size: int = typer.Option(8, "--batch-size", min=1, help="Prompts scored together (the engine's slots)."),
        include_path: Optional[Path] = typer.Option(
            None, "--include-path", help="A directory of local task files (*.yaml) besides lm-eval's own."
        ),
        context: Optional[int] = typer.Option(
            None, "--context", min=2, help="--text: tokens per window (default: the model's max_seq_len)."
        ),
        stride: Optional[int] = typer.Option(
            None, "--stride", min=1, help="--text: tokens a window moves on (default: half the window)."
        ),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
        json_out: bool = JsonOpt,
    ) -> None:
        """Evaluate a model: lm-evaluation-harness tasks through phalanx's engine, or bits per byte on text.

        Results are printed and, for a run directory or checkpoint, saved as RUN_DIR/eval/step_N-TIME.json.

        Examples:
          phalanx eval runs/demo --tasks hellaswag,arc_easy --limit 100
          phalanx eval runs/demo --tasks my_task --include-path tasks/ --json
          phalanx eval exports/demo-hf --text held_out.txt
        """
        if (tasks is None) == (text is None):
            raise PhalanxError("give either --tasks T1,T2 (lm-evaluation-harness) or --text FILE (bits per byte)")
        from phalanx.extras import require

        if text is not None:
            require("export", "phalanx eval")  # the model loader reads exports as well as runs
            from phalanx.eval.run_text import evaluate_text

            report = evaluate_text(path, text, context, stride, device)
        else:
            require("serve", "phalanx eval --tasks")  # the harness talks to phalanx's server
            require("eval", "phalanx eval --tasks")
            from phalanx.eval.run_tasks import evaluate_tasks_report

            report = evaluate_tasks_report(path, tasks, limit, batch_size, include_path, device)
        from phalanx.eval.report import print_tasks_table, print_text_table, save_report

        saved = save_report(report)
        if saved is not None and text is None:  # task scores: the dashboard shows them from the store
            from phalanx.eval.store_report import store_report

            stored = store_report(Path(report["run_dir"]))
            if stored:
                say(stored)
        if json_out:
            print(json.dumps({**report, "saved": str(saved) if saved else None}))
        else:
            (print_text_table if text is not None else print_tasks_table)(report)
            if saved:
                say(f"saved {saved}")
