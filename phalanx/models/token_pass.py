"""Where one forward pass's tokens sit and how its attention layers reach keys and values.

The decoder's forward (models/decoder.py) is written once; what a training step, a prompt's prefill, a
batched decode step, a batched prefill of several prompts (serve/engines/prefill.py) and context
parallelism (parallel/context_parallel.py) do differently is only this: the positions RoPE rotates the
tokens to, what each layer's queries attend to (and where new keys and values are kept), and which rows
go on to the output head (and a server's decode step may run whole blocks natively: `run_layer`). Each of
them is a TokenPass, handed to the forward as an argument.

Shape suffixes: B batch, T new tokens, S keys, H query heads, K kv heads, G query heads per kv head,
E head dim, X heads x head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from phalanx.errors import PhalanxError
from phalanx.models import cpu_attention
from phalanx.models.rope import rotate


def visible(q_pos_T: torch.Tensor, k_pos_S: torch.Tensor, window: int | None) -> torch.Tensor:
    """(T, S) True where the query at q_pos may see the key at k_pos: not after it, and with a sliding
    window (Mistral), fewer than `window` positions before it (HF's rule: k > q - window)."""
    seen = k_pos_S[None, :] <= q_pos_T[:, None]
    if window is not None:
        seen = seen & (k_pos_S[None, :] > q_pos_T[:, None] - window)
    return seen


def causal_sdpa(q_BHTE, k_BKTE, v_BKTE, window: int | None) -> torch.Tensor:
    """SDPA of T queries over S keys at positions 0..S-1, the queries being the last T of them (a prefill
    from position 0: S == T; a chunk or a step after cached tokens: S > T). Grouped-query heads share kv
    heads without copies (enable_gqa, in HF's repeat_kv order: bit-identical output). A sliding window
    (Mistral) adds its lower edge. Returns (B, H, T, E)."""
    T, S = q_BHTE.shape[2], k_BKTE.shape[2]
    if window is None or S <= window:
        if T == 1:  # one new query sees every key
            return F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, enable_gqa=True)
        if S == T:
            return F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, is_causal=True, enable_gqa=True)
    # SDPA's is_causal aligns the triangle top-left, wrong when keys outnumber queries: spell it out.
    device = q_BHTE.device
    mask_TS = visible(torch.arange(S - T, S, device=device), torch.arange(S, device=device), window)
    return F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, attn_mask=mask_TS, enable_gqa=True)


def heads_last(out_BHTE: torch.Tensor) -> torch.Tensor:
    """(B, H, T, E) -> (B, T, H * E), what the output projection reads."""
    B, _, T, _ = out_BHTE.shape
    return out_BHTE.transpose(1, 2).reshape(B, T, -1)


