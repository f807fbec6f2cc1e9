"""How fast the dashboard's run page data endpoint answers for a long run: 100,000 steps on 8 ranks.

Fills a fresh store with store_bench.py's synthetic run, then times, over several tries:
  page data   run_page_data (the store queries)
  + figures   the same plus figures.run_figures (what the endpoint adds)
  endpoint    GET /api/runs/{id} over loopback HTTP from a real uvicorn server (queries, figures, YAML of
              the config, JSON encoding, transfer), as the run page polls it every 2 s
and the compare endpoint for two such runs.
Usage: python bench/dashboard_bench.py [--steps 100000] [--ranks 8] [--store URL] [--tries 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from store_bench import fill  # noqa: E402  (bench/ is a folder of scripts, not a package)

from phalanx.observe.app import create_app, running  # noqa: E402
from phalanx.observe.figures import run_figures  # noqa: E402
from phalanx.observe.pages import run_page_data  # noqa: E402
from phalanx.observe.store import RunStore, store_url  # noqa: E402


def timed(fn, tries: int) -> tuple[tuple[list[float], list[float]], object]:
    """Wall and CPU seconds of each call. CPU time (this process, all threads: the server's and the
    client's) does not grow when other jobs share the machine, so it tells contention from cost."""
    result, wall, cpu = None, [], []
    for _ in range(tries):
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return (wall, cpu), result


def report(label: str, times: tuple[list[float], list[float]]) -> None:
    wall, cpu = (sorted(t * 1000 for t in ts) for ts in times)
    p90 = wall[min(len(wall) - 1, int(0.9 * len(wall)))]
    print(
        f"{label:<28} wall median {statistics.median(wall):6.1f} ms  p90 {p90:6.1f} ms  max {wall[-1]:6.1f} ms"
        f"   cpu median {statistics.median(cpu):6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--store", default=None)
    parser.add_argument("--tries", type=int, default=20)
    args = parser.parse_args()
    store = RunStore(store_url(args.store, Path(tempfile.mkdtemp())))
    t0 = time.perf_counter()
    run_id = fill(store, args.steps, args.ranks)
    print(
        f"filled {args.steps:,} steps x {args.ranks} ranks in {time.perf_counter() - t0:.1f} s "
        f"({store.engine.dialect.name}); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )

    times, _ = timed(lambda: run_page_data(store, run_id), args.tries)
    report("page data", times)
    times, _ = timed(lambda: run_figures(run_page_data(store, run_id)), args.tries)
    report("page data + figures", times)

    with running(create_app(store)) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.get(f"/api/runs/{run_id}").raise_for_status()  # warm: first-request set-up is not a poll
        times, response = timed(lambda: client.get(f"/api/runs/{run_id}"), args.tries)
        report(f"GET /api/runs/{run_id}", times)
        figures = response.json()["figures"]
        print(
            f"{'':<28} {len(response.content) / 1024:.0f} KiB JSON ({response.num_bytes_downloaded / 1024:.0f} KiB "
            f"gzipped); {len(figures['loss']['data'][0]['x'])} loss "
            f"points, heatmap {len(figures['heatmap']['data'][0]['y'])} x {len(figures['heatmap']['data'][0]['x'])}"
        )
        times, _ = timed(lambda: client.get("/api/runs"), args.tries)
        report("GET /api/runs", times)
        times, _ = timed(lambda: client.get(f"/api/compare?ids={run_id}"), args.tries)
        report("GET /api/compare (1 run)", times)


if __name__ == "__main__":
    main()
