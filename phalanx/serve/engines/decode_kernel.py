"""The decode step's linear products at the speed a core streams memory, with oneDNN's very bits (CPU).

A decode step of up to 16 rows is bound by reading the weights: about a hundred products read every
weight once per step. oneDNN's packed product (row_invariant.py) reads them at 10-15 GB/s a core at those
widths, where a plain sequential read runs at 21-28 GB/s (BENCHMARKS.md, issue 33). No torch or oneDNN
product reads faster and also keeps a row's bits the same at every width, so this one is written by hand
(decode_kernel.cpp, AVX-512): each weight packed into 64-output panels, read as one stream, up to four
rows at a time, every output summed in the order oneDNN sums it. The engine uses it only for the weight
shapes where a check at start finds every row's bits equal to oneDNN's (`panels_agree` in
row_invariant.py); on a CPU where oneDNN sums otherwise (AMX tiles, another block size) it keeps oneDNN,
and a request's tokens are the same alone and in a busy batch either way.

torch's cpp_extension compiles the kernel, with the native decode block (decode_block.cpp), on first
use (about 11 s; kept in $XDG_CACHE_HOME/phalanx, ~/.cache/phalanx by default: phalanx/native.py). It
is not used without a C++ compiler, without AVX-512 (avx512_bf16 for bfloat16 weights), or with
PHALANX_DECODE_KERNEL=0. The panels are a third copy of the linear weights, beside the plain weights and
oneDNN's packed ones, laid end to end in huge pages (huge_pages.py).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from phalanx.models.token_pass import DecodeRows
from phalanx.native import AVX512_BF16_FLAGS, load_library

PANEL = 64  # outputs per panel: decode_kernel.cpp's four 16-lane accumulators
BLOCK = 512  # oneDNN sums a row's inputs in blocks of this many, then adds the blocks (measured, both dtypes)
KERNEL_ROWS = 16  # the widest product the kernel takes: the widths the checks at start cover
_SOURCES = ["decode_kernel.cpp", "decode_block.cpp"]  # the kernel's ops; the native block (decode_block.py)


def decode_kernel_available(dtype: torch.dtype) -> bool:
    """Whether the kernel can run here for weights of this dtype (compiling it on the first call)."""
    if os.environ.get("PHALANX_DECODE_KERNEL", "1") == "0" or not torch.cpu._is_avx512_supported():
        return False
    if dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported():
        return False
    return dtype in (torch.float32, torch.bfloat16) and _compiled()


@functools.cache
def _compiled() -> bool:
    """Build the kernel once per source, flags and torch, keep it, and load it (phalanx/native.py)."""
    here = Path(__file__).parent
    return load_library(
        "phalanx_decode_kernel", [here / name for name in _SOURCES], [here / "decode_kernel.h"], AVX512_BF16_FLAGS
    )


def _panel_shape(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, int]:
    """(panels, padded inputs): bf16 pads an odd input count with a zero."""
    return -(-out_features // PANEL), in_features + (in_features % 2 if dtype == torch.bfloat16 else 0)


def panel_bytes(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    panels, padded_in = _panel_shape(out_features, in_features, dtype)
    return panels * PANEL * padded_in * dtype.itemsize


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """The weight (out, in) as the kernel reads it: 64-output panels, zero-padded. float32: [panel][in][64];
    bfloat16: [panel][in/2][64][2], an output's inputs k and k+1 side by side as vdpbf16ps takes them."""
    out_features, in_features = weight.shape
    panels, padded_in = _panel_shape(out_features, in_features, weight.dtype)
    padded = weight.new_zeros(panels * PANEL, padded_in)
    padded[:out_features, :in_features] = weight
    if weight.dtype == torch.float32:
        return padded.view(panels, PANEL, padded_in).transpose(1, 2).contiguous()
    return padded.view(panels, PANEL, padded_in // 2, 2).permute(0, 2, 1, 3).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, block: int = BLOCK) -> torch.Tensor:
    """x (rows, in), contiguous, times the packed weight: (rows, out) in x's dtype."""
    return torch.ops.phalanx_decode_kernel.linear(x, panels, out_features, block)


class KernelDecodeRows(DecodeRows):
    """A decode step whose attention runs in the decode kernel (CPU, float32 cache): each row's query over
    its own cached positions only, where torch's batched products read every position of the step's span
    at about 9 GB/s (BENCHMARKS.md). Every row is summed alone in a fixed order, so its bits depend on
    neither its neighbours nor the span, as DecodeRows promises."""

    def attend_cached(self, attention, q_BKGE, k_BKSE, v_BKSF) -> torch.Tensor:
        ops = torch.ops.phalanx_decode_kernel
        scale = 1.0 / math.sqrt(q_BKGE.shape[-1])
        scores_BKGS = ops.attend_scores(q_BKGE.contiguous(), k_BKSE, self.positions_B, scale)  # -inf past a row
        if attention.sliding_window is not None:
            scores_BKGS = scores_BKGS.masked_fill(self.hidden_B11S(attention.sliding_window), float("-inf"))
        return ops.attend_values(torch.softmax(scores_BKGS, dim=-1), v_BKSF, self.positions_B)
