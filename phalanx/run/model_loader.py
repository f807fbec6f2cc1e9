"""The one model loader: a run directory, a checkpoint directory, a Hugging Face export or a GGUF export
gives a model, its tokenizer and its chat template. `phalanx generate`, `serve`, `chat` and `export` all
load here.

The tokenizer carries its special tokens (BOS or none, EOS, the stop ids: data/tokenizer.py
special_tokens): a Hugging Face checkpoint's as its tokenizer_config.json and generation_config.json
name them, phalanx's own for a run phalanx trained, the checkpoint's again for a run started from one
(it keeps those files beside its tokenizer.json). The chat template likewise: the checkpoint's where it
has one, phalanx's otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from phalanx.data.chat_template import CHAT_TEMPLATE, read_template
from phalanx.data.tokenizer import SpecialTokens, load_tokenizer, special_tokens
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.run.checkpoints import latest_checkpoint, load_model_weights, read_trainer_state
from phalanx.run.gguf_format import GGUF_FILE, gguf_file, read_gguf
from phalanx.run.hf_format import is_hf_export, read_chat_template, read_hf_model, read_hf_tokenizer
from phalanx.run.layout import TRAINER_STATE, RunDir, is_checkpoint_dir, run_of_checkpoint


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    checkpoint: Path  # the checkpoint (or export directory, or GGUF file) the weights came from
    chat_template: str = CHAT_TEMPLATE
    format: str = "dcp"  # "dcp" (a phalanx checkpoint), "safetensors" (an HF export) or "gguf"

    @property
    def specials(self) -> SpecialTokens:
        return special_tokens(self.tokenizer)

    @property
    def name(self) -> str:
        """The model's default name: its run's name for a checkpoint of a run, the directory's name for an
        export, a GGUF file's name without .gguf when it is named other than model.gguf."""
        checkpoint = Path(self.checkpoint).absolute()
        if checkpoint.is_file():
            return checkpoint.parent.name if checkpoint.name == GGUF_FILE else checkpoint.stem
        run = run_of_checkpoint(checkpoint)
        return (run.path if run is not None else checkpoint).name


def load_model(path: Path, device: torch.device | str = "cpu") -> LoadedModel:
    """The model at `path`: a run directory (its newest checkpoint), a checkpoint directory, an HF export
    directory, or a GGUF export (its directory or the .gguf file); in eval mode on `device`."""
    path = Path(path)
    if not path.exists():
        raise PhalanxError(f"{path} does not exist: give a run directory, a checkpoint or an export")
    gguf = gguf_file(path)
    if gguf is not None:
        model, tokenizer, template = read_gguf(gguf)
        loaded = LoadedModel(model, tokenizer, gguf, template or CHAT_TEMPLATE, "gguf")
    elif not path.is_dir():
        raise PhalanxError(
            f"{path} is neither a directory nor a .gguf file: give a run directory, a checkpoint or an export"
        )
    elif is_hf_export(path):
        loaded = LoadedModel(
            read_hf_model(path), read_hf_tokenizer(path), path, read_chat_template(path) or CHAT_TEMPLATE, "safetensors"
        )
    else:
        loaded = _load_checkpoint(path)
    loaded.model.to(device).eval()
    return loaded


def _load_checkpoint(path: Path) -> LoadedModel:
    if is_checkpoint_dir(path):
        checkpoint, run = path, run_of_checkpoint(path)
        if run is None:
            raise PhalanxError(
                f"checkpoint {path} is not inside a run directory, so its tokenizer is unknown; "
                "give the run directory, or export it first"
            )
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
    # A run started from a checkpoint keeps its template beside the run's tokenizer.json (run/prepare.py).
    return LoadedModel(model, load_tokenizer(run.tokenizer), checkpoint, read_template(run.path) or CHAT_TEMPLATE)
