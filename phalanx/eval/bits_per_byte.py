"""Bits per byte of held-out text, computed by the model itself: comparable across tokenizers.

Per token, perplexity depends on how much text a token holds; per UTF-8 byte of the text it does not, so
two models with different tokenizers are compared on the same footing:

    bits per byte = (sum over the text's tokens of -ln p(token | the tokens before it)) / ln 2 / bytes

The text is framed as training frames a document: BOS first (EOS where the tokenizer has no BOS, as
lm-evaluation-harness's rolling log-likelihood does), and every token of the text is scored, the first
one given that prefix alone.

A text longer than the model's context is scored in sliding windows of the whole context, moved by a
stride of half the context by default: each window scores only the tokens the windows before it did not,
so every token is scored once, and each with at least (context - stride) tokens before it (but the
first window's). A stride of the whole context would cost half as many forwards but score the start of
each window with almost nothing before it, which reads worse than the model is; stride 1 would be exact
and cost a forward per token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from phalanx.errors import PhalanxError


@dataclass(frozen=True)
class TextScore:
    tokens: int  # the text's tokens, each scored once (not the prefix)
    bytes: int  # UTF-8 bytes of the text
    nll_nats: float  # sum of the tokens' negative log-likelihoods
    context: int
    stride: int

    @property
    def bits_per_byte(self) -> float:
        return self.nll_nats / math.log(2) / self.bytes

    @property
    def perplexity(self) -> float:
        """Per token: exp of the mean negative log-likelihood."""
        return math.exp(self.nll_nats / self.tokens)

    def as_dict(self) -> dict:
        return {**asdict(self), "bits_per_byte": self.bits_per_byte, "perplexity": self.perplexity}


def read_text(path: Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PhalanxError(f"--text {path} does not exist") from None
    except (IsADirectoryError, UnicodeDecodeError) as exc:
        raise PhalanxError(f"--text {path} is not a UTF-8 text file ({exc.__class__.__name__})") from None
    if not text:
        raise PhalanxError(f"--text {path} is empty: there is nothing to score")
    return text


def text_token_ids(tokenizer, specials, text: str) -> list[int]:
    """The prefix (BOS, else EOS) and then the text's ids, special-token strings in it kept as text."""
    from phalanx.data.prompt_tokens import PromptEncoder

    prefix = specials.bos_id if specials.bos_id is not None else specials.eos_id
    return [prefix, *PromptEncoder(tokenizer).text_ids(text)]


@torch.no_grad()
def score_ids(model, ids: list[int], context: int, stride: int, device: torch.device | str = "cpu") -> float:
    """Sum of -ln p(ids[i] | ids[:i]) for i >= 1, in sliding windows of `context` tokens moved by `stride`."""
    if not 1 <= stride <= context:
        raise PhalanxError(f"--stride must be between 1 and the context ({context}), not {stride}")
    total, scored = 0.0, 0  # ids[1 : scored + 1] are scored
    last = len(ids) - 1  # the last id that is a target
    for start in range(0, last, stride):
        end = min(start + context, last)  # inputs ids[start:end] predict targets ids[start + 1 : end + 1]
        new = end - scored  # the targets no window before scored; scored >= start as stride <= context
        logits = model(torch.tensor([ids[start:end]], device=device))[0, -new:].float()
        targets = torch.tensor(ids[end - new + 1 : end + 1], device=device)
        total += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        scored = end
        if end == last:
            break
    return total


def score_text(
    model, tokenizer, specials, text: str, context: int, stride: int | None = None, device="cpu"
) -> TextScore:
    stride = stride if stride is not None else max(1, context // 2)
    ids = text_token_ids(tokenizer, specials, text)
    nll = score_ids(model, ids, context, stride, device)
    return TextScore(len(ids) - 1, len(text.encode("utf-8")), nll, context, stride)
