"""Load a trained run for inference and sample text from its newest checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.tokenizer import load_tokenizer, special_ids
from phalanx.errors import PhalanxError
from phalanx.models.llama import ModelArgs, Transformer
from phalanx.models.sampling import generate
from phalanx.train.checkpoint import latest_checkpoint, load_model_weights, read_trainer_state
from phalanx.train.run_dir import checkpoints_dir


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Path


def load_run(run_dir: Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model of a run's newest checkpoint (or of a checkpoint directory given directly)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PhalanxError(f"run directory not found: {run_dir}")
    checkpoint = run_dir if (run_dir / "trainer.json").is_file() else latest_checkpoint(checkpoints_dir(run_dir))
    if checkpoint is None:
        raise PhalanxError(f"{run_dir} has no checkpoint yet; train it first (phalanx train)")
    tokenizer_path = run_dir / "tokenizer.json" if checkpoint != run_dir else run_dir.parent.parent / "tokenizer.json"
    try:
        args = ModelArgs(**read_trainer_state(checkpoint)["model_args"])
    except (KeyError, TypeError):
        raise PhalanxError(f"checkpoint {checkpoint} has no usable model_args in its trainer.json") from None
    model = Transformer(args)
    load_model_weights(checkpoint, model)
    return LoadedModel(model.to(device).eval(), load_tokenizer(tokenizer_path), checkpoint)


def generate_text(loaded: LoadedModel, prompt: str, max_new_tokens: int, temperature: float,
                  top_k: int | None, seed: int | None) -> str:
    """The prompt followed by what the model writes after it (up to its end-of-text token)."""
    tok = loaded.tokenizer
    bos, eos = special_ids(tok)
    prompt_ids = [bos] + tok.encode(prompt).ids
    new_ids = generate(loaded.model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                       eos_id=eos)
    # Decoded together: a character split across the prompt/completion boundary still comes out whole.
    return tok.decode(prompt_ids + new_ids, skip_special_tokens=True)
