"""Several bias-free linears that read the same input (q/k/v, gate/up), with one backward for all.

Why: on CPU the weight gradients of small projections are the step's slowest matrix products. A
(384 x 4096) @ (4096 x 384) product for each of wq, wk and wv runs at about half the rate of one
(1152 x 4096) @ (4096 x 384) product (MKL, measured in bench/cpu_train_vs_minimal_gpt.py's shape), and
autograd also adds the three input gradients one by one. So the backward concatenates the output
gradients once and runs one product for the input gradient and one for all the weight gradients.

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
        with torch.autocast(xc.device.type, enabled=False):
            x2 = xc.reshape(-1, xc.shape[-1])
            g = torch.cat([(gr if gr is not None else torch.zeros(x2.shape[0], w.shape[0], dtype=xc.dtype,
                                                                  device=xc.device)).reshape(x2.shape[0], -1)
                           for gr, w in zip(grads, wcs)], dim=1)
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = (g @ torch.cat(wcs)).view(xc.shape).to(ctx.input_dtype)
            grad_w = g.t() @ x2
        sizes = [w.shape[0] for w in wcs]
        grad_ws = [gw if ctx.needs_input_grad[2 + i] else None for i, gw in enumerate(grad_w.split(sizes))]
        return (grad_x, None, *grad_ws)


def _plain(t) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def shared_input_linears(x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """Each linear applied to x. The fused backward is used only while training plain tensors through
    plain nn.Linear modules; anything else (inference, whose numerics serving pins; DTensor weights under
    tensor parallelism, whose sharding plans hook the modules; replaced or hooked modules) calls the
    modules as before."""
    fusable = (torch.is_grad_enabled() and _plain(x)
               and all(type(m) is nn.Linear and m.bias is None and not m._forward_hooks
                       and not m._forward_pre_hooks and _plain(m.weight) and m.weight.requires_grad
                       for m in linears))
    if not fusable:
        return tuple(m(x) for m in linears)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if not torch.is_autocast_enabled(device) and any(m.weight.dtype != x.dtype for m in linears):
        return tuple(m(x) for m in linears)  # mixed dtypes outside autocast: F.linear's error, not ours
    return _SharedInputLinears.apply(x, dtype, *(m.weight for m in linears))
