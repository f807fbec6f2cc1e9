"""The kinds of block a model has, and what one block of each kind holds and saves for backward.

A dense model has one kind. A mixture of experts (models/moe.py) has two: its first n_dense_layers
blocks keep the dense SwiGLU, the rest route each token to k of E stacked experts (with a router and
any shared experts). Multi-head latent attention (models/mla.py) replaces grouped-query attention's
projections in every block. The step walk (memory.py) asks each layer's kind for its sizes.

Shapes are one tensor-parallel rank's, as the model registers them. An MoE block is not split by TP
(parallel/tensor_parallel.py): every TP rank holds the router, the experts and the shared experts
whole. The experts are kept apart from the rest of the block's parameters ("experts"), because under
expert parallelism (parallel/expert_parallel.py) they are a group of their own: each rank's 1/ep of
them, which FSDP shards over the ranks holding the same ones.

Shape letters as in memory.py, and P = N * k routed rows (N tokens through the layer, k experts each),
E experts, Fe one expert's ffn dim, Fs the shared experts' (n_shared_experts * Fe).
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.models.decoder import ModelArgs

FP32, BF16, INT64, INT32 = 4, 2, 8, 4


@dataclass(frozen=True)
class BlockKind:
    name: str  # "block" (a dense model's only kind), "dense" or "moe"
    shapes: list[tuple[int, ...]]  # FSDP's group: everything but the experts
    experts: list[tuple[int, ...]]  # the stacked experts, whole (all E); [] for a dense block
    moe: bool


def attention_shapes(args: ModelArgs, tp: int = 1) -> list[tuple[int, ...]]:
    """One block's attention parameters, its two norms included."""
    d = args.dim
    if args.attention == "mla":  # never split by TP (parallel/tensor_parallel.py refuses it)
        h, e = args.n_heads, args.head_size
        if args.q_lora_rank:
            q = [(args.q_lora_rank, d), (args.q_lora_rank,), (h * e, args.q_lora_rank)]  # wq_a, q_norm, wq_b
        else:
            q = [(h * e, d)]
        kv = [
            (args.kv_lora_rank + args.qk_rope_head_dim, d),  # wkv_a
            (args.kv_lora_rank,),  # kv_norm
            (h * (args.qk_nope_head_dim + args.v_head_dim), args.kv_lora_rank),  # wkv_b
        ]
        return q + kv + [(d, h * args.v_head_dim), (d,), (d,)]  # wo, and the block's two norms
    kv, hd = args.n_kv_heads * args.head_size // tp, args.n_heads * args.head_size // tp
    shapes = [(hd, d), (kv, d), (kv, d), (d, hd), (d,), (d,)]
    if args.qkv_bias:  # Qwen2: split with their projections
        shapes += [(hd,), (kv,), (kv,)]
    if args.qk_norm:  # Qwen3: one head's norm each, whole on every rank
        shapes += [(args.head_size,), (args.head_size,)]
    return shapes


def block_kinds(args: ModelArgs, tp: int = 1) -> list[BlockKind]:
    """The model's layers in order, each as its kind (equal kinds are the same object)."""
    d, f = args.dim, args.ffn_dim // tp
    attention = attention_shapes(args, tp)
    dense = BlockKind("block" if not args.n_experts else "dense", attention + [(f, d), (f, d), (d, f)], [], False)
    if not args.n_experts:
        return [dense] * args.n_layers
    e, fe, fs = args.n_experts, args.moe_ffn_dim, args.n_shared_experts * args.moe_ffn_dim
    shared = [(fs, d), (fs, d), (d, fs)] if fs else []
    moe = BlockKind("moe", attention + [(e, d)] + shared, [(e, fe, d), (e, fe, d), (e, d, fe)], True)
    return [moe if args.is_moe_layer(i) else dense for i in range(args.n_layers)]


