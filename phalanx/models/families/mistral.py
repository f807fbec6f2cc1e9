"""Mistral (MistralForCausalLM): Llama's decoder with a sliding attention window.

Each query sees at most `sliding_window` keys, itself included (Mistral 7B v0.1: 4096). null means no
window (v0.2 and v0.3, which have Llama's attention exactly). transformers gives an absent key a default
of 4096, so phalanx asks for the key rather than guess.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs
from phalanx.models.families.common import integer

MODEL_TYPE = "mistral"
ARCHITECTURE = "MistralForCausalLM"
LAYER_NAMES: dict[str, str] = {}  # the shared ones only


def unsupported(config: dict) -> list[str]:
    return []


def read_args(config: dict) -> dict:
    # Absent, transformers would take 8 kv heads (its mistral default), not Llama's num_attention_heads.
    if "num_key_value_heads" not in config:
        raise KeyError("num_key_value_heads")
    if "sliding_window" not in config:
        raise KeyError("sliding_window")
    return {"sliding_window": integer(config, "sliding_window", 0) or None}


def inexpressible(args: ModelArgs) -> list[str]:
    found = []
    if args.qkv_bias:
        found.append("q/k/v biases (family qwen2 has them)")
    if args.qk_norm:
        found.append("q/k norms (family qwen3 has them)")
    return found


def write_config(args: ModelArgs) -> dict:
    return {"sliding_window": args.sliding_window}
