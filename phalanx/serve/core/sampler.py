"""One request's next-token choice from its row of logits: penalties, then greedy or filtered sampling.

Each request samples with its own generator from its own row, so its tokens never depend on which other
requests share the batch. Order: repeat/presence/frequency penalties on the raw logits (llama.cpp's
formulas), then temperature, then top_k, top_p and min_p on the tempered distribution (Hugging Face's
order), then one draw. A request with a format (structured output) has the tokens its grammar forbids masked out
after the penalties.

A row whose logits are not finite (a model gone NaN, or options that got past validation) raises
SamplingError for that request alone; the engine fails it and serves the others.
"""

from __future__ import annotations

import secrets
from collections import Counter, deque

import torch

from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.core.structured_output import TokenConstraint


class SamplingError(ValueError):
    """This request's next-token distribution cannot be sampled (NaN or infinite values)."""


BROKEN = (
    "the next-token distribution holds NaN or infinite values (the model's output, or the sampling "
    "options, broke the arithmetic)"
)


class RequestSampler:
    def __init__(self, options: SamplingOptions, prompt_ids: list[int], context: int, device: torch.device):
        self.options = options
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(options.seed if options.seed is not None else secrets.randbits(63))
        # The window never reaches past the context (a huge repeat_last_n would not fit a deque's maxlen).
        window = context if options.repeat_last_n == -1 else min(options.repeat_last_n, context)
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

    def pick(self, logits_V: torch.Tensor, constraint: TokenConstraint | None = None) -> int:
        """The next token; with a constraint (structured output) only among the tokens its grammar allows,
        masked after the penalties and before the temperature, so filtering and the draw see only those."""
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
        if constraint is not None:
            logits_V = constraint.apply(logits_V)
        if o.temperature == 0:
            return int(logits_V.argmax())

        # Shift the likeliest logit to 0 before tempering: the shape is unchanged, and a small temperature
        # then sends the others towards -inf (probability 0) rather than overflowing to +inf (NaN).
        logits_V = (logits_V - logits_V.max()) / o.temperature
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
        index = self._draw(probs)
        return int(candidates[index]) if candidates is not None else index

    def _draw(self, probs: torch.Tensor) -> int:
        """One token from `probs`, or SamplingError if they are not a distribution. Softmax gives values
        in [0, 1], so a NaN anywhere shows as a sum that is not positive."""
        if probs.device.type == "cpu":  # reading a number back costs nothing here
            if not float(probs.sum()) > 0:
                raise SamplingError(BROKEN)
            return int(torch.multinomial(probs, 1, generator=self.generator))
        return self._draw_checked_on_device(probs)

    def _draw_checked_on_device(self, probs: torch.Tensor) -> int:
        """On a GPU a NaN handed to multinomial trips a device-side assert, fatal to the process: check on
        the device and read the verdict back with the draw, in the one sync the draw costs anyway."""
        broken = ~(probs.sum() > 0)
        drawn = torch.multinomial(torch.where(broken, torch.ones_like(probs), probs), 1, generator=self.generator)
        is_broken, index = torch.stack([broken.long(), drawn[0]]).tolist()
        if is_broken:
            raise SamplingError(BROKEN)
        return index
