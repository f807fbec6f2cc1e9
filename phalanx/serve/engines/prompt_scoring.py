"""Scoring a prompt during its prefill: the log-probability of each prompt token given the ones before it.

A prefill already computes every prompt position's hidden state; only its last row normally goes on to
the final norm and the output head (the next token's logits). A scored prompt keeps the rows before
that too (KeepRows wraps whatever TokenPass the prefill uses and notes them as they pass the head), and
they go through the norm and the head in a product of their own, one per prompt: the pass's own rows,
and so every other prompt's logits in a batched prefill, are exactly what they are without scoring,
and a prompt's scores do not depend on what it was prefilled beside.

Row i of a prompt piece that starts at position `start` predicts the token at position start + i + 1,
so a prompt of n tokens has n - 1 scored positions (the first token has nothing before it).
"""

from __future__ import annotations

import torch

from phalanx.models.decoder import Transformer
from phalanx.models.token_pass import TokenPass


class KeepRows(TokenPass):
    """A prefill's own pass (`around(inner)`), unchanged, that also keeps the hidden rows spans[i] =
    (first, end) of its sequence (batch row 0) as they reach the head: `kept[i]`, (end - first, D)."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = spans
        self.inner: TokenPass | None = None
        self.kept: list[torch.Tensor] = []

    def around(self, inner: TokenPass) -> KeepRows:
        self.inner = inner
        return self

    def rope_positions(self, length, max_seq_len, device):
        return self.inner.rope_positions(length, max_seq_len, device)

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        return self.inner.attend(attention, q_BHTE, k_BKTE, v_BKTE)

    def head_rows(self, h_BTD):
        self.kept = [h_BTD[0, first:end] for first, end in self.spans]
        return self.inner.head_rows(h_BTD)


def scored_span(start: int, end: int, length: int) -> tuple[int, int]:
    """The rows of a pass over prompt positions start..end-1 (of a prompt `length` long) that score a
    prompt token, relative to the pass: every row but the one after the prompt's last token."""
    return 0, min(end, length - 1) - start


def row_logprobs(model: Transformer, hidden_TD: torch.Tensor) -> torch.Tensor:
    """log-softmax (T, V) in float32 of the logits the head gives these hidden rows."""
    logits_1TV = model.output(model.norm(hidden_TD[None]))  # (1, T, D) as every head product is shaped
    return torch.log_softmax(logits_1TV[0].float(), dim=-1)
