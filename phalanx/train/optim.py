"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from phalanx.config.schema import TrainSection
from phalanx.parallel.pipeline import counted_in_grad_norm

# Dtypes torch's fused AdamW kernels take (floating point; the trainer's parameters are float32).
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def adamw_implementation(params: list[torch.Tensor]) -> dict[str, Any]:
    """AdamW's keyword for the implementation to run: torch's fused kernel (`_fused_adamw_`, one call per
    group of a device and dtype) where torch has one for every parameter's device and dtype, else {}
    (torch's default: foreach on GPUs, one parameter at a time on CPU, as for meta parameters).

    Fused, because on CPU its optimizer step measured 3x faster than the per-tensor default's (10 ms
    against 31 ms for 12M parameters: 1-6% of a training step, far more when the cores are shared;
    BENCHMARKS.md, issue 16): the default runs mul_/add_/lerp_/addcmul_/sqrt/addcdiv_ as separate passes
    over each parameter and allocates `exp_avg_sq.sqrt() / c` for the largest one, the fused kernel
    updates each parameter in one pass and allocates nothing (plan/memory.py models that). Under FSDP2
    and tensor parallelism the parameters are DTensors: DTensor runs the fused op on each local shard,
    so the same choice holds there (checked on torch 2.13; a DTensor's device and dtype are its shard's).
    One kernel call cannot take DTensors and plain tensors together, which tensor parallelism without
    FSDP gives a mixture of experts (its router and experts stay whole: parallel/tensor_parallel.py):
    such a mix steps one parameter at a time."""
    if len({hasattr(p, "device_mesh") for p in params}) > 1:
        return {"foreach": False}
    try:  # torch's own list; private, so a torch without it gets the default rather than an error
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return {}
    devices = _get_fused_kernels_supported_devices()
    if params and all(p.device.type in devices and p.dtype in _FUSED_DTYPES for p in params):
        return {"fused": True}
    return {}


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
    implementation = adamw_implementation(params)
    optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8, **implementation)
    optimizer.register_load_state_dict_pre_hook(_keep_implementation)
    return optimizer


def _keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A saved state dict carries each group's `fused`/`foreach` flags, and torch's load_state_dict would
    put them back: a checkpoint written by the per-tensor implementation (before fused was chosen, or on
    another device) would then resume on it. Keep the flags this optimizer was built with instead; the
    state itself (exp_avg, exp_avg_sq, step) is the same for every implementation, and with `fused` set
    here torch moves each `step` counter to its parameter's device as the fused kernel needs."""
    flags = {key: optimizer.param_groups[0][key] for key in ("fused", "foreach")}
    groups = [{**saved, **flags} for saved in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


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
    and experts sharded on a mesh of their own (expert parallelism: DTensor ops need one mesh, so each
    mesh's gradients are measured and clipped apart), and, with `pp_group`, over the whole model when each
    pipeline stage holds only its own layers (a tied embedding weight, held by the first and the last
    stage with the same summed gradient, counted once)."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    counted = [[p.grad for p in group if p.grad is not None and counted_in_grad_norm(p)] for group in by_mesh.values()]
    norms = [_total_norm(grads) for grads in counted] or [torch.zeros(())]
    total = norms[0] if len(norms) == 1 else torch.stack(norms).pow(2).sum().sqrt()
    if pp_group is not None:  # stages hold disjoint parameters (but for the tied copy): squared norms add up
        import torch.distributed as dist

        total = total.pow(2)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    return total.full_tensor() if hasattr(total, "full_tensor") else total  # DTensor: per-shard partial norms
