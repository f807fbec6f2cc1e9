"""Batched prefill: the prompts joining at one step boundary go through the model in one forward pass.

The prompts' tokens are laid end to end as the rows of one (1, total, D) sequence, so every linear layer
(the bulk of the work) runs once over all of them, while attention runs per prompt on its own slice of
the projections, against its own cache row only: a prompt never attends to another's tokens. Each
prompt's bits are those of its prefill alone because
  - the linear layers are row-invariant (row_invariant.py: oneDNN on packed weights): a row's output does
    not depend on how many rows the product has or where it sits; prefill_rows_agree checks that on this
    CPU at start-up for products as tall as a batched prefill makes them, not only decode's 16 rows;
  - RMSNorm, RoPE and the residual adds are per row (the RoPE tables are gathered per token position);
  - each prompt's attention is the very SDPA call its prefill alone makes (shape (1, H, T, E), causal,
    the same strides), on the same bits;
  - only each prompt's last row goes through the final norm and the output layer, whose rows are again
    independent of the number of rows.
The pass is the model's own forward with a TokenPass (PackedPrompts) that places each prompt's tokens
at its own positions and attends per prompt; tests/serve/test_serve_batched_prefill.py proves it
bit-identical to each prompt's prefill alone.

Chunked prefill: a prompt longer than PREFILL_CHUNK_TOKENS is prefilled chunk by chunk (prefill_chunk),
one chunk per step boundary, so the running requests decode between its chunks and shorter prompts join
beside it. Its chunks are cut from its length alone (chunk_plan), never from what else runs, and each
chunk pass holds that one prompt only, so its bits are the same alone and in a busy server.
"""

from __future__ import annotations

import torch

from phalanx.models.decoder import KVCache, Transformer
from phalanx.models.token_pass import Cached, TokenPass, causal_sdpa, check_length, heads_last
from phalanx.serve.engines.prompt_scoring import KeepRows
from phalanx.serve.engines.row_invariant import RowInvariantLinear

# Prompt tokens one step boundary prefills together at most (torch_engine.py's prefill_budget; a longer prompt
# still joins, alone); the rest join at the next boundaries, a decode step between each. On a CPU a
# prefill is compute-bound from a few dozen rows on, so a long pass buys little and costs much: measured
# here (the 88M `125m` shape, fp32, one thread, 55-token prompts) a pass made ~520 tokens/s over one
# prompt, ~630 over two, ~700 over 4, 8 or 16 (and ~500 over 2 x 1024: attention grows with length). One
# pass of 16 prompts would hold every first token back until the last prompt's is ready, and stall the
# running decodes as long; passes of about four such prompts keep nearly the whole gain, hand first
# tokens out a quarter of the way in, and stall decodes for a fraction of a second.
MAX_PREFILL_TOKENS = 256

# A prompt longer than this is prefilled in chunks of this many tokens, one per step boundary (torch_engine.py's
# prefill_chunk). Measured here (the 88M `125m` shape, fp32, one thread, a 1,500-token prompt alone, 3
# alternating rounds on a shared machine; BENCHMARKS.md "Chunked prefill"): in one pass 2.8-3.0 s; in
# chunks of 512 2.8-3.0 s (longest pass 1.0-1.1 s), 256 2.8-3.2 s (0.5-0.6 s), 128 3.0-3.5 s (0.3 s), 64
# 3.5-3.8 s (0.2 s). A pass is compute-bound from a few dozen rows on, so 256 costs about what one pass
# does while a running stream waits one chunk (half a second) rather than the whole prompt; smaller
# chunks shorten that wait but pay 10-25% more in all. 256 is also the boundary's budget for short
# prompts, so a chunk pass is never taller than a batched one.
PREFILL_CHUNK_TOKENS = 256


