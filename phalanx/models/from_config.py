"""Turn the config's `model` section (a preset plus overrides, or a pretrained checkpoint) into ModelArgs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from phalanx.config.schema import ModelSection
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.presets import get_preset

# What a pretrained run may still set: a shorter context only shrinks the RoPE tables (the angles of the
# positions kept are the same).
PRETRAINED_OVERRIDABLE = ("max_seq_len",)


def model_args(section: ModelSection, tokenizer_vocab: int | None = None, seq_len: int | None = None) -> ModelArgs:
    """The preset (or the pretrained checkpoint's architecture) with every non-null key of the section
    applied.

    When training, the vocabulary follows the tokenizer unless `model.vocab_size` is set (it may be larger,
    never smaller); without a tokenizer (bench, planning) the preset's own vocabulary stands. A pretrained
    checkpoint's vocabulary is its own, and must hold the tokenizer's.
    """
    overrides = {k: v for k, v in section.model_dump().items() if k not in ("preset", "pretrained") and v is not None}
    if section.pretrained is not None:
        base = pretrained_args(Path(section.pretrained))
        # model.preset is not read (a saved config names the default one anyway).
        fixed = sorted(k for k in overrides if k not in PRETRAINED_OVERRIDABLE)
        if fixed:
            raise PhalanxError(
                f"model.{fixed[0]} comes from the pretrained checkpoint's config.json "
                f"(model.pretrained={section.pretrained}); remove it"
            )
        if tokenizer_vocab is not None and base.vocab_size < tokenizer_vocab:
            raise PhalanxError(
                f"the pretrained checkpoint's vocab_size {base.vocab_size} is smaller than its tokenizer's "
                f"{tokenizer_vocab} tokens"
            )
    else:
        base = get_preset(section.preset)
        if tokenizer_vocab is not None:
            chosen = overrides.setdefault("vocab_size", tokenizer_vocab)
            if chosen < tokenizer_vocab:
                raise PhalanxError(
                    f"model.vocab_size={chosen} is smaller than the tokenizer's {tokenizer_vocab} tokens"
                )
    args = dataclasses.replace(base, **overrides)
    if seq_len is not None and seq_len > args.max_seq_len:
        raise PhalanxError(
            f"sequence length {seq_len} (train.seq_len, or bench --seq-len) exceeds the model's "
            f"max_seq_len={args.max_seq_len} (model.max_seq_len)"
        )
    return args


def read_checkpoint_config(path: Path) -> dict:
    """A Hugging Face checkpoint's config.json, as a dict; one clear line where it cannot be read."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        if (Path(path) / "config.yaml").is_file():  # a phalanx run (its resolved config: run/layout.py)
            raise PhalanxError(
                f"{path} is a phalanx run: `phalanx train` converts it into a Hugging Face checkpoint in the new "
                f"run's base/ when it starts; before that, `phalanx config show {path}/config.yaml` shows its model"
            ) from None
        raise PhalanxError(f"{path} is not a Hugging Face checkpoint: it has no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PhalanxError(f"{file} is not valid JSON") from None
    except OSError as e:
        raise PhalanxError(f"{file} could not be read: {e.strerror}") from None
    if not isinstance(config, dict):
        raise PhalanxError(f"{file} is not a JSON object")
    return config


def pretrained_args(path: Path) -> ModelArgs:
    """The architecture and shape of the Hugging Face checkpoint at `path` (models/families/)."""
    from phalanx.models.families import args_from_hf_config

    return args_from_hf_config(read_checkpoint_config(path), Path(path))
