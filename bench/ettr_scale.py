"""ETTR as a function of job size: the goodput model (phalanx/safe/ettr_model.py) fed with recovery
times measured by the fault drills, at Llama 3's interruption rate (one per ~3.1 h on 16,384 GPUs).

The defaults are the H200 drill's figures (BENCHMARKS.md, "Keeping a run alive"): a killed rank detected
in 0.21 s and training again 9.7 s after the kill; a hang detected at its timeout (the default floor,
60 s) and training again 13.9 s after detection; an asynchronous save's stall of 3 s (125m on CPU:
2.7-4.1 s). Faults are taken as half crashes, half hangs. Nothing here is measured at scale: it is
the model's projection from small-scale measurements.

    python bench/ettr_scale.py [--stall 3] [--interval-min 30]
"""

from __future__ import annotations

import argparse

from phalanx.safe.ettr_model import (
    LLAMA3_GPUS,
    LLAMA3_HOURS_PER_INTERRUPTION,
    RecoveryCosts,
    best_interval,
    projected_ettr,
)

SIZES = (8, 64, 512, 4_096, 16_384, 32_768, 131_072)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crash-detect", type=float, default=0.21)
    parser.add_argument("--crash-restart", type=float, default=9.5)
    parser.add_argument("--hang-detect", type=float, default=60.0)
    parser.add_argument("--hang-restart", type=float, default=13.9)
    parser.add_argument("--load", type=float, default=0.2, help="checkpoint load, seconds")
    parser.add_argument("--stall", type=float, default=3.0, help="training stall per save, seconds")
    parser.add_argument("--interval-min", type=float, default=30.0, help="fixed checkpoint interval, minutes")
    args = parser.parse_args()
    costs = RecoveryCosts(
        detection=(args.crash_detect + args.hang_detect) / 2,
        restart=(args.crash_restart + args.hang_restart) / 2,
        load=args.load,
        save_stall=args.stall,
    )
    fixed = args.interval_min * 60
    print(
        f"costs per fault: detection {costs.detection:.2f} s, restart {costs.restart:.2f} s, load {costs.load:.2f} s;"
        f" save stall {costs.save_stall:.2f} s"
    )
    print(f"| GPUs | MTBF | ETTR, save every {args.interval_min:g} min | best interval | ETTR at best |")
    print("|---|---|---|---|---|")
    for gpus in SIZES:
        best = best_interval(costs, gpus)
        mtbf_h = LLAMA3_GPUS / gpus * LLAMA3_HOURS_PER_INTERRUPTION
        print(
            f"| {gpus:,} | {mtbf_h:,.1f} h | {projected_ettr(costs, fixed, gpus):.3f} | {best / 60:,.1f} min | "
            f"{projected_ettr(costs, best, gpus):.3f} |"
        )


if __name__ == "__main__":
    main()