class TokenPass:
    """One forward pass's tokens. The default is Causal: whole sequences from position 0, no cache."""

    def rope_positions(self, length: int, max_seq_len: int, device) -> torch.Tensor | slice:
        """What to index the RoPE tables (max_seq_len, E) by: a slice, or positions. `length`: the
        sequence length of the forward's input."""
        raise NotImplementedError

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE) -> torch.Tensor:
        """The attention layer's output before its output projection, (B, T, H * E). `attention` is the
        layer (its `layer_index`, head counts and `sliding_window`)."""
        raise NotImplementedError

    def attend_rotating(self, attention, q_BHTE, k_BKTE, v_BKTE, rope) -> torch.Tensor:
        """`attend` of q and k rotated by RoPE's tables (rope_rotation's cos and signed sin): rotated here
        by default; a training pass may rotate them inside its attention kernel instead."""
        return self.attend(attention, rotate(q_BHTE, *rope), rotate(k_BKTE, *rope), v_BKTE)

    def head_rows(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """The rows that go through the final norm and the output head: all of them by default."""
        return h_BTD

    def run_layer(self, layer, h_BTD: torch.Tensor, rope) -> torch.Tensor:
        """One transformer block over the pass's tokens: its own forward by default. A server may run a
        decode step's block some faster way here (serve/engines/decode_block.py)."""
        return layer(h_BTD, rope, self)


def check_length(end: int, max_seq_len: int) -> None:
    if end > max_seq_len:
        raise PhalanxError(f"sequence of {end} tokens exceeds the model's max_seq_len {max_seq_len}")


class Causal(TokenPass):
    """Whole sequences from position 0, no KV cache: training, evaluation, embeddings. `length`: the
    whole sequence's length where the input holds part of it (a pipeline stage's sequence-parallel
    shard of the hidden states)."""

    def __init__(self, length: int | None = None):
        self.length = length

    def rope_positions(self, length, max_seq_len, device):
        length = self.length or length
        check_length(length, max_seq_len)
        return slice(0, length)

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        if cpu_attention.applies(q_BHTE, k_BKTE, v_BKTE, attention.sliding_window):
            return heads_last(cpu_attention.causal_attention(q_BHTE, k_BKTE, v_BKTE))
        return heads_last(causal_sdpa(q_BHTE, k_BKTE, v_BKTE, attention.sliding_window))

    def attend_rotating(self, attention, q_BHTE, k_BKTE, v_BKTE, rope):
        window = attention.sliding_window
        if cpu_attention.applies(q_BHTE, k_BKTE, v_BKTE, window) and cpu_attention.rotates(q_BHTE, rope):
            return heads_last(cpu_attention.causal_attention(q_BHTE, k_BKTE, v_BKTE, rope))
        return super().attend_rotating(attention, q_BHTE, k_BKTE, v_BKTE, rope)


class Cached(TokenPass):
    """New tokens at positions start.. of every row of a KV cache (`cache.layer(i)` gives layer i's
    (keys, values), each (B, K, max_len, E)): a prompt's prefill, or a chunk of one after its earlier
    chunks. `last_only`: only the last token goes through the head (its logits are all a prefill uses)."""

    def __init__(self, cache, start: int = 0, last_only: bool = False):
        self.cache, self.start, self.last_only = cache, start, last_only

    def rope_positions(self, length, max_seq_len, device):
        end = self.start + length
        check_length(end, max_seq_len)
        if end > self.cache.max_len:
            raise PhalanxError(f"sequence of {end} tokens exceeds the KV cache length {self.cache.max_len}")
        return slice(self.start, end)

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        B, T = q_BHTE.shape[0], q_BHTE.shape[2]
        cache_k, cache_v = self.cache.layer(attention.layer_index)
        end = self.start + T
        cache_k[:B, :, self.start : end] = k_BKTE
        cache_v[:B, :, self.start : end] = v_BKTE
        # A cache may hold a bf16 model's keys in float32 (a server's on CPU, serve/engines/torch_engine.py): cast back, exactly.
        keys, values = cache_k[:B, :, :end].to(q_BHTE.dtype), cache_v[:B, :, :end].to(q_BHTE.dtype)
        return heads_last(causal_sdpa(q_BHTE, keys, values, attention.sliding_window))

    def head_rows(self, h_BTD):
        return h_BTD[:, -1:] if self.last_only else h_BTD


def decode_attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What batched decoding (DecodeRows) attends in, and so what a server keeps its KV cache in:
    float32 on CPU (a bf16 model's cached values cast exactly), the model's dtype elsewhere. torch's
    batched matmuls at decode shapes (torch 2.13, one thread, 12 heads x 64, 128 keys, per layer) took
    144 us in bf16, 73 us casting a bf16 cache and 43 us on a float32 cache at one row; 1.95, 1.52 and
    0.70 ms at 16 rows."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class DecodeRows(TokenPass):
    """Batched decoding (a server's continuous batching): one new token per row, row b's at its own
    position positions_B[b] of a cache `cache.max_len` positions long, attending to its cached keys up
    to there. The caller keeps each position below the cache length."""

    def __init__(self, cache, positions_B: torch.Tensor):
        self.cache, self.positions_B = cache, positions_B
        self._hidden: dict[int | None, torch.Tensor] = {}  # per window: the (B, 1, 1, S) mask, made once

    def rope_positions(self, length, max_seq_len, device):
        if length != 1:
            raise PhalanxError("per-row positions decode one token per row into a KV cache")
        return self.positions_B[:, None, None]  # (B, 1, 1): each row's own angles, broadcast over heads

    def hidden_B11S(self, window: int | None) -> torch.Tensor:
        if window not in self._hidden:
            B, span = self.positions_B.shape[0], self.cache.max_len
            seen_BS = visible(self.positions_B, torch.arange(span, device=self.positions_B.device), window)
            self._hidden[window] = (~seen_BS).view(B, 1, 1, span)
        return self._hidden[window]

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        """Spelt out rather than SDPA: on CPU, SDPA shares rows out between threads so that a row's last
        bits change with its batch index, and a served request must get the same tokens whoever its
        neighbours are. Returns (B, 1, H * E)."""
        cache_k, cache_v = self.cache.layer(attention.layer_index)
        B = q_BHTE.shape[0]
        H, K, E = q_BHTE.shape[1], k_BKTE.shape[1], q_BHTE.shape[3]
        rows_B = torch.arange(B, device=q_BHTE.device)
        cache_k[rows_B, :, self.positions_B] = k_BKTE[:, :, 0].to(cache_k.dtype)
        cache_v[rows_B, :, self.positions_B] = v_BKTE[:, :, 0].to(cache_v.dtype)
        # Query head h reads kv head h // group (HF's repeat_kv order), without copying the cache.
        compute = decode_attention_dtype(q_BHTE.device, q_BHTE.dtype)
        q_BKGE = q_BHTE.reshape(B, K, H // K, E).to(compute)
        out_BKGF = self.attend_cached(attention, q_BKGE, cache_k[:B].to(compute), cache_v[:B].to(compute))
        return out_BKGF.to(q_BHTE.dtype).reshape(B, 1, -1)

    def attend_cached(self, attention, q_BKGE, k_BKSE, v_BKSF) -> torch.Tensor:
        """Each query row over its row's cached keys and values, in the compute dtype: (B, K, G, F), F the
        value head dim (MLA's may differ from E). A server may put a faster kernel here (it must keep each
        row's bits its own)."""
        scores_BKGS = (q_BKGE @ k_BKSE.transpose(-1, -2)) * (1.0 / math.sqrt(q_BKGE.shape[-1]))
        scores_BKGS = scores_BKGS.masked_fill(self.hidden_B11S(attention.sliding_window), float("-inf"))
        probs_BKGS = torch.softmax(scores_BKGS.float(), dim=-1).to(q_BKGE.dtype)
        return probs_BKGS @ v_BKSF


class Packed(TokenPass):
    """Several examples laid end to end in each row (supervised fine-tuning's packing,
    data/sft_batches.py): positions_BT restart at 0 where an example starts, and a token attends only to
    the tokens before it in its own example. The mask is spelt out for SDPA (B, 1, T, T), which every
    backend runs; a packed row so computes what each example alone computes, up to SDPA's summation order."""

    def __init__(self, positions_BT: torch.Tensor):
        self.positions_BT = positions_BT
        # Example k of a row is the k-th run of positions from 0: equal ids share an example.
        example_BT = (positions_BT == 0).cumsum(dim=1)
        self._same_BTT = example_BT[:, :, None] == example_BT[:, None, :]
        self._masks: dict[int | None, torch.Tensor] = {}  # per window, made once per pass

    def rope_positions(self, length, max_seq_len, device):
        check_length(int(self.positions_BT.max()) + 1, max_seq_len)
        return self.positions_BT[:, None, :]  # (B, 1, T): each row's own angles, broadcast over heads

    def mask_B1TT(self, window: int | None) -> torch.Tensor:
        if window not in self._masks:
            q_BT1, k_B1T = self.positions_BT[:, :, None], self.positions_BT[:, None, :]
            seen = self._same_BTT & (k_B1T <= q_BT1)
            if window is not None:
                seen = seen & (k_B1T > q_BT1 - window)
            self._masks[window] = seen[:, None]
        return self._masks[window]

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        mask = self.mask_B1TT(attention.sliding_window)
        return heads_last(F.scaled_dot_product_attention(q_BHTE, k_BKTE, v_BKTE, attn_mask=mask, enable_gqa=True))
