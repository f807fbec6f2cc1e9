"""The one model loader: a run directory, a checkpoint directory or a Hugging Face export gives a model,
its tokenizer and its chat template. `phalanx generate`, `serve`, `chat` and `export` all load here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.chat_template import CHAT_TEMPLATE
from phalanx.data.tokenizer import load_tokenizer
from phalanx.errors import PhalanxError
from phalanx.models.llama import ModelArgs, Transformer
from phalanx.run.checkpoints import latest_checkpoint, load_model_weights, read_trainer_state
from phalanx.run.hf_format import is_hf_export, read_chat_template, read_hf_model, read_hf_tokenizer
from phalanx.run.layout import TRAINER_STATE, RunDir, is_checkpoint_dir, run_of_checkpoint


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Path  # the checkpoint (or HF export) directory the weights came from
    chat_template: str = CHAT_TEMPLATE
    format: str = "dcp"  # "dcp" (a phalanx checkpoint) or "safetensors" (an HF export)

    @property
    def name(self) -> str:
        """The model's default name: its run's name for a checkpoint of a run, else the directory's name."""
        run = run_of_checkpoint(self.checkpoint)
        return (run.path if run is not None else Path(self.checkpoint)).absolute().name


def load_model(path: Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model at `path`: a run directory (its newest checkpoint), a checkpoint directory, or an HF
    export directory; in eval mode on `device`."""
    path = Path(path)
    if not path.exists():
        raise PhalanxError(f"{path} does not exist: give a run directory, a checkpoint or an HF export directory")
    if not path.is_dir():
        raise PhalanxError(f"{path} is not a directory: give a run directory, a checkpoint or an HF export")
    if is_hf_export(path):
        loaded = LoadedModel(read_hf_model(path), read_hf_tokenizer(path), path,
                             read_chat_template(path) or CHAT_TEMPLATE, "safetensors")
    else:
        loaded = _load_checkpoint(path)
    loaded.model.to(device).eval()
    return loaded


def _load_checkpoint(path: Path) -> LoadedModel:
    if is_checkpoint_dir(path):
        checkpoint, run = path, run_of_checkpoint(path)
        if run is None:
            raise PhalanxError(f"checkpoint {path} is not inside a run directory, so its tokenizer is unknown; "
                               "give the run directory, or export it first")
    else:
        run = RunDir(path)
        checkpoint = latest_checkpoint(run.checkpoints)
        if checkpoint is None:
            raise PhalanxError(f"{path} has no checkpoint yet; train it first (phalanx train)")
    try:
        args = ModelArgs(**read_trainer_state(checkpoint)["model_args"])
    except (KeyError, TypeError):
        raise PhalanxError(f"checkpoint {checkpoint} has no usable model_args in its {TRAINER_STATE}") from None
    model = Transformer(args)
    load_model_weights(checkpoint, model)
    return LoadedModel(model, load_tokenizer(run.tokenizer), checkpoint)
