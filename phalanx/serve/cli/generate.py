"""`phalanx generate`: continue one prompt through the serving engine with a single slot, so the command
line and the servers share one decode path, one sampler and one set of defaults (options.DEFAULTS)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from phalanx.errors import PhalanxError
from phalanx.serve.core.contract import PromptTooLong
from phalanx.serve.core.options import DEFAULTS, InvalidOptions, SamplingOptions
from phalanx.serve.core.served import ServedModel, load_served_model


def generate_options(max_new_tokens: int, seed: int | None, **given: float | int | None) -> SamplingOptions:
    """DEFAULTS with what the user gave (None: not given)."""
    chosen = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingOptions(**{**DEFAULTS, **chosen, "seed": seed, "max_tokens": max_new_tokens})
    except InvalidOptions as e:
        raise PhalanxError(str(e)) from None


def generate_text(served: ServedModel, prompt: str, options: SamplingOptions) -> Iterator[str]:
    """The text the model writes after `prompt` (framed as in training: BOS where the tokenizer has one,
    then the text), piece by piece, up to a stop token (end of text, a checkpoint's end of turn) or
    options.max_tokens."""
    ids = served.text_prompt_ids(prompt)
    context = served.loaded.model.args.max_seq_len
    if options.max_tokens is not None and len(ids) + options.max_tokens > context:
        room = context - len(ids)
        hint = f"use --max-new-tokens {room} or less" if room > 0 else "shorten the prompt"
        raise PhalanxError(
            f"a prompt of {len(ids)} tokens plus {options.max_tokens} new ones exceeds the model's "
            f"max_seq_len {context}; {hint}"
        )
    from phalanx.serve.server import build_engine

    engine = build_engine("torch", served, slots=1, max_queue=0, context=None, observer=None)
    engine.start()
    try:
        try:
            stream = engine.submit(ids, options)
        except PromptTooLong as e:
            raise PhalanxError(str(e)) from None
        yield from stream
        if stream.finish.reason == "error":
            raise PhalanxError(stream.finish.error or "generation failed")
    finally:
        engine.stop()


def generate(path: Path, prompt: str, options: SamplingOptions, device: str = "auto") -> Iterator[str]:
    """Load the model at `path` (run, checkpoint or HF export) and continue `prompt`."""
    from phalanx.serve.server import pick_device

    torch_device, dtype = pick_device(device, "auto")
    yield from generate_text(load_served_model(path, torch_device, dtype), prompt, options)
