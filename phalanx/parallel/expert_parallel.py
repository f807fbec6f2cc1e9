"""Expert parallelism: a mixture of experts' experts split over `parallel.ep` ranks, each token's rows
sent with all-to-all to the ranks that hold its experts and brought back, as torchtitan and Megatron do.

The ep ranks are data-parallel ranks borrowed from dp_shard (parallel/mesh.py): each still takes its own
slice of every batch, routes its own tokens (models/moe.py), and holds n_experts / ep of the experts
(rank r: experts r * n / ep onwards) as DTensors sharded by expert on the "ep" mesh, so checkpoints (DCP)
hold every expert under its global index and reshard between ep degrees, and to one process, by
themselves.

What happens in an MoE layer's forward (its backward is the same all-to-alls the other way round):
1. each rank says how many of its rows go to each expert (one small all-to-all of counts), which gives
   every rank the uneven split sizes of the rows it sends and receives;
2. the rows, sorted by expert, go to their experts' ranks; they arrive grouped by source rank and then
   expert, and are regrouped by expert for the grouped GEMM;
3. the results go back the same way, into the order the rows left in.

Gradients: the rest of the model is FSDP's, which averages over the data-parallel ranks. The experts are
not FSDP's (they are sharded over ep instead, and replicated over the data-parallel ranks outside their
ep group: ep x dp_replicate x dp_shard / ep). Their gradients arrive summed over the ep group by the
all-to-all's backward; ExpertGradients sums them over the replicas too and divides by the data-parallel
size, which gives the same mean as FSDP's. Sharding the experts further with FSDP over those replicas
(torchtitan's "efsdp") is not built: each rank holds the whole of its 1/ep of the experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from phalanx.models.moe import EXPERT_WEIGHTS, MoE, moe_layers
from phalanx.parallel.mesh import Layout


def expert_meshes(mesh, layout: Layout):
    """(ep mesh, replicas mesh): the ranks that split the experts between them, and the ranks that hold
    the same experts (every data-parallel rank with the same ep coordinate)."""
    both = mesh["dp_replicate", "dp_shard"]._flatten("dp_for_experts")
    both = both._unflatten(0, (layout.dp // layout.ep, layout.ep), ("expert_replicas", "ep"))
    return both["ep"], both["expert_replicas"]


def apply_expert_parallel(model: nn.Module, mesh, layout: Layout) -> None:
    """Shard each MoE layer's experts over the ep ranks and route its rows to them (on the meta device,
    before FSDP, which must then leave the experts out: expert_parameters)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh, replicas = expert_meshes(mesh, layout)
    for moe in moe_layers(model):
        for name in EXPERT_WEIGHTS:
            weight = getattr(moe, name)
            setattr(moe, name, nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)])))
        moe.expert_parallel = AllToAllExperts(ep_mesh.get_group(), layout.ep, moe.n_experts, replicas.get_group())


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters expert parallelism shards (FSDP leaves them alone)."""
    return {getattr(m, name) for m in moe_layers(model) if m.expert_parallel is not None for name in EXPERT_WEIGHTS}


class AllToAllExperts:
    """MoE.expert_parallel: computes rows sorted by expert on the ranks that hold their experts."""

    def __init__(self, group, ep: int, n_experts: int, replicas_group):
        self.group, self.ep, self.local_experts = group, ep, n_experts // ep
        self.replicas_group = replicas_group

    def __call__(self, x_PD: torch.Tensor, counts_E: torch.Tensor, compute) -> torch.Tensor:
        # counts_E, read as (destination rank, its expert): what this rank sends to each expert.
        received_SL = torch.empty_like(counts_E)
        dist.all_to_all_single(received_SL, counts_E, group=self.group)
        received_SL = received_SL.view(self.ep, self.local_experts)  # (source rank, this rank's expert)
        sent = counts_E.view(self.ep, self.local_experts).sum(dim=1).tolist()
        received = received_SL.sum(dim=1).tolist()
        rows_RD = _all_to_all(x_PD, received, sent, self.group)
        # Arrived by source rank, then expert: regroup by expert (stable, so each expert's rows stay in
        # source-rank order), compute, and put the results back in arrival order.
        expert_R = torch.arange(self.local_experts, device=x_PD.device).repeat(self.ep)
        expert_R = torch.repeat_interleave(expert_R, received_SL.flatten())
        order_R = torch.argsort(expert_R, stable=True)
        out_RD = compute(rows_RD[order_R], received_SL.sum(dim=0))
        arrival_R = torch.empty_like(order_R)
        arrival_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
        return _all_to_all(out_RD[arrival_R], sent, received, self.group)


def _all_to_all(x_RD: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """Rows to and from every rank of `group` in uneven parts; differentiable (the backward sends the
    gradients back the other way)."""
    out = funcol.all_to_all_single_autograd(x_RD.contiguous(), output_sizes, input_sizes, group)
    return funcol.wait_tensor(out)


class ExpertGradients:
    """After backward, before clipping: the experts' gradients as the mean over the data-parallel ranks
    (see the module docstring)."""

    def __init__(self, model: nn.Module, layout: Layout):
        layers = [m for m in moe_layers(model) if m.expert_parallel is not None]
        self.params = [getattr(m, name) for m in layers for name in EXPERT_WEIGHTS]
        self.replicas_group = layers[0].expert_parallel.replicas_group if layers else None
        self.replicas = layout.dp // layout.ep
        self.dp = layout.dp

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return
        if self.replicas > 1:  # each in place: one flat copy of them all would be the step's peak at scale
            for grad in grads:
                dist.all_reduce(grad, group=self.replicas_group)
        torch._foreach_div_(grads, self.dp)


def expert_gradients(model: nn.Module, layout: Layout) -> ExpertGradients | None:
    if layout.ep == 1 or not any(isinstance(m, MoE) for m in model.modules()):
        return None
    return ExpertGradients(model, layout)
