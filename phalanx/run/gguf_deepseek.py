"""DeepSeek-V3 (family deepseek_v3) as llama.cpp's `deepseek2` architecture: multi-head latent attention
(models/mla.py) and DeepSeek's mixture of experts (models/moe.py), in the layout of llama.cpp's own
converter (convert_hf_to_gguf.py) since llama.cpp computes MLA with a latent cache, which the deepseek2
graph of llama-cpp-python 0.3.36 reads (tests/export/test_export_gguf_deepseek.py):

- Attention in MLA form: llama.cpp keeps one latent per token (kv_lora_rank dims, plus the shared rotated
  key part) as a single KV head, and absorbs the up-projection of the keys into the queries. So the file
  says head_count_kv 1, key_length kv_lora_rank + qk_rope_head_dim and value_length kv_lora_rank (that
  one cached head's sizes), and key_length_mla / value_length_mla the per-head sizes the model really has
  (qk_nope + qk_rope, v_head_dim), which set the softmax scale. kv_b_proj (phalanx's wkv_b) is written as
  its two halves: attn_k_b, each head's key half transposed to (heads, kv_lora_rank, qk_nope) in torch's
  order, which llama.cpp multiplies q_nope by; and attn_v_b, each head's value half (heads, v_head_dim,
  kv_lora_rank), which maps the attended latent to the head's value.
- RoPE: llama.cpp rotates deepseek2 in the interleaved layout (LLAMA_ROPE_TYPE_NORM): dims 2i and 2i+1
  together, by frequency i. That is DeepSeek's own weight layout (rope_interleave true: mla.py regroups
  the pairs into halves itself), so such weights go as they are. A model trained with rope_interleave
  false rotates dims i and i + R/2 together: its rotated rows (the last qk_rope_head_dim rows of each q
  head, and of kv_a) are moved into pairs, as the llama export does for Llama's q and k.
- Routing: sigmoid scores (expert_gating_func sigmoid), the balancing bias as exp_probs_b.bias (it only
  chooses experts), groups (expert_group_count, expert_group_used_count; a group scored by its two best
  experts' biased scores), the k weights renormalised where norm_topk_prob says (expert_weights_norm) and
  scaled by routed_scaling_factor (expert_weights_scale); the shared experts, one SwiGLU of
  n_shared_experts * expert_ffn_dim, as ffn_*_shexp (expert_shared_count); the first n_dense_layers dense
  (leading_dense_block_count, of feed_forward_length).
- YaRN: rope.scaling.* keys, with llama.cpp's attention scaling made up for in q's rows (_q_rows).

read_deepseek2 reads such a file back into phalanx's model (phalanx's rotary layout and YaRN's mscales
from phalanx.* keys llama.cpp ignores). The export (export/gguf_deepseek.py) refuses what the graph would compute
differently. One difference is let through: llama.cpp normalises the q and kv latents with the model's
one rms epsilon, norm_eps, where phalanx (as transformers) uses 1e-6 whatever norm_eps says. DeepSeek-V3's
own norm_eps is 1e-6 (and so are phalanx's DeepSeek presets); a model with 1e-5 was measured 5.4e-5 from
llama.cpp in its logits (random weights, logits of std ~0.8), with the same greedy tokens: far below what
f16 weights alone change, so such a model is exported rather than refused.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import yarn_attention_factor
from phalanx.run.gguf_format import AUX_LOSS_KEY, gguf_name, halve_rotary_rows, interleave_rotary_rows

DEEPSEEK_ARCH = "deepseek2"
DEEPSEEK_FAMILY = "deepseek_v3"
# What llama.cpp has no key for, written so that read_deepseek2 gives back the very ModelArgs and weights:
# the rotary layout phalanx trained in (the file's is always pairs) and YaRN's two mscales (llama.cpp's
# log multiplier holds only mscale_all_dim, and q's rows are scaled by a factor of both).
ROPE_INTERLEAVE_KEY = "phalanx.rope.interleave"
YARN_MSCALE_KEYS = {
    "yarn_mscale": "phalanx.rope.scaling.yarn_mscale",
    "yarn_mscale_all_dim": "phalanx.rope.scaling.yarn_mscale_all_dim",
}
# phalanx name (after "layers.N.") -> llama.cpp name (after "blk.N."), beyond what gguf_format names.
LAYER_NAMES = {
    "attention.wq.weight": "attn_q.weight",  # q_lora_rank 0: one projection
    "attention.wq_a.weight": "attn_q_a.weight",
    "attention.q_norm.weight": "attn_q_a_norm.weight",
    "attention.wq_b.weight": "attn_q_b.weight",
    "attention.wkv_a.weight": "attn_kv_a_mqa.weight",
    "attention.kv_norm.weight": "attn_kv_a_norm.weight",
    "feed_forward.expert_bias": "exp_probs_b.bias",
    "feed_forward.shared.w1.weight": "ffn_gate_shexp.weight",
    "feed_forward.shared.w3.weight": "ffn_up_shexp.weight",
    "feed_forward.shared.w2.weight": "ffn_down_shexp.weight",
}


def yarn_scaled(args: ModelArgs) -> bool:
    return args.rope_scaling_type == "yarn" and args.rope_scaling_factor != 1


def q_rows(w: torch.Tensor, args: ModelArgs, back: bool = False) -> torch.Tensor:
    """The q projection's rows as llama.cpp computes with them: the rotated rows paired (where phalanx
    keeps them in halves) and, under YaRN, scaled to make up for how llama.cpp scales attention.

    phalanx (as transformers) multiplies its rotation tables by t = rope.yarn_attention_factor (1 where
    mscale equals mscale_all_dim, as in DeepSeek-V3's config), so a rotated q.k product carries t twice,
    and the softmax scale by yarn_softmax_factor. llama.cpp, as measured (test_export_gguf_deepseek.py):
    - with yarn_log_multiplier 0.1 * mscale_all_dim > 0, takes mscale to equal mscale_all_dim: tables
      times 1, softmax scale times (1 + 0.1 * mscale_all_dim * ln factor)^2, phalanx's own. So q's rotated
      rows are multiplied by t^2 (scaling them before the rotation scales them after it alike).
    - with mscale_all_dim 0 (multiplier 0), multiplies its tables by 1 + 0.1 ln factor, which is t then,
      and the softmax scale by t^2 as well, where phalanx's is 1. So every q row is divided by t^2.
    back: the inverse, the file's rows back to phalanx's."""
    nope, rope, heads = args.qk_nope_head_dim, args.qk_rope_head_dim, args.n_heads
    t = yarn_attention_factor(args) if yarn_scaled(args) else 1.0
    scale = t**-2 if not args.yarn_mscale_all_dim else 1.0  # every row's
    rope_scale = t**2 if args.yarn_mscale_all_dim else 1.0  # the rotated rows' besides
    if back:
        scale, rope_scale = 1 / scale, 1 / rope_scale
    if back and not args.rope_interleave:
        w = pair_rotated_rows(w, heads, nope + rope, rope, back=True)
    if rope_scale != 1:
        w = w.reshape(heads, nope + rope, *w.shape[1:]).clone()
        w[:, nope:] *= rope_scale
        w = w.reshape(heads * (nope + rope), *w.shape[2:])
    if scale != 1:
        w = w * scale
    if not back and not args.rope_interleave:
        w = pair_rotated_rows(w, heads, nope + rope, rope)
    return w


def pair_rotated_rows(w: torch.Tensor, blocks: int, block_rows: int, rope: int, back: bool = False) -> torch.Tensor:
    """Each of `blocks` blocks of rows ends in `rope` rotated rows in rotate_half's layout: put them in
    interleaved pairs (back: from pairs into halves), leaving the rows before them as they are."""
    w = w.reshape(blocks, block_rows, *w.shape[1:]).clone()
    rotated = w[:, block_rows - rope :].reshape(blocks * rope, *w.shape[2:])
    reorder = halve_rotary_rows if back else interleave_rotary_rows
    w[:, block_rows - rope :] = reorder(rotated, blocks).reshape(blocks, rope, *w.shape[2:])
    return w.reshape(blocks * block_rows, *w.shape[2:])


def read_deepseek2(file: Path, fields: dict, tensors: dict) -> Transformer:
    """The model (float32, on the CPU) of a deepseek2 GGUF file, phalanx's own export or another with the
    same tensors. fields: its keys' contents; tensors: its GGUFReader tensors by name. A file without
    phalanx's keys is read as DeepSeek's layout (rotary pairs) with mscale equal to mscale_all_dim, as
    llama.cpp reads it."""
    import gguf

    args = _read_args(file, fields, tensors)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        shapes.pop("output.weight")

    def read(gguf_tensor_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = tensors.get(gguf_tensor_name)
        if tensor is None:
            raise PhalanxError(f"{file} has no tensor {gguf_tensor_name}")
        values = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=torch.float32)
        if values.numel() != math.prod(shape):
            raise PhalanxError(f"{file}: {gguf_tensor_name} has shape {tuple(values.shape)}, the model needs {shape}")
        return values.reshape(shape)

    heads, nope, v_dim, rank = args.n_heads, args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
    rope = args.qk_rope_head_dim
    state = {}
    for name, shape in shapes.items():
        rest = name.split(".", 2)[2] if name.startswith("layers.") else None
        prefix = f"blk.{name.split('.')[1]}" if rest else None
        if rest == "attention.wkv_b.weight":
            k_b = read(f"{prefix}.attn_k_b.weight", (heads, rank, nope))
            v_b = read(f"{prefix}.attn_v_b.weight", (heads, v_dim, rank))
            state[name] = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(shape)
            continue
        value = read(f"{prefix}.{LAYER_NAMES[rest]}" if rest in LAYER_NAMES else gguf_name(name), shape)
        if rest in ("attention.wq.weight", "attention.wq_b.weight"):
            value = q_rows(value, args, back=True)
        elif not args.rope_interleave and rest == "attention.wkv_a.weight":
            value = pair_rotated_rows(value, 1, rank + rope, rope, back=True)
        state[name] = value
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # the RoPE tables (buffers, not in the file) and the tied output
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model


def _read_args(file: Path, fields: dict, tensors: dict) -> ModelArgs:
    def need(key: str):
        if f"{DEEPSEEK_ARCH}.{key}" not in fields:
            raise PhalanxError(f"{file} lacks {DEEPSEEK_ARCH}.{key}")
        return fields[f"{DEEPSEEK_ARCH}.{key}"]

    def decimal(value) -> float:  # a float32 field as the decimal it was written from (1e-06, not 9.99e-07)
        return float(str(np.float32(value)))

    rope = int(need("rope.dimension_count"))
    vocab = fields.get(f"{DEEPSEEK_ARCH}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    heads = int(need("attention.head_count"))
    yarn = {}
    if fields.get(f"{DEEPSEEK_ARCH}.rope.scaling.type") == "yarn":
        log_mul = decimal(fields.get(f"{DEEPSEEK_ARCH}.rope.scaling.yarn_log_multiplier", 0.0))
        mscale_all_dim = decimal(np.float32(float(log_mul) * 10))  # llama.cpp's multiplier: 0.1 * mscale_all_dim
        yarn = {
            "rope_scaling_type": "yarn",
            "rope_scaling_factor": decimal(need("rope.scaling.factor")),
            "rope_original_max_seq_len": int(need("rope.scaling.original_context_length")),
            "yarn_beta_fast": decimal(fields.get(f"{DEEPSEEK_ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
            "yarn_beta_slow": decimal(fields.get(f"{DEEPSEEK_ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
            "yarn_mscale": mscale_all_dim,
            "yarn_mscale_all_dim": mscale_all_dim,
        } | {name: decimal(fields[key]) for name, key in YARN_MSCALE_KEYS.items() if key in fields}
    if "token_embd.weight" not in tensors or not vocab:
        raise PhalanxError(f"{file} has no token embedding or vocabulary")
    return ModelArgs(
        dim=int(need("embedding_length")),
        n_layers=int(need("block_count")),
        n_heads=heads,
        n_kv_heads=heads,  # the file's head_count_kv 1 is the latent's; MLA expands it for every head
        ffn_dim=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        max_seq_len=int(need("context_length")),
        rope_theta=decimal(fields.get(f"{DEEPSEEK_ARCH}.rope.freq_base", 10000.0)),
        norm_eps=decimal(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        family=DEEPSEEK_FAMILY,
        attention="mla",
        q_lora_rank=int(fields.get(f"{DEEPSEEK_ARCH}.attention.q_lora_rank", 0)),
        kv_lora_rank=int(need("attention.kv_lora_rank")),
        qk_nope_head_dim=int(need("attention.key_length_mla")) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(need("attention.value_length_mla")),
        rope_interleave=bool(fields.get(ROPE_INTERLEAVE_KEY, True)),
        n_experts=int(need("expert_count")),
        n_experts_per_token=int(need("expert_used_count")),
        expert_ffn_dim=int(need("expert_feed_forward_length")),
        norm_topk_prob=bool(fields.get(f"{DEEPSEEK_ARCH}.expert_weights_norm", False)),
        n_dense_layers=int(need("leading_dense_block_count")),
        router_aux_loss_coef=decimal(fields.get(AUX_LOSS_KEY, 0.0)),
        router_scoring="sigmoid",
        n_expert_groups=int(fields.get(f"{DEEPSEEK_ARCH}.expert_group_count", 1)),
        n_expert_groups_per_token=int(fields.get(f"{DEEPSEEK_ARCH}.expert_group_used_count", 1)),
        routed_scaling_factor=decimal(need("expert_weights_scale")),
        n_shared_experts=int(need("expert_shared_count")),
        **yarn,
    )
