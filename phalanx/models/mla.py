"""Multi-head latent attention (MLA), DeepSeek-V2's and V3's attention, as transformers' DeepseekV3Attention
computes it.

Keys and values come from one narrow latent per token: x goes down to kv_lora_rank dims (plus
qk_rope_head_dim dims of a key part that RoPE rotates, one for all heads), is normalised, and goes back up
to each head's key part without position (qk_nope_head_dim) and its value (v_head_dim). A query goes down
to q_lora_rank dims and back up (or, with q_lora_rank 0, through one projection) into the same two parts
per head. Each head's key is its own unrotated part beside the shared rotated one, so the attention itself
is ordinary multi-head attention with q/k heads of qk_nope + qk_rope dims and value heads of v_head_dim.

It runs through the TokenPass's attend like every attention layer (training, prefill, decode, packing),
with two things fitted to that path rather than the path changed:
- the softmax scale. attend scales by 1 / sqrt(q's head dim), which is MLA's own (qk_nope + qk_rope). YaRN
  (DeepSeek-V3's long context) multiplies it by mscale(mscale_all_dim) squared; that factor is folded into
  q, so no TokenPass needs a scale argument.
- value heads narrower than the q/k heads: SDPA takes a value head dim of its own, and attend's output is
  (B, T, H * v_head_dim), what the output projection reads.
The keys and values a cache holds are the expanded per-head ones (decoder.py's KVCache), not the latent.

Layout of the rotated dims: DeepSeek's weights produce them in (even, odd) pairs (rope_interleave, on in
transformers' DeepSeek-V3 config by default), which are regrouped into halves here so that rope.py's
rotate_half layout rotates each pair by its frequency, bit for bit what transformers computes. The result
sits in the halves layout for q and k alike, so their dot products are the pairs' own.

Shape suffixes as in decoder.py, and L the latent (kv_lora_rank), R the rotated dims, C the unrotated
ones, F the value dims, Q q's bottleneck (q_lora_rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from phalanx.models.rms_norm import RMSNorm
from phalanx.models.rope import rotate, yarn_softmax_factor
from phalanx.models.token_pass import TokenPass

if TYPE_CHECKING:
    from phalanx.models.decoder import ModelArgs

# transformers builds MLA's two latent norms with DeepseekV3RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # which of a KV cache's layers is this one's
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_heads  # each head its own keys and values
        self.sliding_window = None
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank, self.rope_interleave = args.kv_lora_rank, args.rope_interleave
        self.q_low_rank = args.q_lora_rank > 0
        qk_dim = self.nope_dim + self.rope_dim
        if self.q_low_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.q_scale = yarn_softmax_factor(args)

    def forward(self, x_BTD, rope, token_pass: TokenPass):
        """rope: the (cos, signed sin) tables of the rotated dims, made once per forward for every layer."""
        B, T, _ = x_BTD.shape
        q_BTX = self.wq_b(self.q_norm(self.wq_a(x_BTD))) if self.q_low_rank else self.wq(x_BTD)
        q_BHTE = q_BTX.view(B, T, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope_BHTC, q_rope_BHTR = q_BHTE.split([self.nope_dim, self.rope_dim], dim=-1)

        latent_BTL, k_rope_BTR = self.wkv_a(x_BTD).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope_BTR = _shared_by_the_heads(k_rope_BTR)
        kv_BHTX = self.wkv_b(self.kv_norm(latent_BTL)).view(B, T, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHTC, v_BHTF = kv_BHTX.split([self.nope_dim, self.v_dim], dim=-1)
        H = k_nope_BHTC.shape[1]

        q_rope_BHTR = rotate(self._halves(q_rope_BHTR), *rope)
        k_rope_B1TR = rotate(self._halves(k_rope_BTR.unsqueeze(1)), *rope)
        q_BHTE = torch.cat((q_nope_BHTC, q_rope_BHTR), dim=-1)
        k_BHTE = torch.cat((k_nope_BHTC, k_rope_B1TR.expand(-1, H, -1, -1)), dim=-1)
        if self.q_scale != 1:
            q_BHTE = q_BHTE * self.q_scale
        return self.wo(token_pass.attend(self, q_BHTE, k_BHTE, v_BHTF))

    def _halves(self, x_BNTR: torch.Tensor) -> torch.Tensor:
        """The rotated dims in rotate_half's layout: DeepSeek's (even, odd) pairs regrouped as all evens,
        then all odds, where the weights lay them out in pairs."""
        if not self.rope_interleave:
            return x_BNTR
        return torch.cat((x_BNTR[..., 0::2], x_BNTR[..., 1::2]), dim=-1)


def _shared_by_the_heads(k_rope_BTR: torch.Tensor) -> torch.Tensor:
    """The rotated key part every head shares. Under tensor parallelism (parallel/tensor_parallel.py) it is
    a DTensor computed whole on every rank, whose gradient each rank sees only for its own heads: a local
    tensor then, with that gradient marked partial so that the ranks' parts are summed."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(k_rope_BTR, DTensor):
        return k_rope_BTR
    return k_rope_BTR.to_local(grad_placements=[Partial()])
