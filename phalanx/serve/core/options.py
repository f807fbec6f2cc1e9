"""What a request may ask of the sampler, validated once where the request arrives.

Names follow Ollama's options (which are llama.cpp's); the OpenAI front maps its own names onto them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# phalanx's defaults where a request (or `phalanx generate`, or `phalanx chat`) leaves an option out:
# Ollama's (its Modelfile defaults, which are llama.cpp's). The OpenAI front uses OpenAI's own instead.
DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "repeat_last_n": 64,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
# Beyond these the arithmetic breaks rather than the text getting odd: dividing logits by a temperature
# of 1e-38 overflows them to infinity (and the distribution to NaN), a repeat_penalty of 1e-38 likewise.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-3, 1e3
# What torch's generators take: a seed is one 64-bit word, signed or not.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


class InvalidOptions(ValueError):
    """A sampling option out of range; the message names the option and its range."""


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.8  # 0: greedy (the likeliest token every step)
    top_k: int = 0  # keep the k likeliest tokens; 0: all
    top_p: float = 1.0  # keep the smallest set of likeliest tokens whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one
    repeat_penalty: float = 1.0  # divide positive logits (multiply negative ones) of recent tokens; 1: off
    repeat_last_n: int = 64  # how many recent tokens (prompt included) the penalties look at; -1: all, 0: none
    presence_penalty: float = 0.0  # subtract from the logit of every recent token
    frequency_penalty: float = 0.0  # subtract, times its count, from the logit of every recent token
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings; it is not returned
    max_tokens: int | None = None  # None: until the context is full
    ignore_eos: bool = False  # keep going past end-of-text (benchmarks: fixed lengths); not offered over HTTP

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        floats = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:
            if not math.isfinite(getattr(self, name)):
                raise InvalidOptions(f"{name} must be a finite number")
        checks = [
            (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}",
            ),
            (self.top_k >= 0, "top_k must be >= 0 (0: no limit)"),
            (0 <= self.top_p <= 1, "top_p must be between 0 and 1"),
            (0 <= self.min_p <= 1, "min_p must be between 0 and 1"),
            (
                MIN_REPEAT_PENALTY <= self.repeat_penalty <= MAX_REPEAT_PENALTY,
                f"repeat_penalty must be between {MIN_REPEAT_PENALTY:g} and {MAX_REPEAT_PENALTY:g} (1: off)",
            ),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1 (-1: the whole context, 0: off)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be between -2 and 2"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2"),
            (
                self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
                f"seed must be an integer between {MIN_SEED} and {MAX_SEED}",
            ),
            (self.max_tokens is None or self.max_tokens >= 0, "the maximum number of new tokens must be >= 0"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (
                all(0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
                f"stop strings must be 1 to {MAX_STOP_LENGTH} characters long",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidOptions(message)

    @property
    def penalises(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        )
