"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's decoder (q/k norms, its own head_dim) with a mixture of
experts in the blocks (models/moe.py): `num_experts` SwiGLU experts of `moe_intermediate_size`, each
token routed to `num_experts_per_tok` (128 and 8 in Qwen3-30B-A3B), renormalised where norm_topk_prob.

Layers listed in mlp_only_layers keep a dense feed-forward of intermediate_size; phalanx computes them
where they are the first layers (n_dense_layers), and every other layer sparse (decoder_sparse_step 1),
as in the published models; other placements are refused.
"""

from __future__ import annotations

from phalanx.models.decoder import ModelArgs
from phalanx.models.families import qwen3
from phalanx.models.families.common import ConfigValueError, integer, number

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"
LAYER_NAMES = qwen3.LAYER_NAMES
MOE_NAMES = {
    "router": "mlp.gate.weight",
    "w1": "mlp.experts.{e}.gate_proj.weight",
    "w2": "mlp.experts.{e}.down_proj.weight",
    "w3": "mlp.experts.{e}.up_proj.weight",
}


def _dense_layers(config: dict) -> list:
    layers = config.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ConfigValueError(f"mlp_only_layers must be a list of layer indices, got {layers!r}")
    return layers


def unsupported(config: dict) -> list[str]:
    found = qwen3.unsupported(config)
    if config.get("decoder_sparse_step", 1) != 1:
        found.append(f"decoder_sparse_step={config['decoder_sparse_step']}")
    layers = _dense_layers(config)
    if layers != list(range(len(layers))):
        found.append(f"mlp_only_layers={layers} (dense layers other than the first ones)")
    return found


def read_args(config: dict) -> dict:
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        raise KeyError("num_experts")
    if "num_experts_per_tok" not in config:
        raise KeyError("num_experts_per_tok")
    return {
        **qwen3.read_args(config),
        "n_experts": integer({"num_experts": experts}, "num_experts"),
        "n_experts_per_token": integer(config, "num_experts_per_tok"),
        "expert_ffn_dim": integer(config, "moe_intermediate_size"),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "n_dense_layers": len(_dense_layers(config)),
        "router_aux_loss_coef": number(config, "router_aux_loss_coef", 0.001),
    }


def inexpressible(args: ModelArgs) -> list[str]:
    found = [] if args.n_experts else ["no experts (family qwen3 is dense)"]
    return found + qwen3.inexpressible(args)


def write_config(args: ModelArgs) -> dict:
    return {
        **qwen3.write_config(args),
        "num_experts": args.n_experts,
        "num_experts_per_tok": args.n_experts_per_token,
        "moe_intermediate_size": args.moe_ffn_dim,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.n_dense_layers)),
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "output_router_logits": False,
    }
