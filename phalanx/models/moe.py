"""A mixture of experts in place of a block's feed-forward (Mixtral, Qwen3-MoE, DeepSeek-V3): token-choice
top-k routing over SwiGLU experts whose weights are stacked, one tensor per projection, computed as
grouped GEMMs.

Each token's router scores are a softmax over the experts (in float32, as transformers computes them);
the token goes to its top k, with the k scores as weights, renormalised to sum to 1 where the model does
(Mixtral always, Qwen3-MoE by norm_topk_prob). DeepSeek-V3 scores each expert by a sigmoid instead, and
chooses by score plus a per-expert bias (`expert_bias`, a buffer: DeepSeek's auxiliary-loss-free
balancing moves it, MoE.update_bias) while the weights are the plain scores; it may also limit a
token to its best groups of experts (each group scored by the sum of its two best choice scores), scale
the k weights by routed_scaling_factor, and add shared experts (a dense SwiGLU every token passes
through) to the routed output. The (token, expert) pairs are sorted by expert, so that
each expert's tokens are contiguous, and torch._grouped_mm runs every expert's product in one call on
the sorted rows (offsets: where each expert's rows end); its backward gives the experts' gradients the
same way. Where torch lacks _grouped_mm, a loop over the experts computes the same products.

Load balancing: in training, each MoE layer keeps its auxiliary loss, Switch Transformer's
n_experts * sum_e f_e * P_e (f_e: the fraction of the layer's tokens routed to expert e, each token
counted for each of its k experts, so the fractions sum to k; P_e: e's mean router probability), as
Mixtral and Qwen3-MoE train with in transformers. It joins backward through the layer's output
(BalanceGradient) with the weight router_aux_loss_coef over the number of MoE layers, so the model
trains on the cross-entropy plus the coefficient times the layers' mean (the loss reported stays the
cross-entropy, comparable with a dense model's). transformers computes one such loss over all layers'
tokens pooled; the per-layer mean here is torchtitan's and Megatron's form, which balances every layer
on its own.

With sigmoid scores the load-balancing loss (where router_aux_loss_coef asks for one) takes P_e over the
scores normalised per token, as DeepSeek-V3's complementary sequence-wise loss does (here over the
layer's whole batch).

Weights: w1 (gate) and w3 (up) are (experts, ffn, dim), w2 (down) is (experts, dim, ffn), each expert's
slice laid out as the dense FeedForward's nn.Linear weight, so a checkpoint's per-expert tensors are
slices of these (models/families/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.feed_forward import FeedForward

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class MoE(nn.Module):
    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        aux_loss_coef: float = 0.0,
        *,
        scoring: str = "softmax",
        n_groups: int = 1,
        n_groups_per_token: int = 1,
        routed_scaling_factor: float = 1.0,
        n_shared_experts: int = 0,
    ):
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.aux_loss_coef = aux_loss_coef
        # The load-balancing loss's weight in backward: the trainer sets router_aux_loss_coef over the MoE
        # layers and the step's micro-batches (train/expert_balance.py), a mean over the layers like the
        # cross-entropy's over micro-batches; left alone, each layer's loss counts with the coefficient.
        self.aux_loss_scale = aux_loss_coef
        self.scoring, self.n_groups, self.n_groups_per_token = scoring, n_groups, n_groups_per_token
        self.routed_scaling_factor = routed_scaling_factor
        self.router = nn.Linear(dim, n_experts, bias=False)
        # Sigmoid routing's balancing bias: state, not a parameter (no gradient; update_bias moves
        # it), persistent so checkpoints and exports keep it, float32 as transformers keeps it.
        bias = torch.zeros(n_experts, dtype=torch.float32) if scoring == "sigmoid" else None
        self.register_buffer("expert_bias", bias)
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.shared = FeedForward(dim, n_shared_experts * ffn_dim) if n_shared_experts else None
        self.aux_loss: torch.Tensor | None = None  # this forward's load-balancing loss, in training
        self.routed: torch.Tensor | None = None  # tokens per expert since the trainer last reset it
        # Set from outside under expert parallelism (parallel/expert_parallel.py): sends each row to the
        # rank holding its expert, computes there, and brings the result back.
        self.expert_parallel = None
        # Set from outside under context parallelism (parallel/context_parallel.py): the load-balancing
        # loss of the whole sequences, whose tokens the cp ranks share, rather than of this rank's slice.
        self.sequence_balance = None

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
        out_BTD = torch.zeros_like(x_ND).index_add_(0, token_P, out_PD.to(x_ND.dtype)).view(B, T, D)
        if self.aux_loss is not None and self.aux_loss_scale and torch.is_grad_enabled():
            out_BTD = BalanceGradient.apply(out_BTD, self.aux_loss, self.aux_loss_scale)
        return out_BTD if self.shared is None else out_BTD + self.shared(x_BTD)

    def route(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's k routing weights and experts, (N, k) each, and the tokens each expert is sent
        (E,); adds those to `routed` and, in training, keeps the load-balancing loss."""
        logits_NE = self.router(x_ND).float()
        if self.scoring == "softmax" and self.n_groups == 1:  # Mixtral's and Qwen3-MoE's
            probs_NE = F.softmax(logits_NE, dim=-1)
            weights_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        else:
            probs_NE = F.softmax(logits_NE, dim=-1) if self.scoring == "softmax" else logits_NE.sigmoid()
            choice_NE = probs_NE if self.expert_bias is None else probs_NE + self.expert_bias
            if self.n_groups > 1:
                choice_NE = self._within_best_groups(choice_NE)
            experts_NK = torch.topk(choice_NE, self.top_k, dim=-1).indices
            weights_NK = probs_NE.gather(1, experts_NK)  # the scores themselves: the bias only chooses
            if self.norm_topk_prob:  # DeepSeek-V3's guard against k scores that are all zero
                weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1:
            weights_NK = weights_NK * self.routed_scaling_factor
        # Counted into a fixed E slots (not torch.bincount, whose output size depends on the values):
        # fake tensors and torch.compile can then follow the layer.
        flat = experts_NK.flatten()
        counts_E = torch.zeros(self.n_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        if not _recomputing():
            self.routed = counts_E if self.routed is None else self.routed + counts_E
        self.aux_loss = None
        if self.training:
            if self.scoring == "sigmoid":  # sigmoid scores do not sum to 1 per token: normalise them
                probs_NE = probs_NE / probs_NE.sum(dim=-1, keepdim=True)
            tokens, probs_sum_E = x_ND.shape[0], probs_NE.sum(dim=0)
            counted_E = counts_E
            if self.sequence_balance is not None:
                counted_E, probs_sum_E, tokens = self.sequence_balance(counts_E, probs_sum_E, tokens)
            share_E = counted_E.float() / tokens  # per token: the shares sum to top_k
            self.aux_loss = self.n_experts * (share_E * probs_sum_E / tokens).sum()
        return weights_NK, experts_NK, counts_E

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's routing
        bias moves by `rate` towards balance, up where the expert was sent fewer tokens than the layer's
        mean, down where more (bias += rate * sign(mean - load); DeepSeek-V3 trained with rate 0.001).
        counts_E: the step's tokens per expert, summed over every rank first so that the ranks' biases
        stay equal. Nothing for a router without a bias (softmax)."""
        if self.expert_bias is None:
            return
        load_E = counts_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E).to(self.expert_bias.dtype)

    def _within_best_groups(self, choice_NE: torch.Tensor) -> torch.Tensor:
        """The choice scores with every expert outside the token's n_groups_per_token best groups at -inf
        (a group's score: the sum of its two best experts' choice scores)."""
        N = choice_NE.shape[0]
        choice_NGX = choice_NE.view(N, self.n_groups, -1)
        group_NG = choice_NGX.topk(2, dim=-1).values.sum(dim=-1)
        best_NK = group_NG.topk(self.n_groups_per_token, dim=-1).indices
        chosen_NG = torch.zeros_like(group_NG, dtype=torch.bool).scatter_(1, best_NK, True)
        return choice_NGX.masked_fill(~chosen_NG.unsqueeze(-1), float("-inf")).view(N, -1)

    def experts(self, x_PD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each row by its expert: rows sorted by expert, counts_E of them for each expert this
        process holds (all of them, or under expert parallelism its own share)."""
        # Autocast's dtype (which does not cover the grouped GEMM), or the rows' own: under FSDP, whose
        # policy has cast the weights already.
        autocast = torch.is_autocast_enabled(x_PD.device.type)
        dtype = torch.get_autocast_dtype(x_PD.device.type) if autocast else x_PD.dtype
        # Compiled, torch traces _grouped_mm in bfloat16 only (its meta kernel refuses other dtypes): the
        # loop then stands in, reading its sizes before the weights, so that the break this makes in the
        # compiled graph does not fall between an expert-parallel weight and its to_local().
        traceable = dtype == torch.bfloat16 or not torch.compiler.is_compiling()
        sizes = None if hasattr(torch, "_grouped_mm") and traceable else counts_E.tolist()
        x_PD = x_PD.to(dtype)
        w1, w2, w3 = (_local(w).to(dtype) for w in (self.w1, self.w2, self.w3))
        if sizes is None:
            ends = torch.cumsum(counts_E, 0).to(torch.int32)

            def grouped(rows, weight):  # rows @ weight[e].T for each expert's rows
                return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=ends)

        else:

            def grouped(rows, weight):
                parts = rows.split(sizes)
                return torch.cat([part @ weight[e].T for e, part in enumerate(parts)])

        return grouped(F.silu(grouped(x_PD, w1)) * grouped(x_PD, w3), w2)


