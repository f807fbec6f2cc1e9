"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (models/mla.py) and a mixture of
experts (models/moe.py) with sigmoid routing scores, a balancing bias (`e_score_correction_bias`, used to
choose experts only), group-limited routing (n_group groups, the best topk_group of them), weights scaled by
routed_scaling_factor, and n_shared_experts shared experts beside the routed ones; the first
first_k_dense_replace layers keep a dense feed-forward of intermediate_size. Its long context is YaRN
(rope_type "yarn", factor 40 over 4096 positions in the published model).

Read as transformers 5.25 computes it: scoring_func and topk_method are not read by transformers (it
always scores by sigmoid and chooses with the bias, "noaux_tc"), so a config naming another method (DeepSeek
V2's) is refused rather than run as something else. The published checkpoint's FP8 weights
(quantization_config) are refused as every family's are; a bf16 conversion loads. Its multi-token-prediction
module (num_nextn_predict_layers, stored as layer num_hidden_layers and beyond: `model.layers.61.*`) is
not part of the model transformers or phalanx runs: those tensors are left unread (unused_tensor), and an
export holds none (num_nextn_predict_layers 0).
"""

from __future__ import annotations

import re

from phalanx.models.decoder import ModelArgs
from phalanx.models.families.common import ConfigValueError, integer, number, rope_section, rope_type

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
ATTENTION = "mla"
ROPE_TYPES = ("default", "llama3", "yarn")
# MLA's projections replace the shared q, k and v (common.tensor_names drops those); o_proj stays shared.
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",  # q_lora_rank null: one projection
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
}
MOE_NAMES = {
    "router": "mlp.gate.weight",
    "expert_bias": "mlp.gate.e_score_correction_bias",
    "w1": "mlp.experts.{e}.gate_proj.weight",
    "w2": "mlp.experts.{e}.down_proj.weight",
    "w3": "mlp.experts.{e}.up_proj.weight",
    "shared.w1": "mlp.shared_experts.gate_proj.weight",
    "shared.w2": "mlp.shared_experts.down_proj.weight",
    "shared.w3": "mlp.shared_experts.up_proj.weight",
}
# Absent, transformers would take the 671B model's values for these: a config must say them.
REQUIRED = (
    "num_key_value_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def layer_names(args: ModelArgs) -> dict[str, str]:
    """LAYER_NAMES without the q projections this model lacks (one projection, or the low-rank pair)."""
    unused = ("attention.wq.weight",) if args.q_lora_rank else ("attention.wq_a", "attention.q_norm", "attention.wq_b")
    return {ours: theirs for ours, theirs in LAYER_NAMES.items() if not ours.startswith(unused)}


def unused_tensor(args: ModelArgs, name: str) -> bool:
    """The multi-token-prediction module's tensors: layers numbered n_layers and beyond."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= args.n_layers


def unsupported(config: dict) -> list[str]:
    found = [f"{key}=true" for key in ("attention_bias",) if config.get(key)]
    heads = config.get("num_key_value_heads")
    if heads is not None and heads != config.get("num_attention_heads"):
        found.append(f"num_key_value_heads={heads} (MLA makes keys and values for every head)")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        found.append(f"scoring_func={config['scoring_func']}")
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        found.append(f"topk_method={config['topk_method']}")
    if config.get("moe_layer_freq", 1) != 1:
        found.append(f"moe_layer_freq={config['moe_layer_freq']}")
    if rope_type(config) == "yarn":
        rope = rope_section(config)
        if rope.get("attention_factor") is not None:
            found.append("a yarn attention_factor of its own (phalanx derives it from factor and the mscales)")
        if rope.get("truncate", True) is not True:
            found.append("a yarn rope scaling with truncate=false")
    return found


def read_args(config: dict) -> dict:
    for key in REQUIRED:
        if key not in config:
            raise KeyError(key)
    interleave = config.get("rope_interleave", True)  # transformers' default: DeepSeek's weights pair the dims
    if not isinstance(interleave, bool):
        raise ConfigValueError(f"rope_interleave must be true or false, got {interleave!r}")
    fields = {
        "head_dim": None,  # transformers sets head_dim to the rotated dims; phalanx derives them
        "attention": "mla",
        "q_lora_rank": integer(config, "q_lora_rank", 0),  # null: one q projection
        "kv_lora_rank": integer(config, "kv_lora_rank"),
        "qk_nope_head_dim": integer(config, "qk_nope_head_dim"),
        "qk_rope_head_dim": integer(config, "qk_rope_head_dim"),
        "v_head_dim": integer(config, "v_head_dim"),
        "rope_interleave": interleave,
        "n_experts": integer(config, "n_routed_experts"),
        "n_experts_per_token": integer(config, "num_experts_per_tok"),
        "expert_ffn_dim": integer(config, "moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "n_dense_layers": integer(config, "first_k_dense_replace"),
        "router_scoring": "sigmoid",
        "n_expert_groups": integer(config, "n_group"),
        "n_expert_groups_per_token": integer(config, "topk_group"),
        "routed_scaling_factor": number(config, "routed_scaling_factor"),
        "n_shared_experts": integer(config, "n_shared_experts", 0),
        # transformers' DeepSeek-V3 trains with no balancing loss; phalanx's own exports name theirs.
        "router_aux_loss_coef": number(config, "router_aux_loss_coef", 0.0),
    }
    if rope_type(config) == "yarn":
        rope = rope_section(config)
        original = config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        fields |= {
            "rope_scaling_type": "yarn",
            "rope_scaling_factor": number(rope, "factor"),
            "rope_original_max_seq_len": integer(
                {"original_max_position_embeddings": original or config.get("max_position_embeddings")},
                "original_max_position_embeddings",
            ),
            "yarn_beta_fast": number(rope, "beta_fast", 0.0) or 32.0,  # transformers: `or 32`
            "yarn_beta_slow": number(rope, "beta_slow", 0.0) or 1.0,
            "yarn_mscale": number(rope, "mscale", 0.0),
            "yarn_mscale_all_dim": number(rope, "mscale_all_dim", 0.0),
        }
    return fields


def inexpressible(args: ModelArgs) -> list[str]:
    found = []
    if not args.n_experts:
        found.append("no experts (DeepSeek-V3 has them after its first_k_dense_replace layers)")
    if args.attention != "mla":
        found.append("grouped-query attention (DeepSeek-V3's is multi-head latent attention: model.attention mla)")
    if args.router_scoring != "sigmoid":
        found.append("softmax routing (transformers' DeepSeek-V3 scores experts by sigmoid)")
    return found


def write_config(args: ModelArgs) -> dict:
    return {
        "head_dim": args.qk_rope_head_dim,  # as transformers writes it: the rotated dims
        "attention_bias": False,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "qk_head_dim": args.qk_nope_head_dim + args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.n_experts_per_token,
        "moe_intermediate_size": args.moe_ffn_dim,
        "n_shared_experts": args.n_shared_experts,
        "routed_scaling_factor": args.routed_scaling_factor,
        "n_group": args.n_expert_groups,
        "topk_group": args.n_expert_groups_per_token,
        "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": args.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "num_nextn_predict_layers": 0,  # phalanx trains no multi-token-prediction module
        "output_router_logits": False,
    }
