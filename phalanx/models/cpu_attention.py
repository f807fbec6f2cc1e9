"""Causal attention for training steps on the CPU (cpu_attention.cpp), in bf16 and float32: torch's flash
attention's result to float rounding, two to four times faster forward and backward on a CPU without AMX.

Why by hand: torch's CPU flash attention runs its block products through MKL's GEMM; in bf16 on a CPU
without AMX that reaches about half of oneDNN's rate, so a bf16 step attended slower than a float32 one,
and attention was a quarter of a bf16 training step (BENCHMARKS.md, issue 33). No other torch op attends
at the matmul rate without keeping the T x T probabilities for the backward, and the planner counts what
attention keeps: this one keeps what flash attention keeps (q, k, v, the output and its float32
logsumexp), and recomputes the scores in the backward.

Used by Causal passes (training, evaluation, embeddings) where all of this holds, and SDPA serves
otherwise: CPU tensors attended in bf16 or float32 (the weights' dtype, or CPU autocast's), plain tensors
(not DTensor), eager mode, more than one token, a head dim that is a multiple of 32, no sliding window
shorter than the sequence, a CPU with avx512_bf16 and without AMX tiles, a C++ compiler to build it once
(phalanx/native.py), and PHALANX_CPU_ATTENTION not set to 0. It attends 64 queries at a time, so its
scratch grows with T, not T^2.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch

from phalanx.native import AVX512_BF16_FLAGS, load_library


def ready() -> bool:
    """Whether the kernel is on and loaded, building it first where this machine has no build of it yet
    (about 10 s, once). The trainer calls it at start, so that the build falls in the start's time limit
    rather than the first step's."""
    return os.environ.get("PHALANX_CPU_ATTENTION", "1") != "0" and _loaded()


@functools.cache
def _loaded() -> bool:
    # torch's bf16 products can run on AMX tiles, far beyond what vdpbf16ps reaches; this kernel was
    # measured faster than torch's flash kernel only on CPUs without them.
    if torch.cpu._is_amx_tile_supported():
        return False
    if not (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()):
        return False
    return load_library("phalanx_attention", [Path(__file__).with_name("cpu_attention.cpp")], [], AVX512_BF16_FLAGS)


def _attended_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would attend in: CPU autocast's where it is on (SDPA is on its lower-precision
    list), else q's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype


def applies(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, window: int | None) -> bool:
    """Whether causal_attention takes these: keys and values of q's length and head dim (not MLA's
    narrower value heads), kv heads that divide the query heads, and the rest of the module docstring."""
    _, H, T, E = q_BHTE.shape
    return (
        q_BHTE.device.type == "cpu"
        and type(q_BHTE) is torch.Tensor
        and _attended_dtype(q_BHTE) in (torch.bfloat16, torch.float32)
        and E % 32 == 0
        and T > 1
        and k_BKTE.shape == v_BKTE.shape
        and k_BKTE.shape[2:] == (T, E)
        and H % k_BKTE.shape[1] == 0
        and (window is None or T <= window)
        and not torch.compiler.is_compiling()
        and ready()
    )


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTE, k_BKTE, v_BKTE, cos_TE, signed_sin_TE):
        scale = 1.0 / math.sqrt(q_BHTE.shape[-1])
        out_BHTE, lse_BHT = torch.ops.phalanx_attention.causal_forward(
            q_BHTE, k_BKTE, v_BKTE, scale, cos_TE, signed_sin_TE
        )
        ctx.save_for_backward(q_BHTE, k_BKTE, v_BKTE, out_BHTE, lse_BHT, cos_TE, signed_sin_TE)
        ctx.scale = scale
        return out_BHTE

    @staticmethod
    def backward(ctx, grad_BHTE):
        q_BHTE, k_BKTE, v_BKTE, out_BHTE, lse_BHT, cos_TE, signed_sin_TE = ctx.saved_tensors
        if grad_BHTE.stride(-1) != 1:
            grad_BHTE = grad_BHTE.contiguous()
        grads = torch.ops.phalanx_attention.causal_backward(
            q_BHTE, k_BKTE, v_BKTE, out_BHTE, lse_BHT, grad_BHTE, ctx.scale, cos_TE, signed_sin_TE
        )
        return *grads, None, None


def rotates(q_BHTE: torch.Tensor, rope) -> bool:
    """Whether causal_attention can take q and k unrotated with these tables (rope_rotation's): one row
    per token, as wide as a head."""
    return all(table.shape == (q_BHTE.shape[2], q_BHTE.shape[3]) for table in rope)


def causal_attention(q_BHTE, k_BKTE, v_BKTE, rope=None) -> torch.Tensor:
    """SDPA(q, k, v, is_causal=True, enable_gqa=True) where `applies`: (B, H, T, E) in the attended dtype,
    its memory laid out (B, T, H, E) as the output projection reads it. rope: RoPE's (cos, signed sin)
    tables for the T positions (rope_rotation's, where `rotates`): q and k come unrotated, and the kernel
    rotates them as it reads them (rounded once to the attended dtype) and their gradients back, which
    saves RoPE's passes over q and k and over their gradients."""
    # Cast as autocast would cast SDPA's inputs, outside the Function so that autograd casts the
    # gradients back.
    dtype = _attended_dtype(q_BHTE)
    q_BHTE, k_BKTE, v_BKTE = (x.to(dtype) for x in (q_BHTE, k_BKTE, v_BKTE))
    q_BHTE, k_BKTE, v_BKTE = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_BHTE, k_BKTE, v_BKTE))
    cos_TE, signed_sin_TE = (None, None) if rope is None else (t.to(dtype).contiguous() for t in rope)
    return _CausalAttention.apply(q_BHTE, k_BKTE, v_BKTE, cos_TE, signed_sin_TE)
