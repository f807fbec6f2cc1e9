"""Mixtral (MixtralForCausalLM): Mistral's decoder with a mixture of experts in every block's place of
the feed-forward (models/moe.py): `num_local_experts` SwiGLU experts of `intermediate_size`, each token
routed to `num_experts_per_tok` of them (8 and 2 in Mixtral 8x7B and 8x22B), the two weights renormalised.
HF files hold each expert's projections as tensors of their own (`experts.3.w1`), phalanx stacks them.

router_jitter_noise (multiplicative noise on the router's input in training) is refused where set.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs
from phalanx.models.families.common import integer, number

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
LAYER_NAMES: dict[str, str] = {}  # the shared ones only; the MoE's are MOE_NAMES
MOE_NAMES = {
    "router": "block_sparse_moe.gate.weight",
    "w1": "block_sparse_moe.experts.{e}.w1.weight",
    "w2": "block_sparse_moe.experts.{e}.w2.weight",
    "w3": "block_sparse_moe.experts.{e}.w3.weight",
}


def unsupported(config: dict) -> list[str]:
    return [f"router_jitter_noise={config['router_jitter_noise']}"] if config.get("router_jitter_noise") else []


def read_args(config: dict) -> dict:
    # Absent, transformers would take its mixtral defaults (8 kv heads, a 4096 window): ask for them.
    for key in ("num_key_value_heads", "num_local_experts", "num_experts_per_tok"):
        if key not in config:
            raise KeyError(key)
    return {
        "sliding_window": integer(config, "sliding_window", 0) or None,
        "n_experts": integer(config, "num_local_experts"),
        "n_experts_per_token": integer(config, "num_experts_per_tok"),
        "router_aux_loss_coef": number(config, "router_aux_loss_coef", 0.001),
    }


def inexpressible(args: ModelArgs) -> list[str]:
    found = []
    if not args.n_experts:
        found.append("no experts (family llama or mistral is dense)")
    if args.qkv_bias or args.qk_norm:
        found.append("q/k/v biases or q/k norms")
    if args.moe_ffn_dim != args.ffn_dim or args.n_dense_layers:
        found.append("dense layers or an expert width other than ffn_dim (family qwen3_moe has them)")
    if not args.norm_topk_prob:
        found.append("routing weights that are not renormalised")
    return found


def write_config(args: ModelArgs) -> dict:
    return {
        "sliding_window": args.sliding_window,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.n_experts_per_token,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }
