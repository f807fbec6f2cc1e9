"""All-reduce and all-gather bus bandwidth across ranks, counted the way nccl-tests counts it.

nccl-tests (doc/PERFORMANCE.md) reports two figures. The algorithm bandwidth is algbw = S / t, where S
is the message size: for all-reduce the bytes of the buffer every rank reduces (count x element size);
for all-gather the bytes of the whole gathered output (each rank contributes S / n). The bus bandwidth
scales algbw by how much data each rank must actually move, so that it can be compared with the
hardware's link speed whatever the number of ranks n:
  all-reduce  busbw = algbw * 2 (n - 1) / n   (a ring reduce-scatter, then a ring all-gather)
  all-gather  busbw = algbw * (n - 1) / n
We use the same S (the `bytes` of every result) and report GB/s = 10^9 bytes/s. t is the slowest
rank's median time for one operation: a collective is done when its last rank is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from phalanx.preflight.timing import Timer

OPS = ("all_reduce", "all_gather")
ELEMENT = torch.float32


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "all_gather":
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


def algbw_gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def busbw_gbps(op: str, nbytes: int, seconds: float, n: int) -> float:
    return algbw_gbps(nbytes, seconds) * bus_factor(op, n)


def message_bytes(op: str, nbytes: int, n: int) -> int:
    """The size actually used: whole elements, and for all-gather a multiple of n pieces."""
    unit = ELEMENT.itemsize * (n if op == "all_gather" else 1)
    return max(unit, nbytes // unit * unit)


def collective_op(
    op: str, nbytes: int, device: torch.device, group: dist.ProcessGroup | None, n: int
) -> Callable[[], object]:
    """A closure running one `op` of `nbytes` (as message_bytes gives it) over `group`."""
    count = message_bytes(op, nbytes, n) // ELEMENT.itemsize
    if op == "all_reduce":
        buf = torch.ones(count, device=device, dtype=ELEMENT)
        return lambda: dist.all_reduce(buf, group=group)
    out = torch.empty(count, device=device, dtype=ELEMENT)
    piece = torch.ones(count // n, device=device, dtype=ELEMENT)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch renames it
    return lambda: gather(out, piece, group=group)


def time_collective(
    timer: Timer,
    op: str,
    nbytes: int,
    group: dist.ProcessGroup | None,
    n: int,
    warmup: int,
    samples: int,
    reps: int = 1,
) -> float:
    """This rank's median seconds for one `op` (a drill's delay shows in its peers' times, not its own)."""
    run = collective_op(op, nbytes, timer.device, group, n)
    return timer.median(run, warmup, samples, reps, collective=True)
