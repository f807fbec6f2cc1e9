"""The decoder every family shares, single-device and plain, its forward written once.

The math matches Hugging Face's Llama (RMSNorm in float32, RoPE in the rotate_half layout, grouped-query
attention, SwiGLU), so an exported checkpoint gives the same logits. The families differ from Llama only
where ModelArgs says so (models/families/: Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's
per-head q/k norms and explicit head_dim, the mixtures of experts of models/moe.py, DeepSeek-V3's
multi-head latent attention of models/mla.py). Parallelism (FSDP, tensor and pipeline parallelism,
activation checkpointing, compile) is applied from outside, block by block over `model.layers`; what a
training step, a prefill, a decode step and context parallelism do differently enters the forward as a
TokenPass (models/token_pass.py).

Shape suffixes: B batch, T new tokens, S key length (cache + new), D model dim, H query heads,
K kv heads, N heads of either kind, E head dim, V vocab.
"""

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.models.feed_forward import FeedForward
from phalanx.models.fused_linear import shared_input_linears
from phalanx.models.mla import LatentAttention
from phalanx.models.moe import MoE
from phalanx.models.rms_norm import RMSNorm
from phalanx.models.rope import model_rope_tables, rope_dtype, rope_rotation
from phalanx.models.token_pass import Causal, TokenPass

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")


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
    # The architecture it is exported as (models/families/); the fields below are what the families add.
    family: str = "llama"
    # Per attention head; None: dim / n_heads (Qwen3 sets its own, e.g. 128 with dim 1024 and 16 heads).
    head_dim: int | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before RoPE
    sliding_window: int | None = None  # Mistral: a query sees at most this many keys, itself included
    # Mixture of experts (models/moe.py; Mixtral, Qwen3-MoE): 0 experts is a dense model. Each MoE block
    # routes a token to n_experts_per_token experts of expert_ffn_dim (None: ffn_dim) each; the first
    # n_dense_layers blocks keep the dense feed-forward of ffn_dim.
    n_experts: int = 0
    n_experts_per_token: int = 0
    expert_ffn_dim: int | None = None
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    n_dense_layers: int = 0
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in training
    # DeepSeek-V3's routing (models/moe.py): "sigmoid" scores each expert on its own and chooses by score
    # plus a balancing bias (a buffer that MoE.update_bias moves; the weights use the plain scores);
    # "softmax" is Mixtral's and Qwen3-MoE's. The experts fall into n_expert_groups groups, and a token
    # chooses only within its n_expert_groups_per_token best groups (each scored by its two best experts).
    # The k weights are multiplied by routed_scaling_factor; n_shared_experts experts (one SwiGLU of
    # n_shared_experts * expert_ffn_dim) see every token, added to the routed ones.
    router_scoring: str = "softmax"
    n_expert_groups: int = 1
    n_expert_groups_per_token: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # Attention: "gqa" (grouped-query, every family but one) or "mla", DeepSeek-V3's multi-head latent
    # attention (models/mla.py): q through a rank q_lora_rank bottleneck (0: one projection), keys and
    # values from one kv_lora_rank-wide latent per token, each head's q and k of qk_nope_head_dim dims
    # without position and qk_rope_head_dim rotated (k's rotated part shared by the heads), values of
    # v_head_dim. rope_interleave: the rotated dims come in (even, odd) pairs, as DeepSeek's weights have them.
    attention: str = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # The RoPE scaling rope_scaling_factor applies: "llama3" (the fields above) or "yarn" (DeepSeek-V3's:
    # rope_original_max_seq_len, the two betas bounding the ramp between kept and slowed frequencies, and
    # the two mscales; 0 is a config without that mscale).
    rope_scaling_type: str = "llama3"
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    yarn_mscale_all_dim: float = 0.0

    def __post_init__(self):
        self.validate()

    @property
    def head_size(self) -> int:
        """Each attention head's q and k dimension: head_dim where set, else dim / n_heads; under MLA its
        unrotated and rotated parts together."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def value_size(self) -> int:
        """Each attention head's value dimension: head_size, except under MLA (v_head_dim)."""
        return self.v_head_dim if self.attention == "mla" else self.head_size

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates: all of them, except under MLA (qk_rope_head_dim)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_size

    @property
    def moe_ffn_dim(self) -> int:
        return self.expert_ffn_dim if self.expert_ffn_dim is not None else self.ffn_dim

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.n_experts > 0 and layer_index >= self.n_dense_layers

    def validate(self) -> None:
        self._validate_mla()  # first: under MLA the head sizes checked below come from its fields
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "head_size"):
            if getattr(self, name) <= 0:
                raise PhalanxError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise PhalanxError(f"model rope_theta and norm_eps must be positive: {self.rope_theta}, {self.norm_eps}")
        if self.family not in FAMILIES:
            raise PhalanxError(f"model family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.n_heads % self.n_kv_heads:
            raise PhalanxError(f"model n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim is None and self.attention == "gqa" and self.dim % self.n_heads:
            raise PhalanxError(
                f"model dim {self.dim} is not divisible by n_heads {self.n_heads} (or set model.head_dim)"
            )
        if self.rope_dim % 2:
            rotated = "qk_rope_head_dim" if self.attention == "mla" else "head_dim"
            raise PhalanxError(f"model {rotated} must be even for RoPE, got {self.rope_dim}")
        if self.n_experts and not 0 < self.n_experts_per_token <= self.n_experts:
            raise PhalanxError(
                f"model n_experts_per_token must be between 1 and n_experts ({self.n_experts}), "
                f"got {self.n_experts_per_token}"
            )
        if self.n_experts < 0 or self.n_dense_layers < 0 or self.router_aux_loss_coef < 0 or self.moe_ffn_dim <= 0:
            raise PhalanxError(
                "model n_experts, n_dense_layers, expert_ffn_dim and router_aux_loss_coef cannot be negative"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise PhalanxError(f"model sliding_window must be positive, got {self.sliding_window}")
        if (
            self.rope_scaling_factor < 1
            or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            or self.rope_original_max_seq_len <= 0
        ):
            raise PhalanxError(
                "model RoPE scaling needs rope_scaling_factor >= 1, 0 < rope_low_freq_factor < "
                "rope_high_freq_factor and a positive rope_original_max_seq_len"
            )
        self._validate_yarn()
        self._validate_routing()

    def _validate_yarn(self) -> None:
        if self.rope_scaling_type not in ("llama3", "yarn"):
            raise PhalanxError(f"model rope_scaling_type must be llama3 or yarn, got {self.rope_scaling_type!r}")
        if self.rope_scaling_type == "yarn" and self.attention != "mla":
            raise PhalanxError("model rope_scaling_type yarn is built for attention mla (family deepseek_v3) only")
        if not 0 < self.yarn_beta_slow < self.yarn_beta_fast or self.yarn_mscale < 0 or self.yarn_mscale_all_dim < 0:
            raise PhalanxError("model YaRN needs 0 < yarn_beta_slow < yarn_beta_fast and mscales of at least 0")

    def _validate_routing(self) -> None:
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise PhalanxError(f"model router_scoring must be softmax or sigmoid, got {self.router_scoring!r}")
        if self.n_shared_experts < 0 or self.routed_scaling_factor <= 0:
            raise PhalanxError("model n_shared_experts cannot be negative, and routed_scaling_factor must be positive")
        groups, chosen = self.n_expert_groups, self.n_expert_groups_per_token
        if groups < 1 or not 1 <= chosen <= groups:
            raise PhalanxError(
                f"model n_expert_groups_per_token must be between 1 and n_expert_groups ({groups}), got {chosen}"
            )
        if groups > 1 and (self.n_experts % groups or self.n_experts // groups < 2):
            raise PhalanxError(
                f"model n_experts {self.n_experts} must split into n_expert_groups {groups} of at least 2 "
                "(a group is scored by its two best experts)"
            )
        if groups > 1 and self.n_experts_per_token > chosen * (self.n_experts // groups):
            raise PhalanxError(
                f"model n_experts_per_token {self.n_experts_per_token} exceeds the experts of "
                f"n_expert_groups_per_token {chosen} groups"
            )
        if not self.n_experts and (
            self.router_scoring != "softmax" or groups > 1 or self.n_shared_experts or self.routed_scaling_factor != 1
        ):
            raise PhalanxError(
                "model router_scoring, n_expert_groups, n_shared_experts and routed_scaling_factor need n_experts"
            )

    def _validate_mla(self) -> None:
        mla_fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention not in ("gqa", "mla"):
            raise PhalanxError(f"model attention must be gqa or mla, got {self.attention!r}")
        if self.attention == "gqa":
            if any(getattr(self, name) for name in mla_fields) or self.rope_interleave:
                raise PhalanxError(f"model {', '.join(mla_fields)} and rope_interleave need attention mla")
            return
        if self.q_lora_rank < 0 or any(getattr(self, name) <= 0 for name in mla_fields[1:]):
            raise PhalanxError(
                "model attention mla needs positive kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                "v_head_dim (and q_lora_rank 0 or more)"
            )
        if self.n_kv_heads != self.n_heads or self.head_dim is not None:
            raise PhalanxError(
                "model attention mla makes keys and values for every head from its latent: n_kv_heads must "
                "equal n_heads and head_dim stay unset"
            )
        if self.qkv_bias or self.qk_norm or self.sliding_window is not None:
            raise PhalanxError("model attention mla has no q/k/v biases, q/k norms or sliding window")


class KVCache:
    """Preallocated keys and values for every layer, (B, K, max_len, E) and (B, K, max_len, value_size),
    filled by position. Under MLA it holds each head's expanded keys and values, not the latent DeepSeek
    caches (what the attention computes is the same; the cache is H * (qk + v) wide instead of
    kv_lora_rank + qk_rope_head_dim)."""

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        if max_len > args.max_seq_len:
            raise PhalanxError(f"KV cache of {max_len} tokens exceeds the model's max_seq_len {args.max_seq_len}")
        self.max_len = max_len
        k_shape = (batch_size, args.n_kv_heads, max_len, args.head_size)
        v_shape = (batch_size, args.n_kv_heads, max_len, args.value_size)
        self.k = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(args.n_layers)]
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(args.n_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # which of a KV cache's layers is this one's
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_size
        self.sliding_window = args.sliding_window
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_size, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_size, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_size, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_size, args.dim, bias=False)
        # Qwen3: each head's q and k normalised over its E dims (one weight shared by the heads).
        self.q_norm = RMSNorm(args.head_size, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_size, args.norm_eps) if args.qk_norm else None

    def forward(self, x_BTD, rope, token_pass: TokenPass):
        """rope: the (cos, signed sin) tables from rope_rotation, made once per forward for every layer."""
        B, T, _ = x_BTD.shape
        # -1 heads: under tensor parallelism each rank projects only its share of the heads.
        q_BTX, k_BTX, v_BTX = shared_input_linears(x_BTD, [self.wq, self.wk, self.wv])
        q_BTHE = q_BTX.view(B, T, -1, self.head_dim)
        k_BTKE = k_BTX.view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q_BTHE, k_BTKE = self.q_norm(q_BTHE), self.k_norm(k_BTKE)
        v_BKTE = v_BTX.view(B, T, -1, self.head_dim).transpose(1, 2)
        attended = token_pass.attend_rotating(self, q_BTHE.transpose(1, 2), k_BTKE.transpose(1, 2), v_BKTE, rope)
        return self.wo(attended)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_index) if args.attention == "gqa" else LatentAttention(args, layer_index)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = (
            MoE(
                args.dim,
                args.moe_ffn_dim,
                args.n_experts,
                args.n_experts_per_token,
                args.norm_topk_prob,
                args.router_aux_loss_coef,
                scoring=args.router_scoring,
                n_groups=args.n_expert_groups,
                n_groups_per_token=args.n_expert_groups_per_token,
                routed_scaling_factor=args.routed_scaling_factor,
                n_shared_experts=args.n_shared_experts,
            )
            if args.is_moe_layer(layer_index)
            else FeedForward(args.dim, args.ffn_dim)
        )

    def forward(self, x_BTD, rope, token_pass: TokenPass):
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), rope, token_pass)
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
    if kind in ("ones", "zeros"):
        tensor.fill_(value)
    else:
        tensor.normal_(0.0, value, generator=parameter_generator(seed, name, tensor.device))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed by index in the whole model, so a pipeline stage holding some of them (part()) keeps the
        # whole model's parameter names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: they are derived from args, so checkpoints stay free of them, and init_weights
        # rebuilds them after a meta-device build is materialised with to_empty.
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        self.init_weights()

    def init_rules(self) -> dict[str, tuple[str, float]]:
        """How each parameter starts, by name: ("normal", std), ("ones", 1.0) or ("zeros", 0.0). The one table for a
        single-device model and a sharded one (parallel/materialize.py), so both start from the same
        weights."""
        std = 0.02
        # GPT-2: each block adds two outputs to the residual stream, so shrink them to keep its variance flat.
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        rules = {}
        for name, _ in self.named_parameters():  # a tied output weight is listed once, as the embedding
            if name.endswith("norm.weight"):
                rules[name] = ("ones", 1.0)
            elif name.endswith(".bias"):
                rules[name] = ("zeros", 0.0)
            elif name.endswith(
                ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w2", "feed_forward.shared.w2.weight")
            ):
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
        """Fill the buffers of a model just built or materialised (to_empty leaves them garbage): the RoPE
        tables, and the MoE layers' routing biases, which start at zero. What parallel/materialize.py
        calls after to_empty, before any checkpoint is loaded over the biases."""
        self.init_rope_tables()
        for layer in self.layers.values():
            bias = getattr(layer.feed_forward, "expert_bias", None)
            if bias is not None and not bias.is_meta:
                bias.zero_()

    @torch.no_grad()
    def init_rope_tables(self) -> None:
        """The RoPE tables alone, from args (a model whose biases are loaded already keeps them)."""
        cos, sin = model_rope_tables(self.args, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor, token_pass: TokenPass | None = None, *, head: bool = True) -> torch.Tensor:
        """Logits (B, T, V) in the compute dtype (the caller takes .float() for the loss), for the rows
        token_pass.head_rows keeps. x: tokens (B, T), or hidden states (B, T, D) where this is a pipeline
        stage without the embedding. A stage without the output head returns its hidden states; head=False
        stops after the final norm (what embeddings pool). token_pass: where the tokens sit and what they
        attend to (models/token_pass.py); default whole sequences from position 0, no cache."""
        token_pass = Causal() if token_pass is None else token_pass
        positions = token_pass.rope_positions(x.shape[1], self.args.max_seq_len, x.device)
        h_BTD = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        rope = rope_rotation(self.rope_cos[positions], self.rope_sin[positions], rope_dtype(h_BTD))
        for layer in self.layers.values():
            h_BTD = token_pass.run_layer(layer, h_BTD, rope)
        if self.norm is None:
            return h_BTD
        h_BTD = self.norm(token_pass.head_rows(h_BTD))
        return self.output(h_BTD) if head else h_BTD

    def hidden_states(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, D) for whole sequences from position 0, without a cache: what
        the output projection would read, and what embeddings pool (serve/core/embeddings.py). Causal, so a
        row's right padding changes none of its earlier positions."""
        return self.forward(tokens_BT, head=False)

    def part(self, layer_keys, first: bool, last: bool) -> "Transformer":
        """A pipeline stage's share of this model (parallel/pipeline.py): the same forward, sharing these
        modules, with the layers not in `layer_keys` left out, and the embedding (unless `first`) and the
        final norm and output head (unless `last`) set to None. Its RoPE tables are its own."""
        part = Transformer.__new__(Transformer)
        nn.Module.__init__(part)
        part.args = self.args
        part.tok_embeddings = self.tok_embeddings if first else None
        part.layers = nn.ModuleDict({str(k): self.layers[str(k)] for k in layer_keys})
        part.norm = self.norm if last else None
        part.output = self.output if last else None
        part.register_buffer("rope_cos", torch.empty_like(self.rope_cos), persistent=False)
        part.register_buffer("rope_sin", torch.empty_like(self.rope_sin), persistent=False)
        return part

    def num_params(self) -> int:
        """Unique parameters: parameters() yields a tied weight once."""
        return sum(p.numel() for p in self.parameters())