def moe_saved(args: ModelArgs, tokens: int, act: int, residual: int, regime: str, ep: int) -> int:
    """Bytes an MoE feed-forward (models/moe.py: MoE.forward) keeps for backward for `tokens` tokens:
    whole ones under TP, which gathers the sequence into the layer. Read off its ops and checked with
    saved-tensor hooks (tests/plan/test_plan_moe.py):
    - its input, the ffn norm's output, kept by the router and the shared experts; autocast casts it
      for each of them (bf16 N x D, twice with shared experts);
    - routing: softmax/sigmoid scores (float32 N x E), top-k's indices (int64 N x k), the k weights and
      their sum (float32, where renormalised), the load-balancing loss's shares (E) and value (and,
      for sigmoid scores, their sum per token); expert groups keep nothing (the choice's graph ends
      in top-k's indices, so autograd frees it at once);
    - the rows gathered for the experts: their indices (int64 P), the rows (P x D) the grouped GEMMs
      read with the experts' ends (int32 E), their four SwiGLU tensors (P x Fe each: gate out, silu
      out, up out, product), the experts' outputs (P x D) and weights (P), kept by the weighting's
      product, the sort order (int64 P), and the weighted rows index_add_ sums (P x D, in the
      residual stream's dtype); under expert parallelism the rows a rank receives (on average P: every rank sends as
      many as it routes) with their two reorderings (int64 P each);
    - shared experts: the dense SwiGLU's four N x Fs tensors (their input shared with the router's)."""
    n, d, k, e = tokens, args.dim, args.n_experts_per_token, args.n_experts
    p, fe, fs = n * k, args.moe_ffn_dim, args.n_shared_experts * args.moe_ffn_dim
    inputs = BF16 * n * d * (1 + bool(fs)) if regime == "autocast" else act * n * d
    routing = FP32 * n * e + INT64 * n * k + FP32 * e + FP32
    if args.norm_topk_prob or args.router_scoring == "sigmoid" or args.n_expert_groups > 1:
        routing += FP32 * (n * k + n)  # the k weights and their sum, for the renormalisation
    if args.router_scoring == "sigmoid":  # the scores' sum per token, normalising them for the balancing loss
        routing += FP32 * n
    rows = act * p * d + INT32 * e + 4 * act * p * fe + act * p * d + act * p + 2 * INT64 * p + residual * p * d
    if ep > 1:
        rows += 2 * INT64 * p  # the received rows' regrouping and its inverse
    shared = 4 * act * n * fs
    return inputs + routing + rows + shared


def moe_backward_temporaries(args: ModelArgs, tokens: int, act: int) -> int:
    """The most an MoE layer's backward holds at once beyond what it saved: the gradients of the
    experts' outputs and inputs (P x D each) and of the SwiGLU's three tensors (P x Fe each), as the
    dense block's backward holds its own."""
    p = tokens * args.n_experts_per_token
    return act * (2 * p * args.dim + 3 * p * args.moe_ffn_dim)


def mla_saved(args: ModelArgs, tokens: int, batch: int, seq: int, act: int, regime: str, norm_saved, cpu: bool) -> int:
    """Bytes multi-head latent attention (models/mla.py) keeps for backward: its input (the attention
    norm's output, which autocast casts for each of its two down projections), q's bottleneck and its
    norm, the kv latent and its norm, the up projections' inputs, then what SDPA keeps. norm_saved
    (elements): what an RMSNorm keeps.

    SDPA: value heads narrower than the q/k heads rule out the flash kernel. On CPU torch takes the math
    path (measured: tests/plan/test_plan_moe.py), which keeps float32 q, k, the B x H x T x T attention
    weights and a contiguous v, and the output reshaped for wo. On GPUs the plan assumes a kernel that
    takes such heads without storing the scores (memory-efficient or cuDNN attention): q, k, v (a view of
    the expanded k/v projection, whose storage it keeps), the output and a float32 logsumexp."""
    n, h, e, fv = tokens, args.n_heads, args.head_size, args.v_head_dim
    q_rank, kv_rank = args.q_lora_rank, args.kv_lora_rank
    inputs = BF16 * 2 * n * args.dim if regime == "autocast" else act * n * args.dim
    q = norm_saved(n * q_rank) + act * n * q_rank + FP32 * n if q_rank else 0  # q_norm's, wq_b's input
    kv = norm_saved(n * kv_rank) + act * n * kv_rank + FP32 * n  # kv_norm's tensors, wkv_b's input
    if cpu:
        sdpa = FP32 * (2 * n * h * e + batch * h * seq * seq + n * h * fv) + act * n * h * fv
    else:
        expanded = n * h * (args.qk_nope_head_dim + fv)
        sdpa = act * (2 * n * h * e + expanded + n * h * fv) + FP32 * batch * h * seq
    return inputs + q + kv + sdpa
