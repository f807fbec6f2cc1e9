"""Rotary position embeddings (RoPE) in Hugging Face's rotate_half layout, with Llama 3.1's frequency
scaling or YaRN's (DeepSeek-V3's): the tables a model builds once, and the rotation every attention layer
applies to q and k.

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
    """What Llama 3.1 scaling divides each frequency by (None without it). GGUF stores exactly these as
    `rope_freqs`, so llama.cpp rotates by the same angles."""
    if args.rope_scaling_factor == 1 or args.rope_scaling_type != "llama3":
        return None
    inv_freq = rope_inverse_frequencies(args.rope_dim, args.rope_theta, device)
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (its paper's eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(args: ModelArgs) -> float:
    """What YaRN multiplies the cos and sin tables by, as transformers derives it: the ratio of the two
    mscales where the config gives both (DeepSeek-V3: both 1, so 1), else the plain mscale."""
    factor = args.rope_scaling_factor
    if args.yarn_mscale and args.yarn_mscale_all_dim:
        return yarn_mscale(factor, args.yarn_mscale) / yarn_mscale(factor, args.yarn_mscale_all_dim)
    return yarn_mscale(factor)


def yarn_softmax_factor(args: ModelArgs) -> float:
    """What multi-head latent attention multiplies its softmax scale by under YaRN: mscale_all_dim's
    mscale squared (DeepSeek's reference does; it covers the dims RoPE does not rotate too); 1 otherwise."""
    if args.rope_scaling_type != "yarn" or not args.yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(args.rope_scaling_factor, args.yarn_mscale_all_dim) ** 2


def yarn_inverse_frequencies(args: ModelArgs, device=None) -> torch.Tensor:
    """The E/2 frequencies under YaRN: the fast ones (more than beta_fast turns over the original context)
    kept, the slow ones (fewer than beta_slow turns) divided by the factor, a linear ramp between, over
    the pair indices in between, rounded outwards (transformers' `truncate`, its default)."""
    dim, base, factor = args.rope_dim, args.rope_theta, args.rope_scaling_factor

    def pair_index(turns: float) -> float:  # the pair whose wavelength fits `turns` times in the context
        return dim * math.log(args.rope_original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_index(args.yarn_beta_fast)), 0)
    high = min(math.ceil(pair_index(args.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    periods = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    kept, slowed = 1.0 / periods, 1.0 / (factor * periods)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the frequency as it was, 0: divided by the factor
    return slowed * (1 - keep) + kept * keep


def model_rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_seq_len, rope_dim) for a model: plain, Llama 3.1's or YaRN's (whose tables are
    also scaled by its attention factor, as transformers scales them)."""
    if args.rope_scaling_type == "yarn" and args.rope_scaling_factor != 1:
        angles = torch.outer(
            torch.arange(args.max_seq_len, device=device).float(), yarn_inverse_frequencies(args, device)
        )
        angles = torch.cat((angles, angles), dim=-1)
        factor = yarn_attention_factor(args)
        return angles.cos() * factor, angles.sin() * factor
    divisors = rope_frequency_divisors(args, device)
    return rope_tables(args.rope_dim, args.max_seq_len, args.rope_theta, device, divisors)


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