def prefill_rows_agree(model: Transformer, rows: int = 320) -> bool:
    """Whether every linear shape of a block gives each row the same bits in a product of many rows (a
    batched prefill's) as in shorter ones of other lengths and offsets. Measured on this CPU (torch 2.13):
    fp32 holds at every height tried up to 2048; bf16 does not (rows in the tail block of a tall product
    change), so there the engine prefills one prompt at a time. 320 rows: above MAX_PREFILL_TOKENS, the
    tallest pass of more than one prompt (a longer prompt goes alone, the same product alone or not)."""
    block = model.layers["0"]
    linears = [*block.attention.children(), *block.feed_forward.children()]
    if not all(isinstance(linear, RowInvariantLinear) for linear in linears):
        return False  # a layer of another kind (torch's own, int8 weights): nothing here proves its rows
    generator = torch.Generator().manual_seed(0)
    seen: set = set()
    for linear in linears:
        if linear.weight.shape in seen:
            continue
        seen.add(linear.weight.shape)
        x_1MK = torch.randn(1, rows, linear.in_features, generator=generator).to(linear.weight.dtype)
        full = linear(x_1MK)
        if not all(torch.equal(linear(x_1MK[:, a : a + m]), full[:, a : a + m]) for a, m in _SLICES):
            return False
    return True


_SLICES = ((0, 1), (3, 17), (0, 33), (5, 100), (60, 257))  # (offset, rows): short, odd and tall products


class PackedPrompts(TokenPass):
    """Prompts laid end to end as one (1, total) sequence, each from position 0 into its own cache row
    (prompt i into row rows[i]); each attends to its own tokens only, through the very SDPA call its
    prefill alone makes ((1, H, T, E), causal, the same strides), and only each prompt's last token goes
    on to the head."""

    def __init__(self, lengths: list[int], cache: KVCache, rows: list[int], device):
        self.lengths, self.cache, self.rows = lengths, cache, rows
        self.last = torch.tensor(lengths, device=device).cumsum(0) - 1

    def rope_positions(self, length, max_seq_len, device):
        check_length(max(self.lengths), max_seq_len)
        return torch.cat([torch.arange(n, device=device) for n in self.lengths])

    def attend(self, attention, q_1HTE, k_1KTE, v_1KTE):
        cache_k, cache_v = self.cache.layer(attention.layer_index)
        outs, start = [], 0
        for n, row in zip(self.lengths, self.rows):
            end = start + n
            keys, values = cache_k[row : row + 1], cache_v[row : row + 1]
            keys[:, :, :n] = k_1KTE[:, :, start:end]
            values[:, :, :n] = v_1KTE[:, :, start:end]
            # A server's float32 cache holds a bf16 model's keys exactly (torch_engine.py): cast them back.
            dtype = q_1HTE.dtype
            outs.append(
                causal_sdpa(
                    q_1HTE[:, :, start:end],
                    keys[:, :, :n].to(dtype),
                    values[:, :, :n].to(dtype),
                    attention.sliding_window,
                )
            )
            start = end
        return heads_last(torch.cat(outs, dim=2))

    def head_rows(self, h_1TD):
        return h_1TD[:, self.last]


def prefill_together(
    model: Transformer, prompts: list[list[int]], cache: KVCache, rows: list[int], keep: KeepRows | None = None
) -> torch.Tensor:
    """Prefill prompts[i] into cache row rows[i] from position 0, all in one pass; the logits (n, V) of
    each prompt's last token. keep: hidden rows to keep for scoring prompts (prompt_scoring.py), its
    spans counted along the prompts laid end to end."""
    device = model.tok_embeddings.weight.device
    tokens_1T = torch.tensor([[t for p in prompts for t in p]], dtype=torch.long, device=device)
    packed = PackedPrompts([len(p) for p in prompts], cache, rows, device)
    return model(tokens_1T, packed if keep is None else keep.around(packed))[0]


def chunk_plan(length: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) positions of a prompt's chunks: `size` tokens each from position 0, the last one
    what is left. A function of the prompt's length alone, so the prompt's passes are the same whatever
    else the server runs."""
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def prefill_chunk(
    model: Transformer, chunk: list[int], cache: KVCache, start: int, keep: KeepRows | None = None
) -> torch.Tensor:
    """Prefill one chunk of a prompt, the tokens at positions start.., into `cache` (one row) after the
    prompt's earlier chunks there; the logits (V,) of the chunk's last token (the prompt's next-token
    logits when it is the last chunk). A chunk's queries attend causally over the cached positions before
    it and itself. Only the last row goes through the final norm and the output layer: the other rows'
    logits are never used (keep: the rows a scored prompt keeps, its spans counted within the chunk)."""
    device = model.tok_embeddings.weight.device
    tokens_1T = torch.tensor([chunk], dtype=torch.long, device=device)
    cached = Cached(cache, start, last_only=True)
    return model(tokens_1T, cached if keep is None else keep.around(cached))[0, -1]
