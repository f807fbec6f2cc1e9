"""The layout of a job: how many ranks replicate, shard and tensor-split the model, as one DeviceMesh.

Mesh dimensions, outermost first: dp_replicate (whole-model replicas: DDP, or HSDP's replica groups),
dp_shard (FSDP2 shard groups) and tp (tensor parallelism, innermost so its frequent collectives stay
between the nearest ranks, inside one node). Their product is the world size. Batches depend only on a
rank's data-parallel coordinate (dp_replicate x dp_shard), so the tp ranks of one replica see the same
tokens and the global batch sequence never depends on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config.schema import ParallelSection
from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many distinct slices of each global batch there are."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x tp={self.tp}"


def resolve_layout(section: ParallelSection, world_size: int) -> Layout:
    """The layout the config asks for on `world_size` ranks, or a PhalanxError naming the mismatch.

    Ranks left over by tp go to dp_shard under strategy fsdp and to dp_replicate under ddp, unless
    parallel.dp_replicate / parallel.dp_shard say otherwise (dp_shard=-1: all that is left)."""
    tp = section.tp
    if world_size % tp:
        raise PhalanxError(f"parallel.tp={tp} does not divide the world size {world_size}")
    rest = world_size // tp
    replicate, shard = section.dp_replicate, section.dp_shard
    if shard == -1:
        if replicate is None:
            replicate = 1
        if rest % replicate:
            raise PhalanxError(f"parallel.dp_replicate={replicate} x tp={tp} does not divide the world size "
                               f"{world_size}")
        shard = rest // replicate
    if replicate is None and shard is None:
        replicate, shard = (rest, 1) if section.strategy == "ddp" else (1, rest)
    elif replicate is None:
        replicate = rest // shard if rest % shard == 0 else 0
    elif shard is None:
        shard = rest // replicate if rest % replicate == 0 else 0
    layout = Layout(replicate, shard, tp)
    if layout.world_size != world_size or not replicate or not shard:
        raise PhalanxError(f"the layout dp_replicate={section.dp_replicate or '?'} x dp_shard={section.dp_shard or '?'} "
                           f"x tp={tp} does not multiply to the world size {world_size} (parallel.*)")
    return layout


def build_mesh(layout: Layout, device_type: str):
    """The job's DeviceMesh with named dimensions; None for one process."""
    if layout.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp_replicate, layout.dp_shard, layout.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def dp_coordinate(mesh, layout: Layout) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): what the loader slices by."""
    if mesh is None:
        return 0, 1
    return mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank(), layout.dp
