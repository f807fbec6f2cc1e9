"""A Llama-3-style decoder, single-device and plain.

The math matches Hugging Face `LlamaForCausalLM` (RMSNorm in float32, RoPE in the rotate_half layout,
grouped-query attention, SwiGLU), so a checkpoint exported to HF gives the same logits. Parallelism
(FSDP, activation checkpointing, compile) is applied from outside, block by block over `model.layers`.

Shape suffixes: B batch, T new tokens, S key length (cache + new), D model dim, H query heads,
K kv heads, N heads of either kind, E head dim, V vocab.
"""

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.models.fused_linear import is_plain, shared_input_linears
from phalanx.models.rms_norm import rms_norm


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # Llama 3.1 RoPE scaling (HF's rope_type "llama3"); a factor of 1 is none. Long wavelengths (beyond
    # original_max_seq_len / low_freq_factor) are slowed by the factor, short ones (below
    # original_max_seq_len / high_freq_factor) kept, and those between blended smoothly.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise PhalanxError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise PhalanxError(f"model rope_theta and norm_eps must be positive: {self.rope_theta}, {self.norm_eps}")
        if self.dim % self.n_heads:
            raise PhalanxError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise PhalanxError(f"model n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise PhalanxError(f"model head_dim (dim / n_heads) must be even for RoPE, got {self.head_dim}")
        if (
            self.rope_scaling_factor < 1
            or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            or self.rope_original_max_seq_len <= 0
        ):
            raise PhalanxError(
                "model RoPE scaling needs rope_scaling_factor >= 1, 0 < rope_low_freq_factor < "
                "rope_high_freq_factor and a positive rope_original_max_seq_len"
            )


class KVCache:
    """Preallocated keys and values for every layer, each (B, K, max_len, E), filled by position."""

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        if max_len > args.max_seq_len:
            raise PhalanxError(f"KV cache of {max_len} tokens exceeds the model's max_seq_len {args.max_seq_len}")
        self.max_len = max_len
        shape = (batch_size, args.n_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.n_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even under bf16, and multiply by the weight after casting back: HF's order,
        # which decides the last bits of the logits (models/rms_norm.py: and a faster backward on CPU).
        return rms_norm(x, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The E/2 rotation frequencies of plain RoPE."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_frequency_divisors(args: ModelArgs, device=None) -> torch.Tensor | None:
    """What Llama 3.1 scaling divides each frequency by (None without scaling). GGUF stores exactly these
    as `rope_freqs`, so llama.cpp rotates by the same angles."""
    if args.rope_scaling_factor == 1:
        return None
    inv_freq = rope_inverse_frequencies(args.head_dim, args.rope_theta, device)
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


def decode_attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What batched decoding (Attention.attend_rows) attends in, and so what a server keeps its KV cache in:
    float32 on CPU (a bf16 model's cached values cast exactly), the model's dtype elsewhere. torch's
    batched matmuls at decode shapes (torch 2.13, one thread, 12 heads x 64, 128 keys, per layer) took
    144 us in bf16, 73 us casting a bf16 cache and 43 us on a float32 cache at one row; 1.95, 1.52 and
    0.70 ms at 16 rows."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class DecodeRows(NamedTuple):
    """Batched decoding's per-step facts, made once per forward for every layer (Transformer.forward):
    row b's new token sits at position positions_B[b] of a cache `span` positions long, and sees the
    cached positions up to there (hidden_B11S masks the rest)."""

    positions_B: torch.Tensor
    rows_B: torch.Tensor
    hidden_B11S: torch.Tensor

    @classmethod
    def of(cls, positions_B: torch.Tensor, span: int) -> "DecodeRows":
        B = positions_B.shape[0]
        visible_BS = torch.arange(span, device=positions_B.device)[None, :] <= positions_B[:, None]
        return cls(positions_B, torch.arange(B, device=positions_B.device), (~visible_BS).view(B, 1, 1, span))


class Attention(nn.Module):
    # Context parallelism (set from outside, parallel/context_parallel.py): each rank holds a slice of
    # every sequence, and this callable (q_BHTE, k_BKTE, v_BKTE) -> out_BHTE attends the local queries
    # causally over the whole sequence's keys and values, which other ranks hold. None: the local
    # tokens are the whole sequence.
    split_attention = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x_BTD, cos_TE, signed_sin_TE, kv_cache=None, start_pos: int = 0, decode_rows=None):
        """cos_TE and signed_sin_TE come from rope_rotation; decode_rows (a DecodeRows) means batched
        decoding, one new token per row at its own position."""
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism each rank projects only its share of the heads.
        q_BTX, k_BTX, v_BTX = shared_input_linears(x_BTD, [self.wq, self.wk, self.wv])
        q_BHTE = q_BTX.view(B, T, -1, self.head_dim).transpose(1, 2)
        k_BKTE = k_BTX.view(B, T, -1, self.head_dim).transpose(1, 2)
        v_BKTE = v_BTX.view(B, T, -1, self.head_dim).transpose(1, 2)
        q_BHTE, k_BKTE = rotate(q_BHTE, cos_TE, signed_sin_TE), rotate(k_BKTE, cos_TE, signed_sin_TE)
        if decode_rows is not None:
            return self.wo(self.attend_rows(q_BHTE, k_BKTE, v_BKTE, kv_cache, decode_rows))
        if self.split_attention is not None:
            if kv_cache is not None:
                raise PhalanxError("context parallelism splits training sequences; it has no KV cache")
            return self.wo(self.split_attention(q_BHTE, k_BKTE, v_BKTE).transpose(1, 2).reshape(B, T, -1))

        mask_TS, is_causal = None, True
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            end = start_pos + T
            cache_k[:B, :, start_pos:end] = k_BKTE
            cache_v[:B, :, start_pos:end] = v_BKTE
            # A cache may hold a bf16 model's keys in float32 (a server's on CPU, serve/engines/torch_engine.py): cast back, exactly.
            k_BKTE, v_BKTE = cache_k[:B, :, :end].to(q_BHTE.dtype), cache_v[:B, :, :end].to(q_BHTE.dtype)
            if T == 1:
                is_causal = False  # one new query may see every cached key
            elif start_pos > 0:
                # SDPA's is_causal aligns the triangle top-left, wrong when keys outnumber queries, so
                # spell the mask out: new token i sits at position start_pos + i.
                pos_T = torch.arange(start_pos, end, device=x_BTD.device)
                mask_TS = torch.arange(end, device=x_BTD.device)[None, :] <= pos_T[:, None]
                is_causal = False

        # Grouped-query attention: SDPA's enable_gqa shares each kv head across n_heads / n_kv_heads query
        # heads without copying k and v, in HF's repeat_kv head order (bit-identical output). Measured on
        # CPU (torch 2.13, 2 cores, fwd+bwd, medians): attention alone at (4, 8 heads / 4 kv, 256, 32)
        # 5.3-6.2 ms vs 6.0-7.0 ms for repeat_interleave; the whole tiny preset, batch 4 x 256, 168-176 ms
        # vs 166-178 ms. Never slower, so it is kept.
        out_BHTE = F.scaled_dot_product_attention(
            q_BHTE, k_BKTE, v_BKTE, attn_mask=mask_TS, is_causal=is_causal, enable_gqa=True
        )
        return self.wo(out_BHTE.transpose(1, 2).reshape(B, T, -1))

    def attend_rows(self, q_BHTE, k_BKTE, v_BKTE, kv_cache, rows: DecodeRows):
        """Batched decoding (a server's continuous batching): one new token per row, row b's at its own
        position rows.positions_B[b], attending to its cached keys up to there. Spelt out rather than SDPA:
        on CPU, SDPA shares rows out between threads so that a row's last bits change with its batch index,
        and a served request must get the same tokens whoever its neighbours are. Returns (B, 1, H * E)."""
        cache_k, cache_v = kv_cache
        B = q_BHTE.shape[0]
        cache_k[rows.rows_B, :, rows.positions_B] = k_BKTE[:, :, 0].to(cache_k.dtype)
        cache_v[rows.rows_B, :, rows.positions_B] = v_BKTE[:, :, 0].to(cache_v.dtype)
        # Query head h reads kv head h // group (HF's repeat_kv order), without copying the cache.
        group = self.n_heads // self.n_kv_heads
        # A server keeps its cache in this dtype (serve/engines/torch_engine.py), so the casts below are no-ops there.
        compute = decode_attention_dtype(q_BHTE.device, q_BHTE.dtype)
        q_BKGE = q_BHTE.reshape(B, self.n_kv_heads, group, self.head_dim).to(compute)
        scores_BKGS = (q_BKGE @ cache_k[:B].to(compute).transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        scores_BKGS = scores_BKGS.masked_fill(rows.hidden_B11S, float("-inf"))
        probs_BKGS = torch.softmax(scores_BKGS.float(), dim=-1).to(compute)
        out_BKGE = probs_BKGS @ cache_v[:B].to(compute)
        return out_BKGE.to(q_BHTE.dtype).reshape(B, 1, self.n_heads * self.head_dim)


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


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x_BTD, cos_TE, signed_sin_TE, kv_cache=None, start_pos: int = 0, decode_rows=None):
        h_BTD = x_BTD + self.attention(
            self.attention_norm(x_BTD), cos_TE, signed_sin_TE, kv_cache, start_pos, decode_rows
        )
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


def parameter_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """The generator parameter `name` draws its initial values from (see Transformer.init_weights)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


@torch.no_grad()
def init_parameter(tensor: torch.Tensor, name: str, rule: tuple[str, float], seed: int) -> None:
    """Fill a whole (unsharded) tensor by its rule, from its own generator."""
    kind, value = rule
    if tensor.is_meta:
        return  # nothing to fill until the model is materialised
    if kind == "ones":
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, value, generator=parameter_generator(seed, name, tensor.device))


class Transformer(nn.Module):
    # Context parallelism (set from outside with Attention.split_attention): a callable (local length,
    # device) -> the global positions (T,) of this rank's tokens, so RoPE rotates them as in the whole
    # sequence. None: the tokens start at start_pos.
    sequence_positions = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: they are derived from args, so checkpoints stay free of them, and init_weights
        # rebuilds them after a meta-device build is materialised with to_empty.
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim), persistent=False)
        self.init_weights()

    def init_rules(self) -> dict[str, tuple[str, float]]:
        """How each parameter starts, by name: ("normal", std) or ("ones", 1.0). The one table for a
        single-device model and a sharded one (parallel/materialize.py), so both start from the same
        weights."""
        std = 0.02
        # GPT-2: each block adds two outputs to the residual stream, so shrink them to keep its variance flat.
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        rules = {}
        for name, _ in self.named_parameters():  # a tied output weight is listed once, as the embedding
            if name.endswith("norm.weight"):
                rules[name] = ("ones", 1.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                rules[name] = ("normal", residual_std)
            else:
                rules[name] = ("normal", std)
        return rules

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Re-initialise every parameter and buffer. Each parameter draws from its own generator seeded
        by `seed` (default: torch's current seed) and its name, so its values never depend on which other
        parameters a rank holds or in which order they are made."""
        args = self.args
        if args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # Module.to_empty replaces meta parameters one module at a time, which unties them.
            self.output.weight = self.tok_embeddings.weight
        self.init_rope()
        seed = torch.initial_seed() if seed is None else seed
        params = dict(self.named_parameters())
        for name, rule in self.init_rules().items():
            init_parameter(params[name], name, rule, seed)

    @torch.no_grad()
    def init_rope(self) -> None:
        args, device = self.args, self.rope_cos.device
        cos, sin = rope_tables(
            args.head_dim, args.max_seq_len, args.rope_theta, device, rope_frequency_divisors(args, device)
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        positions_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) in the compute dtype; the caller takes .float() for the loss.

        positions_B (with a cache, T == 1, ignoring start_pos): row b's token sits at position
        positions_B[b], so rows at different lengths decode together (see Attention.attend_rows); the
        caller keeps each position below the cache length."""
        T = tokens_BT.shape[1]
        end = start_pos + T
        if positions_B is not None:
            if cache is None or T != 1:
                raise PhalanxError("per-row positions decode one token per row into a KV cache")
            # (B, 1, 1, E): each row's own RoPE angles, broadcast over heads.
            cos_TE, sin_TE = self.rope_cos[positions_B][:, None, None], self.rope_sin[positions_B][:, None, None]
        else:
            if end > self.args.max_seq_len:
                raise PhalanxError(f"sequence of {end} tokens exceeds the model's max_seq_len {self.args.max_seq_len}")
            if cache is not None and end > cache.max_len:
                raise PhalanxError(f"sequence of {end} tokens exceeds the KV cache length {cache.max_len}")
            if self.sequence_positions is not None and cache is None:
                positions_T = self.sequence_positions(T, tokens_BT.device)
                cos_TE, sin_TE = self.rope_cos[positions_T], self.rope_sin[positions_T]
            else:
                cos_TE, sin_TE = self.rope_cos[start_pos:end], self.rope_sin[start_pos:end]

        x_BTD = self.tok_embeddings(tokens_BT)
        cos_TE, signed_sin_TE = rope_rotation(cos_TE, sin_TE, rope_dtype(x_BTD))
        rows = DecodeRows.of(positions_B, cache.max_len) if positions_B is not None else None
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, cos_TE, signed_sin_TE, cache.layer(i) if cache is not None else None, start_pos, rows)
        return self.output(self.norm(x_BTD))

    def hidden_states(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, D) for whole sequences from position 0, without a cache: what
        the output projection would read, and what embeddings pool (serve/core/embeddings.py). Causal, so a
        row's right padding changes none of its earlier positions."""
        T = tokens_BT.shape[1]
        if T > self.args.max_seq_len:
            raise PhalanxError(f"sequence of {T} tokens exceeds the model's max_seq_len {self.args.max_seq_len}")
        x_BTD = self.tok_embeddings(tokens_BT)
        rope = rope_rotation(self.rope_cos[:T], self.rope_sin[:T], rope_dtype(x_BTD))
        for layer in self.layers:
            x_BTD = layer(x_BTD, *rope)
        return self.norm(x_BTD)

    def num_params(self) -> int:
        """Unique parameters: parameters() yields a tied weight once."""
        return sum(p.numel() for p in self.parameters())
