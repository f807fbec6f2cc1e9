"""Turn the config's `model` section (a preset plus overrides) into concrete ModelArgs."""

from __future__ import annotations

import dataclasses

from phalanx.config.schema import ModelSection
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.presets import get_preset


def model_args(section: ModelSection, tokenizer_vocab: int | None = None, seq_len: int | None = None) -> ModelArgs:
    """The preset with every non-null key of the section applied.

    When training, the vocabulary follows the tokenizer unless `model.vocab_size` is set (it may be larger,
    never smaller); without a tokenizer (bench, planning) the preset's own vocabulary stands.
    """
    overrides = {k: v for k, v in section.model_dump().items() if k != "preset" and v is not None}
    if tokenizer_vocab is not None:
        chosen = overrides.setdefault("vocab_size", tokenizer_vocab)
        if chosen < tokenizer_vocab:
            raise PhalanxError(f"model.vocab_size={chosen} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    args = dataclasses.replace(get_preset(section.preset), **overrides)
    if seq_len is not None and seq_len > args.max_seq_len:
        raise PhalanxError(
            f"sequence length {seq_len} (train.seq_len, or bench --seq-len) exceeds the model's "
            f"max_seq_len={args.max_seq_len} (model.max_seq_len)"
        )
    return args
