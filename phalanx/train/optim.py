"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.config.schema import TrainSection


def build_optimizer(model: nn.Module, train: TrainSection) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # Norm gains (1-D) are not decayed: pulling them to zero only fights the normalisation.
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # A pipeline stage may hold no 1-D parameters (the embedding alone): an empty group would break
    # resharding its optimizer state from and to other layouts, so it is left out.
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8)


def lr_at(step: int, train: TrainSection) -> float:
    """Learning rate for 1-based `step`: linear warm-up to `lr`, then cosine down to lr * min_lr_ratio."""
    if step <= train.warmup_steps:
        return train.lr * step / train.warmup_steps
    decay_steps = max(1, train.max_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    floor = train.lr * train.min_lr_ratio
    return floor + (train.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_gradients(params: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Total gradient norm (clipped to `max_norm` when > 0), correct for FSDP2's sharded DTensor grads
    and, with `pp_group`, over the whole model when each pipeline stage holds only its own layers."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(total, "full_tensor"):  # a DTensor holding per-shard partial norms
        total = total.full_tensor()
    if pp_group is not None:  # stages hold disjoint parameters: their squared norms add up
        import torch.distributed as dist

        total = total.pow(2)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
