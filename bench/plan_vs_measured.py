"""The capacity planner against measured peaks, and its projections for GPU-sized jobs.

1. On this machine's CPU: real training steps of phalanx's model, parallelize() and AdamW on 2 gloo
   ranks (phalanx/plan/measure.py, torch's allocator events), next to the plan's peak per rank, for
   float32 (what CPU runs use) and the bf16 regimes GPUs use (autocast under DDP, FSDP2 mixed
   precision), with and without activation checkpointing. Process RSS growth is shown too, to show why
   it is not the yardstick.
2. Projections: 8b and 70b on 8 x MI300X / H100 / H200 with FSDP (no measurement here: no GPU).

Usage: .venv/bin/python bench/plan_vs_measured.py [--quick] [--json]   (prints Markdown tables)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan import planner
from phalanx.plan.devices import get_device
from phalanx.plan.memory import Workload, estimate

MIB = 2**20
# preset, strategy, micro batch, seq len, dtype, accumulation, activation checkpointing
CASES = [
    ("tiny", "ddp", 4, 256, "float32", 1, False),
    ("tiny", "fsdp", 4, 256, "float32", 1, False),
    ("125m", "ddp", 1, 128, "float32", 1, False),
    ("125m", "fsdp", 1, 128, "float32", 1, False),
    ("tiny", "ddp", 4, 256, "bfloat16", 1, False),
    ("tiny", "fsdp", 4, 256, "bfloat16", 1, False),
    ("tiny", "fsdp", 4, 256, "bfloat16", 1, True),
    ("tiny", "ddp", 4, 256, "float32", 1, True),
    ("tiny", "ddp", 2, 256, "bfloat16", 2, False),
    ("tiny", "fsdp", 2, 256, "float32", 2, False),
    ("125m", "fsdp", 2, 256, "bfloat16", 1, True),
]
PROJECTIONS = [("8b", 8192), ("70b", 8192)]


def measure(case: tuple, out: Path) -> list[dict]:
    preset, strategy, batch, seq, dtype, accumulation, ac = case
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "phalanx.plan.measure",
        "--preset",
        preset,
        "--strategy",
        strategy,
        "--micro-batch",
        str(batch),
        "--seq-len",
        str(seq),
        "--dtype",
        dtype,
        "--accumulation",
        str(accumulation),
        "--out",
        str(out),
    ]
    subprocess.run(cmd + (["--activation-checkpointing"] if ac else []), check=True, capture_output=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def measured_rows(cases: list[tuple]) -> list[dict]:
    rows = []
    for case in cases:
        preset, strategy, batch, seq, dtype, accumulation, ac = case
        with tempfile.TemporaryDirectory() as tmp:
            ranks = measure(case, Path(tmp))
        measured = max(r["peak_tensor_bytes"] for r in ranks)
        est = estimate(Workload(MODEL_PRESETS[preset], strategy, 2, batch, seq, accumulation, ac, dtype, "cpu"))
        rows.append(
            {
                "preset": preset,
                "strategy": strategy,
                "micro_batch": batch,
                "seq_len": seq,
                "dtype": dtype,
                "accumulation": accumulation,
                "activation_checkpointing": ac,
                "measured_mib": measured / MIB,
                "planned_mib": est.peak_bytes / MIB,
                "error": (est.peak_bytes - measured) / measured,
                "peak_at": est.peak_at,
                "rss_growth_mib": max(r["rss_delta_bytes"] for r in ranks) / MIB,
            }
        )
        print(f"measured {case}: {rows[-1]['error']:+.2%}", file=sys.stderr, flush=True)
    return rows


def projection_rows() -> list[dict]:
    rows = []
    for preset, seq in PROJECTIONS:
        for device_name in ("mi300x", "h100", "h200"):
            device = get_device(device_name)
            for ac in (False, True):
                job = planner.resolve_job(preset, 8, strategy="fsdp", seq_len=seq, activation_checkpointing=ac)
                report = planner.plan(job, device)
                rows.append(
                    {
                        "preset": preset,
                        "device": device_name,
                        "seq_len": seq,
                        "activation_checkpointing": ac,
                        "peak_gib_at_b1": report["memory"]["peak_gib"],
                        "peak_at": report["memory"]["peak_at"],
                        "fits_at_b1": report["fits"],
                        "max_micro_batch": report["max_micro_batch"],
                        "tokens_per_sec_8_devices_at_40pct_mfu": report["tokens_per_sec"],
                    }
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the four float32 cases")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    measured = measured_rows(CASES[:4] if opts.quick else CASES)
    projected = projection_rows()
    if opts.json:
        print(json.dumps({"measured": measured, "projected": projected}))
        return
    print(f"Machine: {platform.machine()} {platform.processor() or ''}, torch {torch.__version__}, 2 gloo ranks\n")
    print(
        "| preset | strategy | B x T | dtype | accum | AC | measured MiB | plan MiB | plan error | plan's peak moment"
        " | RSS growth MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in measured:
        print(
            f"| {r['preset']} | {r['strategy']} | {r['micro_batch']} x {r['seq_len']} | {r['dtype']} | "
            f"{r['accumulation']} | {'on' if r['activation_checkpointing'] else 'off'} | {r['measured_mib']:.1f} | "
            f"{r['planned_mib']:.1f} | {r['error']:+.2%} | {r['peak_at']} | {r['rss_growth_mib']:.0f} |"
        )
    print(
        "\n| model | 8 x device (fsdp, bf16, T) | AC | peak GiB/rank at B=1 | fits at B=1 | largest micro batch"
        " | tokens/s (8 devices, 40% MFU) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in projected:
        print(
            f"| {r['preset']} | {r['device']}, {r['seq_len']} | {'on' if r['activation_checkpointing'] else 'off'} | "
            f"{r['peak_gib_at_b1']:.1f} | {'yes' if r['fits_at_b1'] else 'no'} | {r['max_micro_batch']} | "
            f"{r['tokens_per_sec_8_devices_at_40pct_mfu']:,.0f} |"
        )


if __name__ == "__main__":
    main()
