"""Process-group life cycle. Ranks are started by torch's elastic launcher, which sets the env vars."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError
from phalanx.parallel.device import pick_backend, pick_device


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process, no process group
    # This rank's data-parallel coordinate and their number (parallel/mesh.py): what batches are sliced
    # by. Ranks that split one model (tensor parallelism) share one.
    dp_rank: int = 0
    dp_world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(strategy: str, backend: str, device: str) -> DistEnv:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and strategy == "none":
        raise PhalanxError(f"parallel.strategy=none cannot run {world_size} processes; use ddp or fsdp")
    dev = pick_device(device, local_rank)
    if world_size == 1:
        return DistEnv(0, 1, 0, dev, None)
    chosen = pick_backend(backend, dev)
    dist.init_process_group(chosen, device_id=dev if dev.type == "cuda" else None)
    return DistEnv(rank, world_size, local_rank, dev, chosen, dp_rank=rank, dp_world=world_size)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def teardown(clean: bool) -> None:
    """Destroy the process group after everything holding tensors is gone.

    On the CPU build of torch a rank could abort at exit ("terminate called without an active exception")
    when the group was destroyed while the model and optimizer were still alive; callers drop their
    references first and we collect here, which removed the abort in repeated runs (shared/DESIGN.md).
    The closing barrier is only for a clean finish: a rank failing alone would wait in it while its
    peers sit in another collective, turning its crash into a hang; it must exit so its agent sees it.
    """
    gc.collect()
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
