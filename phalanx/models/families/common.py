"""What all the families' Hugging Face configs and weights share: Llama's decoder.

Mistral, Qwen2 and Qwen3 are Llama's decoder with a few additions (see each family's module), and
transformers spells their configs with Llama's keys and names their tensors with Llama's names. This
module reads and writes that shared part; a family module adds only what it changes.
"""

from __future__ import annotations

import torch

from phalanx.models.decoder import ModelArgs
from phalanx.models.moe import EXPERT_WEIGHTS

CONFIG_FILE = "config.json"

# phalanx parameter name inside `layers.N.` -> HF name inside `model.layers.N.`
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The RoPE types phalanx computes: plain, and Llama 3.1's frequency scaling. transformers applies the same
# rope_type the same way in every family, so all four accept both.
ROPE_TYPES = ("default", "llama3")
GQA_PROJECTIONS = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigValueError(ValueError):
    """A config value of the wrong type; the families' entry point turns it into one PhalanxError line."""


def tensor_names(
    args: ModelArgs, family_layer_names: dict[str, str], moe_names: dict[str, str] | None = None
) -> dict[str, str]:
    """phalanx name -> HF name for every tensor an HF file of this model holds: the shared ones and the
    family's own per layer; the output projection is left out when tied (HF re-ties it on load). In an MoE
    layer (models/moe.py) the feed-forward's names are the family's `moe_names`: its router, and each
    expert's projections, which HF files hold one tensor per expert and phalanx stacks: those phalanx
    names carry the expert's index, `layers.0.feed_forward.w1[3]` (expert_slice reads them); DeepSeek-V3's
    also name the routing bias and the shared experts. Under multi-head latent attention the family's names
    take the place of the shared q, k and v projections."""
    shared = LAYER_NAMES
    if args.attention == "mla":  # its own projections (the family's names) replace q, k and v
        shared = {k: v for k, v in LAYER_NAMES.items() if k not in GQA_PROJECTIONS}
    layer_names = {**shared, **family_layer_names}
    dense_ffn = {k for k in layer_names if k.startswith("feed_forward.")}
    names = {"tok_embeddings.weight": TOP_NAMES["tok_embeddings.weight"]}
    for i in range(args.n_layers):
        moe = args.is_moe_layer(i)
        names |= {
            f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}"
            for ours, theirs in layer_names.items()
            if not (moe and ours in dense_ffn)
        }
        if moe:
            names[f"layers.{i}.feed_forward.router.weight"] = f"model.layers.{i}.{moe_names['router']}"
            for e in range(args.n_experts):
                for w in EXPERT_WEIGHTS:
                    names[f"layers.{i}.feed_forward.{w}[{e}]"] = f"model.layers.{i}.{moe_names[w].format(e=e)}"
            if args.router_scoring == "sigmoid":  # the balancing bias (a buffer, saved with the weights)
                names[f"layers.{i}.feed_forward.expert_bias"] = f"model.layers.{i}.{moe_names['expert_bias']}"
            for w in EXPERT_WEIGHTS if args.n_shared_experts else ():
                names[f"layers.{i}.feed_forward.shared.{w}.weight"] = f"model.layers.{i}.{moe_names['shared.' + w]}"
    names["norm.weight"] = TOP_NAMES["norm.weight"]
    if not args.tie_embeddings:
        names["output.weight"] = TOP_NAMES["output.weight"]
    return names


