"""Per-rank and per-node throughput: matmul TFLOP/s, device memory bandwidth, disk write speed."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from phalanx.preflight.timing import Timer

CHUNK = 8 * 2**20  # disk writes go out in 8 MiB pieces, as a checkpoint writer's buffered writes do


def matmul_tflops(timer: Timer, dtype: torch.dtype, n: int, warmup: int, samples: int, reps: int) -> float:
    """Dense n x n @ n x n in `dtype`: 2 n^3 FLOPs per product over the median time of one."""
    a = torch.randn(n, n, device=timer.device, dtype=dtype)
    b = torch.randn(n, n, device=timer.device, dtype=dtype)
    out = torch.empty(n, n, device=timer.device, dtype=dtype)
    seconds = timer.median(lambda: torch.matmul(a, b, out=out), warmup, samples, reps)
    return 2 * n**3 / seconds / 1e12


def copy_bandwidth_gbps(timer: Timer, nbytes: int, warmup: int, samples: int) -> float:
    """A copy of `nbytes` between two device buffers: bytes read + bytes written per second (GB/s,
    10^9), as STREAM and the vendors' bandwidth tests count a copy."""
    src = torch.empty(nbytes // 4, device=timer.device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timer.median(lambda: dst.copy_(src), warmup, samples)
    return 2 * src.numel() * 4 / seconds / 1e9


def disk_write_mbps(directory: Path, nbytes: int) -> float:
    """Write `nbytes` to a new file in `directory`, fsync it (the data must reach the device, not just
    the page cache, as a checkpoint's must), delete it: MB/s (10^6). The bytes are random so that a
    compressing file system cannot make the figure look better than a checkpoint would see."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".phalanx-preflight-{uuid.uuid4().hex}.tmp"
    chunk = os.urandom(min(CHUNK, nbytes))
    written = 0
    try:
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            while written < nbytes:
                piece = chunk[: nbytes - written]
                f.write(piece)
                written += len(piece)
            os.fsync(f.fileno())
        elapsed = time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
    return written / elapsed / 1e6


def disk_free_gib(directory: Path) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(directory).free / 2**30
