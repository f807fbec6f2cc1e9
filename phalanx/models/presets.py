"""Named model shapes. The Llama ones match Meta's published configs (1b, 8b and 70b without the RoPE
scaling of their Llama 3.1/3.2 versions, at 8K context; 405b is Llama 3.1's, scaling and 128K included).
The versioned names (llama3.2-1b, mistral-7b, qwen3-8b, ...) are the published models' configs exactly,
family, context and RoPE scaling included, so a pretrained checkpoint of that name loads into them."""

import dataclasses
import difflib

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.preset_names import PRESET_NAMES


def _llama3(dim: int, n_layers: int, n_heads: int, ffn_dim: int, scaling: float, tie: bool) -> ModelArgs:
    """Llama 3.1 / 3.2: 8 kv heads, Llama 3's vocabulary, and RoPE scaled from 8K to 128K tokens."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=tie,
        rope_scaling_factor=scaling,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
    )


def _qwen3(dim: int, n_layers: int, n_heads: int, ffn_dim: int, tie: bool) -> ModelArgs:
    """Qwen3: per-head q/k norms and a head_dim of 128 in every size (written None where dim / n_heads is
    128 already: that is how a config read back says it, models/families/common.py)."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tie_embeddings=tie,
        family="qwen3",
        head_dim=None if dim == 128 * n_heads else 128,
        qk_norm=True,
    )


# Small enough to train a few hundred steps on two CPU cores.
_TINY = ModelArgs(
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    ffn_dim=768,
    vocab_size=4096,
    max_seq_len=256,
    rope_theta=10000.0,
    tie_embeddings=True,
)

MODEL_PRESETS: dict[str, ModelArgs] = {
    "tiny": _TINY,
    # GPT-2 small's size; vocab 50304 is GPT-2's 50257 rounded up to a multiple of 128 for fast matmuls.
    "125m": ModelArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        vocab_size=50304,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_embeddings=True,
    ),
    # Llama 3.2 1B.
    "1b": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),
    # Llama 3 8B.
    "8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Llama 3 70B.
    "70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
    ),
    # Llama 3.1 405B, with its RoPE scaling for 128K tokens of context.
    "405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=False,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_seq_len=8192,
    ),
    "llama3.2-1b": _llama3(2048, 16, 32, 8192, scaling=32.0, tie=True),
    "llama3.2-3b": _llama3(3072, 28, 24, 8192, scaling=32.0, tie=True),
    "llama3.1-8b": _llama3(4096, 32, 32, 14336, scaling=8.0, tie=False),
    "llama3.1-70b": _llama3(8192, 80, 64, 28672, scaling=8.0, tie=False),
    # Mistral 7B v0.3: v0.1's shape without its sliding window, a 32768-token vocabulary and RoPE theta 1e6.
    "mistral-7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32768,
        max_seq_len=32768,
        rope_theta=1000000.0,
        family="mistral",
    ),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tie=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tie=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tie=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, tie=False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, tie=False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, tie=False),
    # Mixtures of experts (models/moe.py). tiny-moe: tiny's attention with 8 experts of 384, 2 per token
    # (about tiny's active size), for tests and CPU runs.
    "tiny-moe": dataclasses.replace(
        _TINY, ffn_dim=384, family="mixtral", n_experts=8, n_experts_per_token=2, router_aux_loss_coef=0.01
    ),
    "mixtral-8x7b": ModelArgs(  # Mixtral 8x7B v0.1
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1000000.0,
        family="mixtral",
        n_experts=8,
        n_experts_per_token=2,
        router_aux_loss_coef=0.02,
    ),
    "qwen3-30b-a3b": dataclasses.replace(  # Qwen3-30B-A3B: 128 experts of 768, 8 per token
        _qwen3(2048, 48, 32, 6144, tie=False),
        n_kv_heads=4,
        family="qwen3_moe",
        n_experts=128,
        n_experts_per_token=8,
        expert_ffn_dim=768,
        router_aux_loss_coef=0.001,
    ),
    # DeepSeek-V3 (models/mla.py, models/moe.py). deepseek-v3-tiny: tiny's width with its attention and
    # routing: one dense layer, then 8 routed experts of 192 in 2 groups (a token's 2 from its best group)
    # and one shared expert; a small balancing loss, as tiny-moe's, beside the routing bias that the
    # trainer moves (train.moe_bias_rate).
    "deepseek-v3-tiny": dataclasses.replace(
        _TINY,
        n_kv_heads=8,
        norm_eps=1e-6,
        family="deepseek_v3",
        attention="mla",
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_interleave=True,
        n_experts=8,
        n_experts_per_token=2,
        expert_ffn_dim=192,
        n_dense_layers=1,
        router_scoring="sigmoid",
        n_expert_groups=2,
        n_expert_groups_per_token=1,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        router_aux_loss_coef=0.01,
    ),
    "deepseek-v3-671b": ModelArgs(  # DeepSeek-V3 (and V3.1, R1): its config.json, without the MTP module
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        vocab_size=129280,
        max_seq_len=163840,
        rope_theta=10000.0,
        norm_eps=1e-6,
        family="deepseek_v3",
        attention="mla",
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_interleave=True,
        n_experts=256,
        n_experts_per_token=8,
        expert_ffn_dim=2048,
        n_dense_layers=3,
        router_scoring="sigmoid",
        n_expert_groups=8,
        n_expert_groups_per_token=4,
        routed_scaling_factor=2.5,
        n_shared_experts=1,
        rope_scaling_type="yarn",
        rope_scaling_factor=40.0,
        rope_original_max_seq_len=4096,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
    ),
}

assert tuple(MODEL_PRESETS) == PRESET_NAMES, "preset_names.py lists the presets' names"


def get_preset(name: str) -> ModelArgs:
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    valid = ", ".join(MODEL_PRESETS)
    close = difflib.get_close_matches(name.lower(), MODEL_PRESETS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise PhalanxError(f"unknown model preset '{name}': {hint}valid presets are {valid}")
