"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama's decoder with biases on the q, k and v projections.

transformers builds those biases whatever the config says (there is no key for them), and none on o.
Qwen2's optional sliding window covers only some layers (those from max_window_layers on); phalanx's
model has one window for all, so a config that turns it on (use_sliding_window) is refused.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs

MODEL_TYPE = "qwen2"
ARCHITECTURE = "Qwen2ForCausalLM"
LAYER_NAMES = {f"attention.w{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}


def unsupported(config: dict) -> list[str]:
    return full_attention_only(config)


def full_attention_only(config: dict) -> list[str]:
    """Qwen2's and Qwen3's per-layer sliding window, which phalanx's model cannot run."""
    found = ["use_sliding_window=true"] if config.get("use_sliding_window") else []
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        found.append(f"layer_types {sorted(layer_types - {'full_attention'})}")
    return found


def read_args(config: dict) -> dict:
    # Absent, transformers would take 32 kv heads (its qwen2 default), not Llama's num_attention_heads.
    if "num_key_value_heads" not in config:
        raise KeyError("num_key_value_heads")
    return {"qkv_bias": True}


def inexpressible(args: ModelArgs) -> list[str]:
    found = [] if args.qkv_bias else ["no q/k/v biases (Qwen2 always has them; family llama has none)"]
    if args.qk_norm:
        found.append("q/k norms (family qwen3 has them)")
    if args.sliding_window is not None:
        found.append("one sliding window for every layer (family mistral has one)")
    return found


def write_config(args: ModelArgs) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}