def _recomputing() -> bool:
    """Whether this forward runs inside backward: activation checkpointing's recomputation, which routes
    the same tokens again and must not count them twice. (Compiled, a block is traced in its forward.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's experts of a stacked weight: under expert parallelism it is a DTensor sharded by
    expert, and the rows reaching this process are only for its own experts."""
    from torch.distributed.tensor import DTensor  # isinstance: torch.compile reads hasattr() of it wrong

    return weight.to_local() if isinstance(weight, DTensor) else weight


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def imbalance(counts_LE: torch.Tensor) -> list[float]:
    """Per MoE layer, the busiest expert's tokens over the mean expert's: 1 is perfectly balanced, and
    n_experts / top_k the worst (every token to the same k experts)."""
    counts_LE = counts_LE.float()
    return (counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp(min=1e-9)).tolist()


class BalanceGradient(torch.autograd.Function):
    """The MoE layer's output unchanged, with the layer's load-balancing loss joining backward: where the
    output's gradient arrives, the loss gets the gradient `scale` (as Megatron's MoEAuxLossAutoScaler
    does). So the loss takes part in every backward that passes through the layer, a pipeline stage's
    included, without the training step having to collect it and add it to the loss it differentiates."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_out, torch.full_like(aux_loss, ctx.scale), None
