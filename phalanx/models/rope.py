"""Rotary position embeddings (RoPE) in Hugging Face's rotate_half layout, with Llama 3.1's frequency
scaling: the tables a model builds once, and the rotation every attention layer applies to q and k.

Shape suffixes: T tokens, E head dim, B batch, N heads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from phalanx.models.fused_linear import is_plain

if TYPE_CHECKING:
    from phalanx.models.decoder import ModelArgs


def rope_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The E/2 rotation frequencies of plain RoPE."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_frequency_divisors(args: ModelArgs, device=None) -> torch.Tensor | None:
    """What Llama 3.1 scaling divides each frequency by (None without scaling). GGUF stores exactly these
    as `rope_freqs`, so llama.cpp rotates by the same angles."""
    if args.rope_scaling_factor == 1:
        return None
    inv_freq = rope_inverse_frequencies(args.head_size, args.rope_theta, device)
    wavelength = 2 * math.pi / inv_freq
    factor, low, high, context = (
        args.rope_scaling_factor,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_max_seq_len,
    )
    smooth = ((context / wavelength - low) / (high - low)).clamp(0, 1)  # 0 at the long end, 1 at the short
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelength < context / high, torch.ones_like(divisors), divisors)
    return torch.where(wavelength > context / low, torch.full_like(divisors, factor), divisors)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device=None, divisors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_seq_len, E), float32, in HF's layout: the E/2 frequencies repeated twice.
    `divisors` (rope_frequency_divisors) slow frequencies down for long contexts."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, device)
    if divisors is not None:
        inv_freq = inv_freq / divisors
    freqs = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_rotation(cos_TE: torch.Tensor, sin_TE: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tables every layer's RoPE multiplies q and k by (`rotate`), made once per forward rather
    than twice per layer (a decode step's tables are tiny, so there the per-layer casts and cats cost
    more than the rotation). cos and sin are cast to q/k's dtype (HF casts them to the activations'
    dtype: under bf16 autocast float32 tables would promote q and k, and so attention, to float32), and
    rotate_half's minus sign moves onto the table: cat(-x2, x1) * sin equals cat(x2, x1) * cat(-sin1,
    sin2) bit for bit (negation is exact), which saves a pass over half of q and k in the forward and
    one over their gradients in the backward."""
    cos_TE, sin_TE = cos_TE.to(dtype), sin_TE.to(dtype)
    sin1, sin2 = sin_TE.chunk(2, dim=-1)
    return cos_TE, torch.cat((-sin1, sin2), dim=-1)


def rotate(x_BNTE: torch.Tensor, cos_TE: torch.Tensor, signed_sin_TE: torch.Tensor) -> torch.Tensor:
    """RoPE with tables from rope_rotation, made for x's dtype (rope_dtype). Tables of another dtype are
    cast here so that q and k keep theirs; tables made narrower than x then carry their rounding."""
    if cos_TE.dtype != x_BNTE.dtype:
        cos_TE, signed_sin_TE = cos_TE.to(x_BNTE.dtype), signed_sin_TE.to(x_BNTE.dtype)
    # Training takes the written-out backward (_Rotation), which has no gradient for the tables. Inference
    # keeps the composite, the ops serving's decode-step timings were measured with (its tensors are tiny,
    # so op count matters there more than passes). Compiled, inductor fuses the composite anyway (and
    # dynamo refuses _rotated's strided out=).
    if (
        torch.is_grad_enabled()
        and x_BNTE.requires_grad
        and is_plain(x_BNTE)
        and not cos_TE.requires_grad
        and not signed_sin_TE.requires_grad
        and not torch.compiler.is_compiling()
    ):
        return _Rotation.apply(x_BNTE, cos_TE, signed_sin_TE)
    x1, x2 = x_BNTE.chunk(2, dim=-1)
    return x_BNTE * cos_TE + torch.cat((x2, x1), dim=-1) * signed_sin_TE


def _rotated(x_BNTE: torch.Tensor, cos_TE: torch.Tensor, signed_sin_TE: torch.Tensor) -> torch.Tensor:
    """x * cos + cat(x2, x1) * signed_sin, the same products and sum (so the same bits), with the swapped
    halves' products written straight into their places instead of concatenating x's halves first."""
    half = x_BNTE.shape[-1] // 2
    swapped = torch.empty(
        torch.broadcast_shapes(x_BNTE.shape, signed_sin_TE.shape), dtype=x_BNTE.dtype, device=x_BNTE.device
    )
    torch.mul(x_BNTE[..., half:], signed_sin_TE[..., :half], out=swapped[..., :half])
    torch.mul(x_BNTE[..., :half], signed_sin_TE[..., half:], out=swapped[..., half:])
    return (x_BNTE * cos_TE).add_(swapped)


class _Rotation(torch.autograd.Function):
    """RoPE whose backward is written out: the rotation's transpose, dx = g * cos + cat(g2 * s2, g1 * s1)
    (g's halves g1, g2, the signed sin's s1, s2), the same products and sums autograd of the composite
    forms, so the same bits, in three passes instead of its five and a concatenation. It keeps the same
    two tables for the backward, and nothing of x."""

    @staticmethod
    def forward(ctx, x_BNTE, cos_TE, signed_sin_TE):
        ctx.save_for_backward(cos_TE, signed_sin_TE)
        return _rotated(x_BNTE, cos_TE, signed_sin_TE)

    @staticmethod
    def backward(ctx, grad_BNTE):
        cos_TE, signed_sin_TE = ctx.saved_tensors
        # The forward's own arithmetic with the signed sin's halves swapped (a table T x E, tiny).
        s1, s2 = signed_sin_TE.chunk(2, dim=-1)
        return _rotated(grad_BNTE, cos_TE, torch.cat((s2, s1), dim=-1)), None, None


def apply_rope(x_BNTE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """RoPE of x by HF-layout tables (rope_tables), in one call."""
    return rotate(x_BNTE, *rope_rotation(cos_TE, sin_TE, x_BNTE.dtype))


def rope_dtype(x_BTD: torch.Tensor) -> torch.dtype:
    """The dtype q and k will have for layer input x: autocast's where it is on, else x's own."""
    device = x_BTD.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_BTD.dtype