def expert_slice(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The tensor a tensor_names key names in a state dict: the tensor itself, or for `w1[3]` the view of
    expert 3's slice of the stacked w1 (writing into the view writes the parameter)."""
    base, bracket, index = name.partition("[")
    return state[base][int(index[:-1])] if bracket else state[name]


def state_name(name: str) -> str:
    """The state-dict name a tensor_names key lives under: `layers.0.feed_forward.w1[3]` -> its w1."""
    return name.partition("[")[0]


def integer(config: dict, key: str, default: int | None = None) -> int:
    """config[key] as an int (a KeyError where it is absent without a default; null counts as absent)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigValueError(f"{key} must be an integer, got {value!r}")
    return value


def number(config: dict, key: str, default: float | None = None) -> float:
    value = config.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def rope_section(config: dict) -> dict:
    """The RoPE settings: transformers 5 writes `rope_parameters` (with rope_theta inside), older
    versions `rope_scaling` beside a top-level rope_theta; either may be null."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigValueError(f"rope_parameters must be an object, got {rope!r}")
    return rope


def rope_type(config: dict) -> str:
    rope = rope_section(config)
    return rope.get("rope_type", rope.get("type", "default"))


def unsupported(config: dict, rope_types: tuple[str, ...] = ROPE_TYPES) -> list[str]:
    """The shared features phalanx's decoder cannot compute, as `key=value` strings (none: empty).
    rope_types: the RoPE types the family runs (DeepSeek-V3 adds yarn)."""
    found = []
    if config.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act={config['hidden_act']}")
    kind = rope_type(config)
    if kind not in rope_types:
        found.append(f"rope_type={kind}")
    elif kind == "llama3" and any(rope_section(config).get(k) is None for k in LLAMA3_ROPE_KEYS):
        found.append(f"a llama3 rope scaling without all of {', '.join(LLAMA3_ROPE_KEYS)}")
    for where in (config, rope_section(config)):
        if where.get("partial_rotary_factor", 1) != 1:
            found.append(f"partial_rotary_factor={where['partial_rotary_factor']}")
    if config.get("quantization_config"):
        found.append("quantization_config (quantised weights; phalanx reads float weights)")
    return found


def read_args(config: dict) -> dict:
    """The shared ModelArgs fields. Absent optional keys take transformers' defaults for these families;
    head_dim equal to hidden_size / num_attention_heads becomes None (the decoder's default), so a model
    exported and read back compares equal."""
    dim, n_heads = integer(config, "hidden_size"), integer(config, "num_attention_heads")
    head_dim = integer(config, "head_dim", 0) or None
    if head_dim is not None and dim % n_heads == 0 and head_dim == dim // n_heads:
        head_dim = None
    rope = rope_section(config)
    fields = dict(
        dim=dim,
        n_layers=integer(config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=integer(config, "num_key_value_heads", n_heads),  # null: one per query head, as in HF
        ffn_dim=integer(config, "intermediate_size"),
        vocab_size=integer(config, "vocab_size"),
        max_seq_len=integer(config, "max_position_embeddings"),
        rope_theta=number(rope, "rope_theta", number(config, "rope_theta", 10000.0)),
        norm_eps=number(config, "rms_norm_eps", 1e-6),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=head_dim,
    )
    if rope_type(config) == "llama3":
        fields |= dict(
            rope_scaling_factor=number(rope, "factor"),
            rope_low_freq_factor=number(rope, "low_freq_factor"),
            rope_high_freq_factor=number(rope, "high_freq_factor"),
            rope_original_max_seq_len=integer(rope, "original_max_position_embeddings"),
        )
    return fields


def rope_scaling(args: ModelArgs) -> dict | None:
    """Llama 3.1's RoPE scaling or YaRN as HF configs spell them (rope_type "llama3" or "yarn"), or None."""
    if args.rope_scaling_factor == 1:
        return None
    if args.rope_scaling_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": args.rope_scaling_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
            "beta_fast": args.yarn_beta_fast,
            "beta_slow": args.yarn_beta_slow,
            "mscale": args.yarn_mscale,
            "mscale_all_dim": args.yarn_mscale_all_dim,
        }
    return {
        "rope_type": "llama3",
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def deepseek_routing(args: ModelArgs) -> bool:
    """Whether the model routes as DeepSeek-V3 does, which only family deepseek_v3 can write."""
    return (
        args.router_scoring != "softmax"
        or args.n_expert_groups > 1
        or args.n_shared_experts > 0
        or args.routed_scaling_factor != 1
    )


def write_config(
    args: ModelArgs, model_type: str, architecture: str, bos_id: int, eos_id: int, dtype: torch.dtype
) -> dict:
    """The shared config.json keys; a family adds its own."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_size,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # Older transformers read rope_theta and rope_scaling at the top level, newer ones rope_parameters.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **(rope_scaling(args) or {"rope_type": "default"})},
        "rope_scaling": rope_scaling(args),
        "tie_word_embeddings": args.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # transformers 5 reads `dtype`, older versions `torch_dtype`.
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
