"""Entry point of one preflight rank, started by torch's elastic launcher like a trainer rank:
`python -m phalanx.preflight.worker PARAMS_JSON`.

Every rank measures its own device; the first rank of each node also takes the node's inventory,
hardware health and disk speed; then all ranks measure collectives together and bisect the group for a
slow rank. The figures are all-gathered, so every rank holds all of them, and the first rank of each
node writes them to the output file its launcher named: every node's `phalanx preflight` can report.
Grading against the limits happens in the launcher (evaluate.py), not here.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError
from phalanx.parallel.device import device_name, pick_backend, pick_device
from phalanx.parallel.device_health import read_health
from phalanx.parallel.distributed import teardown
from phalanx.preflight.bisection import find_slow_ranks
from phalanx.preflight.collectives import OPS, algbw_gbps, busbw_gbps, message_bytes, time_collective
from phalanx.preflight.compute import copy_bandwidth_gbps, disk_write_mbps, matmul_tflops
from phalanx.preflight.inventory import collect
from phalanx.preflight.thresholds import device_limits
from phalanx.preflight.timing import SlowRank, Timer
from phalanx.preflight.workload import workload


def main(argv: list[str]) -> int:
    (params_path,) = argv
    params = json.loads(Path(params_path).read_text())
    try:
        run(params)
    except PhalanxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def run(params: dict[str, Any]) -> None:
    started = time.perf_counter()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank, node_rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("GROUP_RANK", "0"))
    device = pick_device(params["device"], local_rank)
    backend = pick_backend(params["backend"], device)
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    clean = False
    try:
        raw = _measure(params, rank, world, local_rank, node_rank, device, backend, started)
        if local_rank == 0:
            _write(Path(params["output"]), raw)
        clean = True
    finally:
        teardown(clean)


def _measure(
    params: dict[str, Any],
    rank: int,
    world: int,
    local_rank: int,
    node_rank: int,
    device: torch.device,
    backend: str,
    started: float,
) -> dict[str, Any]:
    gpu = device.type == "cuda"
    name = device_name(device)
    wl = workload(gpu, params["quick"])
    slow = SlowRank(**params["slow"]) if params.get("slow") else None
    if slow is not None and slow.rank >= world:
        raise PhalanxError(f"the slow-rank drill names rank {slow.rank}, but the job has ranks 0-{world - 1}")
    timer = Timer(device, slow.factor if slow is not None and slow.rank == rank else 1.0)
    limits = device_limits(name, gpu, params.get("overrides"))
    progress = _Progress(rank == 0 and params.get("progress", True), started)

    identity = _gather((socket.gethostname(), node_rank, local_rank, name), world)
    labels = _node_labels(identity)
    # Nodes started with different options would run different collectives and hang; say so instead.
    options = json.dumps({k: params.get(k) for k in ("quick", "overrides", "slow")}, sort_keys=True)
    if len(set(_gather(options, world))) > 1:
        raise PhalanxError(
            "the nodes were started with different preflight options (--quick, --threshold, "
            "the slow-rank drill); start every node with the same ones"
        )

    mine: dict[str, Any] = {
        "rank": rank,
        "node": labels[rank],
        "local_rank": local_rank,
        "device": str(device),
        "device_name": name,
    }
    if local_rank == 0:
        progress.say("inventory, hardware health and disk write speed of each node")
        runs_root = Path(params["runs_root"])
        health = read_health(gpu, bool(torch.version.hip))
        mine["node_info"] = {
            "host": identity[rank][0],
            "node_rank": node_rank,
            "launcher": params["launcher"],
            "inventory": collect(runs_root, health["driver"]),
            "health": health,
            "disk_write_mbps": disk_write_mbps(runs_root, wl.disk_bytes),
        }
    dist.barrier()

    progress.say(f"matmul and memory bandwidth on every rank ({name})")
    # torch.matmul in fp32 must mean fp32: TF32 would report tensor-core figures under the fp32 name
    torch.backends.cuda.matmul.allow_tf32 = False
    for dtype, key in ((torch.bfloat16, "matmul_bf16_tflops"), (torch.float32, "matmul_fp32_tflops")):
        mine[key] = matmul_tflops(timer, dtype, wl.matmul_n, wl.warmup, wl.matmul_samples, wl.matmul_reps)
    mine["memory_bandwidth_gbps"] = copy_bandwidth_gbps(timer, wl.copy_bytes, wl.warmup, wl.copy_samples)
    if gpu:
        torch.cuda.empty_cache()
    dist.barrier()

    collectives, bisection = [], None
    if world > 1:
        progress.say(f"all-reduce and all-gather bus bandwidth across {world} ranks ({backend})")
        for op in OPS:
            for nbytes in wl.collective_bytes:
                size = message_bytes(op, nbytes, world)
                own = time_collective(
                    timer, op, size, None, world, wl.warmup, wl.collective_samples, wl.collective_reps
                )
                seconds = max(_gather(own, world))
                collectives.append(
                    {
                        "op": op,
                        "bytes": size,
                        "seconds": seconds,
                        "algbw_gbps": algbw_gbps(size, seconds),
                        "busbw_gbps": busbw_gbps(op, size, seconds, world),
                    }
                )
        if gpu:
            torch.cuda.empty_cache()
        progress.say("bisecting the group for a slow rank")
        threshold = limits["slow_rank_ratio"].warn or limits["slow_rank_ratio"].fail
        node_of = {r: identity[r][1] for r in range(world)}
        bisection = find_slow_ranks(
            timer, rank, world, node_of, wl.probe_bytes, wl.warmup, wl.probe_samples, wl.probe_reps, threshold
        ).to_json()

    every = _gather(mine, world)
    nodes: dict[str, dict[str, Any]] = {}
    for r in every:
        if "node_info" in r:
            nodes[r["node"]] = {**r.pop("node_info"), "ranks": []}
    for r in every:
        nodes[r["node"]]["ranks"].append(r["rank"])
    progress.say("done")
    return {
        "world_size": world,
        "backend": backend,
        "gpu": gpu,
        "quick": params["quick"],
        "nodes": nodes,
        "ranks": every,
        "collectives": collectives,
        "bisection": bisection,
        "workload": wl.__dict__,
        "slow_drill": params.get("slow"),
        "seconds": time.perf_counter() - started,
    }


def _node_labels(identity: list[tuple[str, int, int, str]]) -> list[str]:
    """Each rank's node by host name; nodes sharing a host name (several node agents on one machine,
    as in drills) are told apart by their node rank."""
    node_ranks: dict[str, set[int]] = {}
    for host, node_rank, _, _ in identity:
        node_ranks.setdefault(host, set()).add(node_rank)
    return [host if len(node_ranks[host]) == 1 else f"{host}#{node_rank}" for host, node_rank, _, _ in identity]


def _gather(value: Any, world: int) -> list[Any]:
    every: list[Any] = [None] * world
    dist.all_gather_object(every, value)
    return every


def _write(path: Path, raw: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw))
    tmp.replace(path)  # atomic: the launcher never reads half a file


class _Progress:
    """One line per phase on stderr from rank 0 (stdout stays free for --json)."""

    def __init__(self, enabled: bool, started: float):
        self.enabled, self.started = enabled, started

    def say(self, what: str) -> None:
        if self.enabled:
            print(f"preflight [{time.perf_counter() - self.started:5.1f} s] {what}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
