"""Weight-only int8 for serving on CPU (`phalanx serve --quantize int8`).

Each linear layer's weight is kept as int8 with one scale per output row (symmetric: w ~ q * s, q in
-127..127, s = max |w| of the row / 127) and multiplied by torch's own int8-weight kernel
(aten._weight_int8pack_mm) against bfloat16 activations. What it buys is memory: a linear weight takes a
quarter of its fp32 bytes and half of bf16's (the engine's packed bf16 layers keep a second copy of
theirs, row_invariant.py). Speed, measured in the engine on the 125m shape (bench/serve_side_by_side.py,
BENCHMARKS.md): about bf16's at one stream and 1.4x fp32's, but half of bf16's at 16 streams, since the
kernel's time grows with the rows while oneDNN's bf16 product hardly does; the kernel's fp32 path is a
slow reference (40x its bf16 time), so int8 weights always serve with bfloat16 activations.

The kernel needs the reduction (in_features) to be a multiple of 16: torch 2.13's CPU kernel reads out
of bounds (a segmentation fault) otherwise, so such layers keep their bf16 weights. Sized decode steps
need every row to be the same bits at every width (torch_engine.py): each quantised shape is checked as the
packed bf16 layers are (row_invariant.rows_agree), and a CPU where that fails refuses the option.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.serve.engines.row_invariant import rows_agree

K_MULTIPLE = 16
_int8_mm = getattr(torch.ops.aten, "_weight_int8pack_mm", None)


class Int8WeightLinear(nn.Module):
    """y = x (q * s)^T (+ b) for 2-D or 3-D bf16 x; q int8 (out, in), s bf16 (out,)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._dtype = torch.bfloat16  # what rows_agree feeds it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = _int8_mm(flat, self.qweight, self.scale).view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def quantize_linear_weights(model: nn.Module) -> int:
    """Swap each nn.Linear of a bf16 CPU model whose reduction is a multiple of 16 for an Int8WeightLinear,
    in place; how many were swapped. One clear error where the option cannot run."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype is not torch.bfloat16 or _int8_mm is None:
        raise PhalanxError(
            f"--quantize int8 runs on CPU with bfloat16 activations (--dtype auto or bfloat16), "
            f"not {weight.dtype} on {weight.device.type}"
        )
    swapped, checked = 0, set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.in_features % K_MULTIPLE:
                continue
            layer = Int8WeightLinear(child)
            shape = (child.in_features, child.out_features)
            if shape not in checked:
                if not rows_agree(layer):
                    raise PhalanxError(
                        "--quantize int8: this CPU's int8 kernel gives a row other bits in a batch "
                        "than alone, so a request's output could depend on its neighbours"
                    )
                checked.add(shape)
            setattr(parent, name, layer)
            swapped += 1
    return swapped
