"""The layout of a job: how many ranks pipeline, replicate, shard, context-split and tensor-split the
model, as one DeviceMesh.

Mesh dimensions, outermost first (torchtitan's order): pp (pipeline stages: point-to-point traffic only,
so it may cross nodes), dp_replicate (whole-model replicas: DDP, or HSDP's replica groups), dp_shard
(FSDP2 shard groups), cp (context parallelism: each rank holds a slice of every sequence) and tp (tensor
parallelism, innermost so its frequent collectives stay between the nearest ranks, inside one node).
Their product is the world size. Expert parallelism (ep) is not a dimension of its own: as in torchtitan,
it borrows dp_shard's ranks, which split a mixture of experts' experts among them
(parallel/expert_parallel.py) while still each taking their own slice of every batch. Batches depend only on a rank's data-parallel coordinate
(dp_replicate x dp_shard), so the pp, cp and tp ranks of one replica see the same tokens and the global
batch sequence never depends on the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config.schema import ParallelSection
from phalanx.errors import PhalanxError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1  # within dp_shard: ranks that split the experts between them

    @property
    def world_size(self) -> int:
        return self.dp * self.model_parallel

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel slice of each batch: pp x cp x tp."""
        return self.pp * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many distinct slices of each global batch there are."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
            ("ep", self.ep),
        ]
        return " x ".join(f"{name}={size}" for name, size in parts if size > 1 or name.startswith("dp_"))


def resolve_layout(section: ParallelSection, world_size: int) -> Layout:
    """The layout the config asks for on `world_size` ranks, or a PhalanxError naming the mismatch.

    Ranks left over by pp x cp x tp go to dp_shard under strategy fsdp and to dp_replicate under ddp,
    unless parallel.dp_replicate / parallel.dp_shard say otherwise (dp_shard=-1: all that is left)."""
    tp, pp, cp = section.tp, section.pp, section.cp
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise PhalanxError(
            f"parallel.pp={pp} x cp={cp} x tp={tp} = {model_parallel} does not divide the world size {world_size}"
        )
    rest = world_size // model_parallel
    replicate, shard = section.dp_replicate, section.dp_shard
    if shard == -1:
        if replicate is None:
            replicate = 1
        if rest % replicate:
            raise PhalanxError(
                f"parallel.dp_replicate={replicate} x pp x cp x tp = {replicate * model_parallel} "
                f"does not divide the world size {world_size}"
            )
        shard = rest // replicate
    if replicate is None and shard is None:
        replicate, shard = (rest, 1) if section.strategy == "ddp" else (1, rest)
    elif replicate is None:
        replicate = rest // shard if rest % shard == 0 else 0
    elif shard is None:
        shard = rest // replicate if rest % replicate == 0 else 0
    layout = Layout(replicate, shard, tp, pp, cp, section.ep)
    if layout.world_size != world_size or not replicate or not shard:
        raise PhalanxError(
            f"the layout pp={pp} x dp_replicate={section.dp_replicate or '?'} x "
            f"dp_shard={section.dp_shard or '?'} x cp={cp} x tp={tp} does not multiply to the world "
            f"size {world_size} (parallel.*)"
        )
    if shard % section.ep:
        raise PhalanxError(
            f"parallel.ep={section.ep} does not divide dp_shard={shard}: expert parallelism splits the experts "
            "over FSDP's shard ranks (parallel.strategy fsdp, or parallel.dp_shard)"
        )
    return layout


def build_mesh(layout: Layout, device_type: str):
    """The job's DeviceMesh with named dimensions; None for one process."""
    if layout.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp), mesh_dim_names=MESH_DIMS
    )


def dp_coordinate(mesh, layout: Layout) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): what the loader slices by."""
    if mesh is None:
        return 0, 1
    return mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank(), layout.dp
