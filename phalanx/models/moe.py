"""A mixture of experts in place of a block's feed-forward (Mixtral, Qwen3-MoE): token-choice top-k routing
over SwiGLU experts whose weights are stacked, one tensor per projection, computed as grouped GEMMs.

Each token's router scores are a softmax over the experts (in float32, as transformers computes them);
the token goes to its top k, with the k scores as weights, renormalised to sum to 1 where the model does
(Mixtral always, Qwen3-MoE by norm_topk_prob). The (token, expert) pairs are sorted by expert, so that
each expert's tokens are contiguous, and torch._grouped_mm runs every expert's product in one call on
the sorted rows (offsets: where each expert's rows end); its backward gives the experts' gradients the
same way. Where torch lacks _grouped_mm, a loop over the experts computes the same products.

Load balancing: in training, each MoE layer keeps its auxiliary loss, Switch Transformer's
n_experts * sum_e f_e * P_e (f_e: the fraction of the layer's tokens routed to expert e, each token
counted for each of its k experts, so the fractions sum to k; P_e: e's mean router probability), as
Mixtral and Qwen3-MoE train with in transformers. moe_aux_loss() is router_aux_loss_coef times the
layers' mean, which the train step adds to the loss it differentiates (the loss it reports stays the
cross-entropy, comparable with a dense model's). transformers computes one such loss over all layers'
tokens pooled; the per-layer mean here is torchtitan's and Megatron's form, which balances every layer
on its own.

Weights: w1 (gate) and w3 (up) are (experts, ffn, dim), w2 (down) is (experts, dim, ffn), each expert's
slice laid out as the dense FeedForward's nn.Linear weight, so a checkpoint's per-expert tensors are
slices of these (models/families/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class MoE(nn.Module):
    def __init__(
        self, dim: int, ffn_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, aux_loss_coef: float = 0.0
    ):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.aux_loss: torch.Tensor | None = None  # this forward's load-balancing loss, in training
        self.routed: torch.Tensor | None = None  # tokens per expert since routing_counts() last took them
        # Set from outside under expert parallelism (parallel/expert_parallel.py): sends each row to the
        # rank holding its expert, computes there, and brings the result back.
        self.expert_parallel = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        weights_NK, experts_NK, counts_E = self.route(x_ND)
        # Each (token, slot) pair's row, grouped by expert (stable: a token's pairs stay in slot order).
        order_P = torch.argsort(experts_NK.flatten(), stable=True)
        token_P = order_P // self.top_k
        if self.expert_parallel is None:
            out_PD = self.experts(x_ND[token_P], counts_E)
        else:  # the rows travel to the ranks holding their experts and back (parallel/expert_parallel.py)
            out_PD = self.expert_parallel(x_ND[token_P], counts_E, self.experts)
        out_PD = out_PD * weights_NK.flatten()[order_P].to(out_PD.dtype).unsqueeze(-1)
        return torch.zeros_like(x_ND).index_add_(0, token_P, out_PD.to(x_ND.dtype)).view(B, T, D)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's k routing weights and experts, (N, k) each, and the tokens each expert is sent
        (E,); adds those to `routed` and, in training, keeps the load-balancing loss."""
        probs_NE = F.softmax(self.router(x_ND).float(), dim=-1)
        weights_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        counts_E = torch.bincount(experts_NK.flatten(), minlength=self.n_experts)
        self.routed = counts_E if self.routed is None else self.routed + counts_E
        self.aux_loss = None
        if self.training:
            share_E = counts_E.float() / x_ND.shape[0]  # per token: the shares sum to top_k
            self.aux_loss = self.n_experts * (share_E * probs_NE.mean(dim=0)).sum()
        return weights_NK, experts_NK, counts_E

    def experts(self, x_PD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each row by its expert: rows sorted by expert, counts_E of them for each expert this
        process holds (all of them, or under expert parallelism its own share)."""
        # Autocast's dtype, or the rows' own: experts split over ranks keep their float32 weights while FSDP
        # casts the rest of the model (parallel/expert_parallel.py).
        autocast = torch.is_autocast_enabled(x_PD.device.type)
        dtype = torch.get_autocast_dtype(x_PD.device.type) if autocast else x_PD.dtype
        x_PD = x_PD.to(dtype)
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        if hasattr(torch, "_grouped_mm"):
            ends = torch.cumsum(counts_E, 0).to(torch.int32)

            def grouped(rows, weight):  # rows @ weight[e].T for each expert's rows
                return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=ends)

        else:
            sizes = counts_E.tolist()

            def grouped(rows, weight):
                parts = rows.split(sizes)
                return torch.cat([part @ weight[e].T for e, part in enumerate(parts)])

        return grouped(F.silu(grouped(x_PD, w1)) * grouped(x_PD, w3), w2)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's experts of a stacked weight: under expert parallelism it is a DTensor sharded by
    expert, and the rows reaching this process are only for its own experts."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def routing_counts(model: nn.Module) -> torch.Tensor | None:
    """(MoE layers, experts): the tokens each expert was sent since the last call, over this process's
    forwards (each token counted once for each of its k experts); the counts start again from zero.
    None for a dense model, or before any forward."""
    layers = moe_layers(model)
    if not layers or any(m.routed is None for m in layers):
        return None
    counts = torch.stack([m.routed for m in layers])
    for m in layers:
        m.routed = None
    return counts


def imbalance(counts_LE: torch.Tensor) -> list[float]:
    """Per MoE layer, the busiest expert's tokens over the mean expert's: 1 is perfectly balanced, and
    n_experts / top_k the worst (every token to the same k experts)."""
    counts_LE = counts_LE.float()
    return (counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp(min=1e-9)).tolist()


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """What the load balancing adds to the loss after a training forward: router_aux_loss_coef times the
    mean of the MoE layers' losses; None for a dense model (or one whose coefficient is 0)."""
    layers = [m for m in moe_layers(model) if m.aux_loss is not None and m.aux_loss_coef]
    if not layers:
        return None
    return layers[0].aux_loss_coef * torch.stack([m.aux_loss for m in layers]).mean()
