"""A decode step's transformer blocks, each in one native call (decode_block.cpp), on CPU.

Why: with the decode kernel's products reading the weights at the memory's pace, a one-row step of the
`125m` shape still spent about 3.5 ms in some 1,000 small torch ops dispatched from Python (RMSNorm,
RoPE, the cache writes, casts, softmax, SiLU, residual adds; BENCHMARKS.md, issue 33): a third of a
bf16 step. The native block runs a whole layer in one call, with the kernel's products.

It covers the dense grouped-query block of Llama, Mistral (sliding window), Qwen2 (q/k/v biases) and
Qwen3 (q/k norms); other blocks (mixtures of experts, multi-head latent attention, LoRA-wrapped layers)
keep the module's own forward, as does every layer where the kernel is not used. Each row is computed
alone in a fixed order, so its bits do not depend on its neighbours, the step's width or its span: a
request's greedy tokens stay the same alone and in a busy batch. The bits differ from the torch ops'
(exp, rsqrt, the order of a few sums) by float rounding. PHALANX_DECODE_BLOCK=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch

from phalanx.models.decoder import Attention, Transformer
from phalanx.models.feed_forward import FeedForward
from phalanx.models.token_pass import DecodeRows
from phalanx.serve.engines.decode_kernel import BLOCK, KernelDecodeRows
from phalanx.serve.engines.row_invariant import RowInvariantLinear


class NativeDecodeRows(KernelDecodeRows):
    """A decode step whose covered layers run as native blocks (`blocks`: layer index -> DecodeBlock)."""

    def __init__(self, cache, positions_B: torch.Tensor, blocks: dict[int, object]):
        super().__init__(cache, positions_B)
        self.blocks = blocks
        self._rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, E) each, made once per step

    def run_layer(self, layer, h_BTD, rope):
        index = layer.attention.layer_index
        block = self.blocks.get(index)
        if block is None:
            return super().run_layer(layer, h_BTD, rope)
        B = h_BTD.shape[0]
        if self._rope_rows is None:
            self._rope_rows = tuple(table.to(h_BTD.dtype).reshape(B, -1).contiguous() for table in rope)
        keys, values = self.cache.layer(index)
        return block.forward(h_BTD.reshape(B, -1), self.positions_B, *self._rope_rows, keys, values).view(B, 1, -1)


def decode_step_rows(model: Transformer, kernel: bool):
    """What the engine builds each decode step's token pass with: native blocks where any layer is
    covered, else the kernel's attention (`kernel`), else torch's."""
    if not kernel:
        return DecodeRows
    blocks = native_blocks(model) if os.environ.get("PHALANX_DECODE_BLOCK", "1") != "0" else {}
    return functools.partial(NativeDecodeRows, blocks=blocks) if blocks else KernelDecodeRows


def native_blocks(model: Transformer) -> dict[int, object]:
    """A DecodeBlock for each layer the native block covers, by layer index: a dense grouped-query block
    whose every linear takes the decode kernel (row_invariant.py), without biases on the output
    projection or the feed-forward."""
    blocks = {}
    for layer in model.layers.values():
        attention, ffn = layer.attention, layer.feed_forward
        if type(attention) is not Attention or type(ffn) is not FeedForward:
            continue
        linears = [attention.wq, attention.wk, attention.wv, attention.wo, ffn.w1, ffn.w3, ffn.w2]
        if not all(isinstance(m, RowInvariantLinear) and m._panels is not None and m._block == BLOCK for m in linears):
            continue
        if any(m.bias is not None for m in linears[3:]):
            continue
        norms = [layer.attention_norm, layer.ffn_norm] + (
            [attention.q_norm, attention.k_norm] if attention.q_norm else []
        )
        dtype = attention.wq.weight.dtype
        if len({norm.eps for norm in norms}) != 1 or any(norm.weight.dtype != dtype for norm in norms):
            continue
        weights = [norm.weight.detach() for norm in norms]
        block = torch.classes.phalanx_decode_kernel.DecodeBlock(
            attention.n_heads,
            attention.n_kv_heads,
            attention.head_dim,
            norms[0].eps,
            attention.sliding_window or -1,
            BLOCK,
            weights[0],
            weights[1],
            weights[2] if len(weights) > 2 else None,
            weights[3] if len(weights) > 2 else None,
        )
        for which, linear in enumerate(linears):  # q, k, v, o, w1 (gate), w3 (up), w2 (down)
            bias = None if linear.bias is None else linear.bias.detach()
            block.set_product(which, linear._panels, linear._sizes, linear.out_features, bias)
        blocks[attention.layer_index] = block
    return blocks
