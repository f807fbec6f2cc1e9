"""Parameter and FLOP counts, peak device throughput, and MFU (model FLOPs utilisation)."""

from phalanx.models.decoder import ModelArgs


def count_params(args: ModelArgs, active: bool = False) -> int:
    """Exact parameter count of Transformer(args), a tied output weight counted once. active: only what
    one token's forward uses, in an MoE its n_experts_per_token experts (and the router, and any shared
    experts) of n_experts. DeepSeek-V3's routing bias is a buffer, not a parameter: not counted."""
    d, q_dim, kv_dim = args.dim, args.n_heads * args.head_size, args.n_kv_heads * args.head_size
    if args.attention == "mla":
        attention = _latent_attention_params(args)
    else:
        attention = 2 * d * q_dim + 2 * d * kv_dim  # wq, wo; wk, wv (q_dim is d unless head_dim is set)
        attention += (q_dim + 2 * kv_dim) * args.qkv_bias  # Qwen2's q, k and v biases
        attention += 2 * args.head_size * args.qk_norm  # Qwen3's q and k norms, one weight each for all heads
    dense_ffn = 3 * d * args.ffn_dim  # w1, w2, w3
    experts = args.n_experts_per_token if active else args.n_experts
    experts += args.n_shared_experts  # every token passes through the shared ones
    moe_ffn = d * args.n_experts + experts * 3 * d * args.moe_ffn_dim  # the router, and the experts
    n_moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    blocks = args.n_layers * (attention + 2 * d) + (args.n_layers - n_moe) * dense_ffn + n_moe * moe_ffn
    embedding = args.vocab_size * d
    output = 0 if args.tie_embeddings else args.vocab_size * d
    return embedding + blocks + d + output  # d: the final norm


def _latent_attention_params(args: ModelArgs) -> int:
    """Multi-head latent attention's projections and its two latent norms (models/mla.py)."""
    d, h = args.dim, args.n_heads
    if args.q_lora_rank:  # wq_a, q_norm, wq_b
        q = d * args.q_lora_rank + args.q_lora_rank + args.q_lora_rank * h * args.head_size
    else:
        q = d * h * args.head_size
    kv = d * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank  # wkv_a, kv_norm
    kv += args.kv_lora_rank * h * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_b
    return q + kv + h * args.v_head_dim * d  # and wo


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token: 6 * N + 12 * n_layers * n_heads * head_dim * seq_len.

    This is PaLM's count (appendix B), also torchtitan's. N is the parameters that take part in matrix
    multiplies: all of them except the input embedding table, which is a lookup, but including the output
    projection even when it is tied to that table, since the logits are a real matmul. The second term is
    attention's QK^T and AV products, counted over the full (not causally halved) seq_len x seq_len square
    by convention, and without any recomputation from activation checkpointing. With a sliding window
    (Mistral) a query has at most `sliding_window` keys, so the square narrows to that band. In a mixture
    of experts N is the active parameters: a token passes through its top-k experts (and the shared ones)
    only. Under multi-head latent attention (DeepSeek-V3) N holds its down and up projections, and the
    attention term is 6 * n_layers * n_heads * (qk head dim + v head dim) * seq_len, QK^T over the q/k heads'
    dims and AV over the value heads' (the same 12 L H Q T where the two are equal).
    """
    embedding = args.vocab_size * args.dim
    n_matmul = count_params(args, active=True) - embedding + (embedding if args.tie_embeddings else 0)
    keys = seq_len if args.sliding_window is None else min(seq_len, args.sliding_window)
    return 6 * n_matmul + 6 * args.n_layers * args.n_heads * (args.head_size + args.value_size) * keys


# Dense (no 2:4 sparsity) bf16 matrix peak, TFLOP/s per device as torch sees it. Keys are lower-case
# substrings of torch.cuda.get_device_name(); the longest matching key wins, so "h100 pcie" beats "h100".
PEAK_BF16_TFLOPS: dict[str, float] = {
    # AMD: the datasheet figure equals CUs x peak engine clock x bf16 FLOPs/clock/CU.
    "mi355x": 2516.6,  # AMD Instinct MI355X datasheet (256 CU x 2.4 GHz x 4096)
    "mi350x": 2306.9,  # MI350X: 256 CU x 2.2 GHz x 4096 (datasheet rounds to 2.3 PFLOPs)
    "mi325x": 1307.4,  # AMD Instinct MI325X datasheet
    "mi300x": 1307.4,  # AMD Instinct MI300X datasheet (304 CU x 2.1 GHz x 2048)
    "mi300a": 980.6,  # AMD Instinct MI300A datasheet (228 CU x 2.1 GHz x 2048)
    # MI250X/MI250 are two GCDs per package and torch lists each GCD as a device, so halve the package
    # figure. ROCm reports both parts as "AMD Instinct MI250X/MI250"; that name takes the MI250X value.
    "mi250x": 191.5,  # AMD Instinct MI250X datasheet: 383.0 per package
    "mi250": 181.05,  # AMD Instinct MI250 datasheet: 362.1 per package
    "mi210": 181.0,  # AMD Instinct MI210 datasheet
    # NVIDIA: datasheets quote bf16 "with sparsity"; dense is half of that.
    "a100": 312.0,  # NVIDIA A100 datasheet (SXM4 and PCIe alike)
    "h100": 989.4,  # NVIDIA H100 datasheet, SXM5 (torch: "NVIDIA H100 80GB HBM3")
    "h100 pcie": 756.0,  # NVIDIA H100 datasheet, PCIe
    "h100 nvl": 835.5,  # NVIDIA H100 NVL datasheet (1671 sparse)
    "h200": 989.4,  # NVIDIA H200 datasheet, SXM
    "h200 nvl": 835.5,  # NVIDIA H200 datasheet, NVL
    "gh200": 989.4,  # NVIDIA GH200 Grace Hopper datasheet
    "b200": 2250.0,  # NVIDIA HGX B200 datasheet (36 PFLOPs sparse per 8 GPUs)
    "gb200": 2500.0,  # NVIDIA GB200 NVL72 datasheet (360 PFLOPs sparse per 72 GPUs)
    "l40s": 362.05,  # NVIDIA L40S datasheet (733 sparse)
    "l40": 181.05,  # NVIDIA L40 datasheet (362.1 sparse)
}


def device_key(device_name: str, keys) -> str | None:
    """The most specific of `keys` (lower-case substrings) found in a torch device name, or None."""
    name = device_name.lower()
    return next((key for key in sorted(keys, key=len, reverse=True) if key in name), None)


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of one device from its torch name, or None when unknown (e.g. "cpu")."""
    key = device_key(device_name, PEAK_BF16_TFLOPS)
    return PEAK_BF16_TFLOPS[key] if key else None


def achieved_tflops(tokens_per_sec: float, flops_per_token: float) -> float:
    return tokens_per_sec * flops_per_token / 1e12


def mfu(tokens_per_sec: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.4 means 40%): the FLOP rate of `tokens_per_sec` over
    `peak_tflops`, for the same devices (callers pass one device's tokens/s and its dense bf16 peak)."""
    if not peak_tflops:
        return None
    return achieved_tflops(tokens_per_sec, flops_per_token) / peak_tflops
