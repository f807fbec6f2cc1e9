"""Llama 2 and 3 (LlamaForCausalLM): phalanx's decoder as it is.

What later versions add is shared with the other families and read in common.py: Llama 3.1's RoPE
scaling (rope_type "llama3", e.g. factor 8 for 128K tokens of context) and Llama 3.2's tied embeddings
(no lm_head.weight in the file). Llama's config can also ask for biases, which phalanx's model lacks.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
LAYER_NAMES: dict[str, str] = {}  # the shared ones only


def unsupported(config: dict) -> list[str]:
    # attention_bias puts a bias on q, k, v and o; mlp_bias on the three MLP projections.
    return [f"{key}=true" for key in ("attention_bias", "mlp_bias") if config.get(key)]


def read_args(config: dict) -> dict:
    return {}


def inexpressible(args: ModelArgs) -> list[str]:
    found = []
    if args.qkv_bias:
        found.append("q/k/v biases (family qwen2 has them)")
    if args.qk_norm:
        found.append("q/k norms (family qwen3 has them)")
    if args.sliding_window is not None:
        found.append("a sliding window (family mistral has one)")
    return found


def write_config(args: ModelArgs) -> dict:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
