"""How fast the run page's data comes out of the store for a long run: 100,000 steps on 8 ranks.

Fills a fresh store (SQLite by default, or --store URL) with synthetic but realistic records, then times
the dashboard's run-page data call (curves, rank heatmap, events, goodput, config) over several tries.
Usage: python bench/store_bench.py [--steps 100000] [--ranks 8] [--store URL]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from phalanx.observe.pages import run_page_data
from phalanx.observe.store import RunStore, store_url


def fill(store: RunStore, steps: int, ranks: int) -> int:
    run_id = store.start_run(
        "bench", Path(tempfile.mkdtemp()) / "bench", {"train": {"max_steps": steps}}, "8b", ranks, steps, "node0"
    )
    rng, t0, chunk = random.Random(0), time.time() - steps, 5000
    for start in range(1, steps + 1, chunk):
        metrics, rank_records, events = [], [], []
        for step in range(start, min(start + chunk, steps + 1)):
            loss = 10 * step**-0.3 + rng.random() * 0.05
            metrics.append(
                {
                    "step": step,
                    "time": t0 + step,
                    "loss": loss,
                    "lr": 3e-4,
                    "grad_norm": 1 + rng.random(),
                    "tokens_per_sec": 50000 + rng.random() * 1000,
                    "mfu": 0.4,
                    "peak_mem_gib": 60.0,
                    "step_seconds": 1.0,
                    **({"val_loss": loss + 0.1} if step % 100 == 0 else {}),
                }
            )
            for rank in range(ranks):
                slow = 1.3 if rank == 5 and 40000 < step < 60000 else 1.0
                rank_records.append(
                    {
                        "step": step,
                        "rank": rank,
                        "node": f"node{rank // 8}",
                        "time": t0 + step,
                        "step_seconds": 1.0,
                        "compute_seconds": 0.6 * slow + rng.random() * 0.01,
                        "data_seconds": 0.01,
                    }
                )
            if step % 10000 == 0:
                events.append({"kind": "checkpoint_saved", "time": t0 + step, "step": step, "seconds": 20.0})
        store.ingest(run_id, metrics, rank_records, events, {})
    return run_id


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--store", default=None)
    parser.add_argument("--tries", type=int, default=10)
    args = parser.parse_args()
    store = RunStore(store_url(args.store, Path(tempfile.mkdtemp())))
    t0 = time.perf_counter()
    run_id = fill(store, args.steps, args.ranks)
    print(
        f"filled {args.steps:,} steps x {args.ranks} ranks in {time.perf_counter() - t0:.1f} s "
        f"({store.engine.dialect.name})"
    )
    times = []
    for _ in range(args.tries):
        t0 = time.perf_counter()
        data = run_page_data(store, run_id)
        times.append(time.perf_counter() - t0)
    print(
        f"run page data: median {statistics.median(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms "
        f"over {args.tries} tries; {len(data['series']['step'])} curve points, "
        f"{len(data['heatmap']['steps'])} x {len(data['heatmap']['ranks'])} heatmap cells"
    )


if __name__ == "__main__":
    main()
