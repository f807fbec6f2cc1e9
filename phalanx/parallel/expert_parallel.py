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

FSDP2 then shards each rank's experts further over the ranks that hold the same ones (its "replicas":
the data-parallel ranks outside its ep group, ep x replicas = dp_replicate x dp_shard), as torchtitan's
"efsdp" does, so a rank keeps 1 / dp of the experts between steps rather than 1 / ep: shard_experts.
FSDP gathers them for each layer's forward and again for its backward, and reduce-scatters their
gradients over the replicas. Those gradients arrive already summed over the ep group (by the all-to-all's
backward), so FSDP divides them by the whole data-parallel size rather than the replicas', which gives
the same mean as the rest of the model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from phalanx.models.moe import EXPERT_WEIGHTS, moe_layers
from phalanx.parallel.mesh import Layout


def expert_meshes(mesh, layout: Layout):
    """(ep mesh, replicas mesh): the ranks that split the experts between them, and the ranks that hold
    the same experts (every data-parallel rank with the same ep coordinate)."""
    both = mesh["dp_replicate", "dp_shard"]._flatten("dp_for_experts")
    both = both._unflatten(0, (layout.dp // layout.ep, layout.ep), ("expert_replicas", "ep"))
    return both["ep"], both["expert_replicas"]


def apply_expert_parallel(model: nn.Module, mesh, layout: Layout) -> None:
    """Shard each MoE layer's experts over the ep ranks and route its rows to them (on the meta device,
    before FSDP, which shard_experts then applies to them over their replicas)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh, replicas = expert_meshes(mesh, layout)
    for moe in moe_layers(model):
        for name in EXPERT_WEIGHTS:
            weight = getattr(moe, name)
            setattr(moe, name, nn.Parameter(distribute_tensor(weight, ep_mesh, [Shard(0)])))
        moe.expert_parallel = AllToAllExperts(ep_mesh.get_group(), layout.ep, moe.n_experts, replicas)


def shard_experts(block: nn.Module, dp_mesh, policy, dp: int) -> None:
    """FSDP2 over a block's expert-parallel MoE layers, before the block's own (see the module
    docstring). The router and any shared experts are the block's kind of parameters, sharded over
    `dp_mesh`: each gets an FSDP group of its own first, so that the MoE module's group holds the experts
    alone and the block's group, which leaves modules already sharded alone, none of them."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for moe in moe_layers(block):
        if moe.expert_parallel is None:
            continue
        for part in (moe.router, moe.shared):
            if part is not None:
                fully_shard(part, mesh=dp_mesh, mp_policy=policy)
        replicas = moe.expert_parallel.replicas_mesh
        local_experts = moe.n_experts // moe.expert_parallel.ep
        # By expert where each replica gets whole experts; otherwise by the hidden dimension (dim 1 of
        # every expert weight), which no replica count short of the hidden size leaves empty.
        dim = 0 if local_experts % replicas.size() == 0 else 1
        fully_shard(moe, mesh=replicas, mp_policy=policy, shard_placement_fn=lambda _param, dim=dim: Shard(dim))
        moe.set_gradient_divide_factor(float(dp))
        # A sum and then the division: a reduction that scales as it goes (NCCL's PreMulSum) is not gloo's.
        # Not for a group of one, which torch 2.13 would then divide twice (its copy in place of the
        # reduce-scatter divides, and so does the division after the sum).
        moe.set_force_sum_reduction_for_comms(replicas.size() > 1)


class AllToAllExperts:
    """MoE.expert_parallel: computes rows sorted by expert on the ranks that hold their experts."""

    def __init__(self, group, ep: int, n_experts: int, replicas_mesh):
        self.group, self.ep, self.local_experts = group, ep, n_experts // ep
        self.replicas_mesh = replicas_mesh  # the ranks holding the same experts: shard_experts

    def __call__(self, x_PD: torch.Tensor, counts_E: torch.Tensor, compute) -> torch.Tensor:
        if isinstance(counts_E, FakeTensor):
            return self._evenly(x_PD, compute)
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

    def _evenly(self, x_PD: torch.Tensor, compute) -> torch.Tensor:
        """The planner's traced step (plan/traced.py), whose fake tensors hold no routing: the rows
        spread evenly over the ranks and their experts, as the hand model assumes, through the same
        all-to-alls, regrouping copies and expert computation as a real step."""
        rows = x_PD.shape[0]
        sizes = [rows // self.ep + (rank < rows % self.ep) for rank in range(self.ep)]
        rows_RD = _all_to_all(x_PD, sizes, sizes, self.group)
        per_expert = [rows // self.local_experts + (e < rows % self.local_experts) for e in range(self.local_experts)]
        order_R = torch.arange(rows, device=x_PD.device)  # stands in for the regrouping permutation
        out_RD = compute(rows_RD[order_R], torch.tensor(per_expert, device=x_PD.device))
        return _all_to_all(out_RD[order_R], sizes, sizes, self.group)


def _all_to_all(x_RD: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group) -> torch.Tensor:
    """Rows to and from every rank of `group` in uneven parts; differentiable (the backward sends the
    gradients back the other way)."""
    out = funcol.all_to_all_single_autograd(x_RD.contiguous(), output_sizes, input_sizes, group)
    return funcol.wait_tensor(out)
