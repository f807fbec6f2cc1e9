"""The config as a run will use it: the model preset's shape written out, the micro batch of a rank count.

A config names a preset (`model.preset: tiny`) and leaves its shape keys null, and leaves
`train.micro_batch_size` null to split the global batch over however many ranks start. That keeps one
config good for any rank count, but `config show`, the run store and the dashboard should show what the
run trains: the numbers. It lives in run/ (config/ is a leaf that knows no presets), for train_job,
`config show` and `runs import` alike.
"""

from __future__ import annotations

import yaml

from phalanx.config.schema import Config
from phalanx.models.from_config import model_args

SHOWN_RANKS = (1, 2, 4, 8)  # the rank counts `config show` spells the derived micro batch out for


def resolved(config: Config, vocab_size: int | None = None, dp_ranks: int | None = None) -> Config:
    """`config` with the model's shape filled in from its preset, and the micro batch of `dp_ranks`
    data-parallel ranks (the world size over parallel.tp)."""
    # The vocabulary only when known: the tokenizer's (`vocab_size`) or model.vocab_size.
    args = model_args(config.model, vocab_size)
    shape = {
        k: getattr(args, k)
        for k in type(config.model).model_fields
        if k not in ("preset", "vocab_size") and hasattr(args, k)
    }
    if vocab_size is not None or config.model.vocab_size is not None:
        shape["vocab_size"] = args.vocab_size
    model = config.model.model_copy(update=shape)
    train = config.train
    if dp_ranks is not None and train.micro_batch_size is None and train.micro_batch(dp_ranks) > 0:
        train = train.model_copy(update={"micro_batch_size": train.micro_batch(dp_ranks)})
    return config.model_copy(update={"model": model, "train": train})


def resolved_yaml(config: Config) -> str:
    """What `config show` prints: the resolved config as YAML, with a comment on each key still null
    because only the run can fill it in (the tokenizer's vocabulary, the rank count's micro batch)."""
    shown = resolved(config)
    notes = {("model", "vocab_size"): f"the tokenizer's (at most data.vocab_size = {config.data.vocab_size})"}
    if shown.train.micro_batch_size is None:
        g = shown.train.global_batch_size
        per = ", ".join(f"{g // n} on {n}" for n in SHOWN_RANKS if g % n == 0)
        notes[("train", "micro_batch_size")] = f"global_batch_size / ranks: {per}"
    lines, section = [], None
    for line in yaml.safe_dump(shown.model_dump(mode="json"), sort_keys=False).splitlines():
        if not line.startswith(" "):
            section = line.rstrip(":")
        key, _, value = line.strip().partition(": ")
        note = notes.get((section, key))
        lines.append(f"{line}  # {note}" if note and value == "null" else line)
    return "\n".join(lines) + "\n"
