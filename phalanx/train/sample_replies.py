"""What a fine-tune answers: greedy replies to a few fixed prompts of the validation split, at every
evaluation, as `sample_reply` events (so the run store and the dashboard's event list show them), to read
a model's replies change as it trains.

The prompts are the first validation examples' tokens before their first trained one (the conversation
up to the assistant's turn). Every rank runs the same forwards (FSDP gathers parameters inside each,
tensor parallelism splits each), so the number of forwards is fixed: every row takes `max_new` tokens
and a reply is cut at its first stop token afterwards. No KV cache: a few prompts of a few dozen tokens
through the training model's own forward, once per evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from phalanx.data.sft_batches import ExampleRows

PROMPTS = 3
MAX_NEW = 32


class SampleReplies:
    def __init__(
        self,
        val: ExampleRows,
        tokenizer: Tokenizer,
        stop_ids: tuple[int, ...],
        max_seq_len: int,
        device: torch.device,
        prompts: int = PROMPTS,
        max_new: int = MAX_NEW,
        pad_to: int = 1,
    ):
        """pad_to: forwards' widths are made a multiple of it (tensor parallelism's sequence-parallel
        layers split every sequence evenly between its ranks)."""
        self.tokenizer, self.stop_ids, self.device, self.pad_to = tokenizer, set(stop_ids), device, pad_to
        self.prompts: list[list[int]] = []
        for k in range(min(prompts, len(val.examples))):
            ids, trained = val.examples.example(k)
            first = int(np.argmax(trained)) if trained.any() else len(ids)
            if 0 < first < max_seq_len:
                self.prompts.append([int(t) for t in ids[:first]])
        longest = max((len(p) for p in self.prompts), default=0)
        room = max_seq_len // pad_to * pad_to  # the widest padded forward that fits
        self.max_new = max(0, min(max_new, room - longest))

    @torch.no_grad()
    def replies(self, model: nn.Module, autocast: Callable[[], AbstractContextManager]) -> list[tuple[str, str]]:
        """(prompt, reply) texts; collective: every rank calls it."""
        if not self.prompts or not self.max_new:
            return []
        model.eval()
        rows = [list(p) for p in self.prompts]
        for _ in range(self.max_new):
            width = -(-max(len(r) for r in rows) // self.pad_to) * self.pad_to
            # Right padding: a causal forward's logits at a row's last token do not see it.
            batch = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
            with autocast():
                logits = model(batch)
            last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            chosen = logits[torch.arange(len(rows), device=self.device), last].argmax(-1).tolist()
            for row, token in zip(rows, chosen):
                row.append(int(token))
        model.train()
        out = []
        for prompt, row in zip(self.prompts, rows):
            reply = row[len(prompt) :]
            cut = next((i for i, t in enumerate(reply) if t in self.stop_ids), len(reply))
            out.append((self.tokenizer.decode(prompt), self.tokenizer.decode(reply[:cut])))
        return out
