"""One request's next-token choice from its row of logits: penalties, then greedy or filtered sampling.

Each request samples with its own generator from its own row, so its tokens never depend on which other
requests share the batch. Order: repeat/presence/frequency penalties on the raw logits (llama.cpp's
formulas), then temperature, then top_k, top_p and min_p on the tempered distribution (Hugging Face's
order), then one draw.
"""

from __future__ import annotations

import secrets
from collections import Counter, deque

import torch

from phalanx.serve.options import SamplingOptions


class RequestSampler:
    def __init__(self, options: SamplingOptions, prompt_ids: list[int], context: int, device: torch.device):
        self.options = options
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(options.seed if options.seed is not None else secrets.randbits(63))
        window = context if options.repeat_last_n == -1 else options.repeat_last_n
        # The recent tokens the penalties look at, and how often each occurs among them.
        self.recent: deque[int] = deque(prompt_ids[-window:] if window else (), maxlen=window or 1)
        self.counts = Counter(self.recent) if window else Counter()
        self.window = window

    @property
    def greedy_without_penalties(self) -> bool:
        """True when the choice is the plain argmax (the engine then takes it for all such rows at once)."""
        return self.options.temperature == 0 and not self.options.penalises

    def accept(self, token: int) -> None:
        if not self.window:
            return
        if len(self.recent) == self.window:
            dropped = self.recent[0]
            self.counts[dropped] -= 1
            if not self.counts[dropped]:
                del self.counts[dropped]
        self.recent.append(token)
        self.counts[token] += 1

    def pick(self, logits_V: torch.Tensor) -> int:
        o = self.options
        logits_V = logits_V.float().clone()
        if o.penalises and self.counts:
            ids = torch.tensor(list(self.counts), device=logits_V.device)
            counts = torch.tensor(list(self.counts.values()), device=logits_V.device, dtype=logits_V.dtype)
            picked = logits_V[ids]
            if o.repeat_penalty != 1:
                picked = torch.where(picked > 0, picked / o.repeat_penalty, picked * o.repeat_penalty)
            picked = picked - counts * o.frequency_penalty - o.presence_penalty
            logits_V[ids] = picked
        if o.temperature == 0:
            return int(logits_V.argmax())

        logits_V = logits_V / o.temperature
        candidates = None  # token ids of the kept logits when top_k has narrowed them
        if 0 < o.top_k < logits_V.numel():
            logits_V, candidates = torch.topk(logits_V, o.top_k)  # sorted, likeliest first
        probs = torch.softmax(logits_V, dim=-1)
        if o.top_p < 1:
            if candidates is None:
                probs, candidates = torch.sort(probs, descending=True)
            # Keep a token while the tokens before it hold less than top_p (so the likeliest always stays).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= o.top_p
            drop[0] = False
            probs = probs.masked_fill(drop, 0.0)
        if o.min_p > 0:
            probs = probs.masked_fill(probs < o.min_p * probs.max(), 0.0)
        index = int(torch.multinomial(probs, 1, generator=self.generator))
        return int(candidates[index]) if candidates is not None else index
