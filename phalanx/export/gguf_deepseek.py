"""DeepSeek-V3 (family deepseek_v3) written as llama.cpp's `deepseek2` architecture: its keys and its
tensors, in the layout run/gguf_deepseek.py describes (and reads back), and the refusal of what llama.cpp's
graph would compute otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.run.gguf_deepseek import (
    DEEPSEEK_ARCH,
    LAYER_NAMES,
    ROPE_INTERLEAVE_KEY,
    YARN_MSCALE_KEYS,
    pair_rotated_rows,
    q_rows,
    yarn_scaled,
)
from phalanx.run.gguf_format import gguf_name


def check_deepseek2_computes(args: ModelArgs) -> None:
    """Refuse, in one line, a DeepSeek-V3 model that llama.cpp's deepseek2 graph would compute otherwise.
    Measured with llama-cpp-python 0.3.36 (tests/export/test_export_gguf_deepseek.py)."""
    # What DeepSeek-V3 is not (its HF export refuses these too): written as deepseek2 they are untested.
    unbuilt = [
        what
        for what, present in (
            ("grouped-query attention", args.attention != "mla"),
            ("no experts", not args.n_experts),
            ("softmax routing", args.router_scoring != "sigmoid"),
        )
        if present
    ]
    if unbuilt:
        raise PhalanxError(
            f"GGUF export of family {args.family} with {' and '.join(unbuilt)} is not built: "
            f"the {DEEPSEEK_ARCH} export writes DeepSeek-V3's MLA and sigmoid routing"
        )
    # llama.cpp's deepseek2 reads no rope_freqs (only llama does), so Llama 3.1's scaling would be lost.
    if args.rope_scaling_factor != 1 and args.rope_scaling_type != "yarn":
        raise PhalanxError(
            f"GGUF export: llama.cpp's {DEEPSEEK_ARCH} architecture (family {args.family}) cannot run a model "
            "with Llama 3.1 RoPE scaling (it reads rope_freqs for the llama architecture only; YaRN is exported)"
        )


def add_deepseek2_keys(writer, args: ModelArgs) -> None:
    """The architecture's hyperparameters (GGUFWriter prefixes each with `deepseek2.`)."""
    import gguf

    writer.add_feed_forward_length(args.ffn_dim)  # the dense first layers'
    writer.add_leading_dense_block_count(args.n_dense_layers)
    writer.add_expert_count(args.n_experts)
    writer.add_expert_used_count(args.n_experts_per_token)
    writer.add_expert_feed_forward_length(args.moe_ffn_dim)
    writer.add_expert_shared_count(args.n_shared_experts)
    writer.add_expert_weights_scale(args.routed_scaling_factor)
    writer.add_expert_weights_norm(args.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(args.n_expert_groups)
    writer.add_expert_group_used_count(args.n_expert_groups_per_token)

    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(1)  # the latent: one KV head for all of them (see the module docstring)
    # Written even where it is 0 (one q projection, attn_q): this llama.cpp requires the key unless the
    # model has 27 layers (DeepSeek-V2-Lite's count), and loads attn_q in place of the pair where it is 0.
    writer.add_q_lora_rank(args.q_lora_rank)
    writer.add_kv_lora_rank(args.kv_lora_rank)
    writer.add_key_length(args.kv_lora_rank + args.qk_rope_head_dim)
    writer.add_value_length(args.kv_lora_rank)
    writer.add_key_length_mla(args.qk_nope_head_dim + args.qk_rope_head_dim)
    writer.add_value_length_mla(args.v_head_dim)
    writer.add_rope_dimension_count(args.qk_rope_head_dim)
    writer.add_bool(ROPE_INTERLEAVE_KEY, args.rope_interleave)
    if yarn_scaled(args):
        for name, key in YARN_MSCALE_KEYS.items():
            writer.add_float32(key, getattr(args, name))
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(args.rope_scaling_factor)
        writer.add_rope_scaling_orig_ctx_len(args.rope_original_max_seq_len)
        writer.add_rope_scaling_yarn_beta_fast(args.yarn_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(args.yarn_beta_slow)
        # What llama.cpp multiplies the softmax scale by is (1 + log_mul * ln factor)^2: with log_mul 0.1 *
        # mscale_all_dim, mla.py's yarn_softmax_factor. (It also takes mscale to equal mscale_all_dim and
        # so scales its rotation tables by 1; deepseek2_tensors makes up for the factor phalanx's have.)
        writer.add_rope_scaling_yarn_log_mul(0.1 * args.yarn_mscale_all_dim)


def deepseek2_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under llama.cpp's deepseek2 names, float32, one at a time; the output left out
    when tied (llama.cpp then reads token_embd)."""
    args = model.args
    nope, rope, v_dim, heads = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim, args.n_heads
    for name, tensor in model.state_dict().items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        tensor = tensor.detach().to("cpu", torch.float32)
        rest = name.split(".", 2)[2] if name.startswith("layers.") else None
        if rest == "attention.wkv_b.weight":  # (heads * (nope + v), kv_lora_rank)
            prefix = f"blk.{name.split('.')[1]}"
            k_b, v_b = tensor.view(heads, nope + v_dim, args.kv_lora_rank).split([nope, v_dim], dim=1)
            yield f"{prefix}.attn_k_b.weight", k_b.transpose(1, 2).contiguous()
            yield f"{prefix}.attn_v_b.weight", v_b.contiguous()
            continue
        if rest in ("attention.wq.weight", "attention.wq_b.weight"):
            tensor = q_rows(tensor, args)
        elif not args.rope_interleave and rest == "attention.wkv_a.weight":
            tensor = pair_rotated_rows(tensor, 1, args.kv_lora_rank + rope, rope)
        if rest in LAYER_NAMES:
            yield f"blk.{name.split('.')[1]}.{LAYER_NAMES[rest]}", tensor.contiguous()
        else:
            yield gguf_name(name), tensor.contiguous()
