"""Qwen3 (Qwen3ForCausalLM): Llama's decoder with an RMSNorm over each head of q and of k, before RoPE,
and a head_dim of its own (128 in every size, whatever hidden_size / num_attention_heads is).

Its q/k biases (attention_bias, also on o) are off in the published models and refused here; its
optional per-layer sliding window is refused as Qwen2's is.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs
from phalanx.models.families.qwen2 import full_attention_only

MODEL_TYPE = "qwen3"
ARCHITECTURE = "Qwen3ForCausalLM"
LAYER_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}


def unsupported(config: dict) -> list[str]:
    return (["attention_bias=true"] if config.get("attention_bias") else []) + full_attention_only(config)


def read_args(config: dict) -> dict:
    # Absent, transformers would take 32 kv heads (its qwen3 default), not Llama's num_attention_heads.
    if "num_key_value_heads" not in config:
        raise KeyError("num_key_value_heads")
    # transformers' default head_dim for Qwen3 is 128, not hidden_size / num_attention_heads: ask for it.
    if config.get("head_dim") is None:
        raise KeyError("head_dim")
    return {"qk_norm": True}


def inexpressible(args: ModelArgs) -> list[str]:
    found = [] if args.qk_norm else ["no q/k norms (Qwen3 always has them; family llama has none)"]
    if args.qkv_bias:
        found.append("q/k/v biases without one on o (family qwen2 has them)")
    if args.sliding_window is not None:
        found.append("one sliding window for every layer (family mistral has one)")
    return found


def write_config(args: ModelArgs) -> dict:
    return {
        "head_dim": args.head_size,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
    }
