"""Step time of each parallel layout against DDP on the same ranks, through the real `phalanx train`.

Every layout trains the same model, batch and seed on 2 gloo ranks (the CPU here has 2 cores); the
figure is the median step time of the steps after the first two (warm-up), and each layout's ratio to
DDP's. Layouts are run in turn, `--repeats` times, and the medians of the rounds are reported.

    python bench/layout_bench.py [--preset tiny] [--steps 20] [--repeats 2] [--runs DIR] [--moe]

PP needs untied embeddings, so every layout trains an untied model (model.tie_embeddings=false). With
`--moe`, a mixture of experts (`--preset tiny-moe --moe`) runs the layouts it trains under: DDP, FSDP, and FSDP with its
experts split over the 2 ranks (parallel.ep=2: the same products, plus two all-to-alls per layer).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from phalanx.run.records import read_metrics

LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "tp=2": ["parallel.tp=2"],
    "pp=2 (1f1b)": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp=2 (gpipe)": ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "cp=2": ["parallel.cp=2"],
}
MOE_LAYOUTS = {
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp + ep=2": ["parallel.strategy=fsdp", "parallel.ep=2"],
}


def step_time(runs: Path, name: str, preset: str, steps: int, seq_len: int, layout: list[str]) -> float:
    args = [
        sys.executable,
        "-m",
        "phalanx",
        "train",
        "demo",
        f"model.preset={preset}",
        "model.tie_embeddings=false",
        f"train.max_steps={steps}",
        f"train.seq_len={seq_len}",
        "train.global_batch_size=8",
        f"train.eval_interval={steps}",
        "train.eval_batches=1",
        f"checkpoint.interval={steps}",
        "safe.preflight=off",
        f"run.dir={runs}",
        f"run.name={name}",
        "checkpoint.resume=never",
        *layout,
        "--nproc",
        "2",
        "--json",
    ]
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=3600)
    lines = read_metrics(runs / name)
    seconds = [m["step_seconds"] for m in lines if "step_seconds" in m and m["step"] > 2]
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--moe", action="store_true", help="the layouts a mixture of experts trains under")
    args = parser.parse_args()
    runs = args.runs or Path(tempfile.mkdtemp(prefix="layout-bench-"))
    layouts = MOE_LAYOUTS if args.moe else LAYOUTS
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for round_ in range(args.repeats):
        for name, layout in layouts.items():
            slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
            run = f"{args.preset}-{slug}-{round_}"
            times[name].append(step_time(runs, run, args.preset, args.steps, args.seq_len, layout))
    ddp = statistics.median(times["ddp"])
    print(f"{args.preset}, 2 ranks, global batch 8 x {args.seq_len} tokens, median step after warm-up")
    print("| layout | step | vs DDP |")
    print("|---|---|---|")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.3f} s | {median / ddp:.2f}x |")


if __name__ == "__main__":
    main()
