"""The SwiGLU feed-forward of a dense block, also DeepSeek-V3's shared experts (models/moe.py)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from phalanx.models.fused_linear import shared_input_linears


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x_BTD):
        gate_BTF, up_BTF = shared_input_linears(x_BTD, [self.w1, self.w3])
        return self.w2(F.silu(gate_BTF) * up_BTF)
