"""Several bias-free linears that read the same input (q/k/v, gate/up), with one backward for all.

Why: autograd would add the projections' input gradients one by one, and under autocast cast the shared
input to bf16 once per projection (and keep every copy for the backward). Here the input is cast once
and kept once, and the input gradients are summed in place by `addmm_`. Each weight gradient is its own
product. An earlier version concatenated the output gradients for one weight-gradient product; at the CPU
training bench's shape that concatenation (32 MB for gate/up, a fresh allocation each time, and so fresh
pages) cost more than it saved: 50 ms against 40 ms per gate/up backward, 24 against 23 ms for q/k/v.

The forward is the same products as `F.linear` per weight (the same bits, in float32 and under autocast),
each output its own tensor, and autograd keeps what it kept before: the shared input (under autocast its
one bf16 copy instead of one per linear) and the weights (bf16 copies under autocast, as autocast's
cache kept). Parameter names and shapes are untouched: checkpoints, exports and sharding plans see the
same nn.Linear modules.
"""

from __future__ import annotations

import torch
from torch import nn


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, compute_dtype, *weights):
        # Cast the way autocast would (input once, each weight), then compute with autocast off so the
        # products run in exactly that dtype.
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(compute_dtype)
            wcs = [w.to(compute_dtype) for w in weights]
            x2 = xc.reshape(-1, xc.shape[-1])
            outs = [(x2 @ w.t()).view(*x.shape[:-1], w.shape[0]) for w in wcs]
        ctx.save_for_backward(xc, *wcs)
        ctx.input_dtype = x.dtype
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        xc, *wcs = ctx.saved_tensors
        grad_x, grad_ws = None, [None] * len(wcs)
        with torch.autocast(xc.device.type, enabled=False):
            x2 = xc.reshape(-1, xc.shape[-1])
            for i, (grad, w) in enumerate(zip(grads, wcs)):
                if grad is None:
                    continue
                g2 = grad.reshape(x2.shape[0], -1)
                if ctx.needs_input_grad[0]:  # summed in place: no separate add per projection
                    grad_x = g2 @ w if grad_x is None else grad_x.addmm_(g2, w)
                if ctx.needs_input_grad[2 + i]:
                    grad_ws[i] = g2.t() @ x2
        if grad_x is not None:
            grad_x = grad_x.view(xc.shape).to(ctx.input_dtype)
        return (grad_x, None, *grad_ws)


def is_plain(t) -> bool:
    """A tensor or parameter of torch's own type (not a DTensor, a FakeTensor or another subclass)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def shared_input_linears(x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """Each linear applied to x. The fused backward is used only while training plain tensors through
    plain nn.Linear modules; anything else (inference, whose numerics serving pins; DTensor weights under
    tensor parallelism, whose sharding plans hook the modules; replaced or hooked modules) calls the
    modules as before."""
    fusable = (
        torch.is_grad_enabled()
        and is_plain(x)
        and all(
            type(m) is nn.Linear
            and m.bias is None
            and not m._forward_hooks
            and not m._forward_pre_hooks
            and is_plain(m.weight)
            and m.weight.requires_grad
            for m in linears
        )
    )
    if not fusable:
        return tuple(m(x) for m in linears)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if not torch.is_autocast_enabled(device) and any(m.weight.dtype != x.dtype for m in linears):
        return tuple(m(x) for m in linears)  # mixed dtypes outside autocast: F.linear's error, not ours
    return _SharedInputLinears.apply(x, dtype, *(m.weight for m in linears))
