"""The one model loader: a run directory, a checkpoint directory, a Hugging Face export or a GGUF export
gives a model, its tokenizer and its chat template. `phalanx generate`, `serve`, `chat` and `export` all
load here.

The tokenizer carries its special tokens (BOS or none, EOS, the stop ids: data/tokenizer.py
special_tokens): a Hugging Face checkpoint's as its tokenizer_config.json and generation_config.json
name them, phalanx's own for a run phalanx trained, the checkpoint's again for a run started from one
(it keeps those files beside its tokenizer.json). The chat template likewise: the checkpoint's where it
has one, phalanx's otherwise.

A LoRA run's checkpoints hold only its adapters (models/lora.py); their trainer.json names the base, a
Hugging Face checkpoint, by path and SHA-256. Loading one reads that base, checks its digest, puts the
adapters on it and merges them into the weights: the model served and exported is the merged one.
read_adapters gives the adapters alone (the PEFT export), without reading the base.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from phalanx.data.chat_template import CHAT_TEMPLATE, read_template
from phalanx.data.tokenizer import SpecialTokens, load_tokenizer, special_tokens
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.lora import TARGETS, apply_lora, is_adapter, merge
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


def _locate(path: Path) -> tuple[Path, RunDir]:
    """(the checkpoint, its run) for a checkpoint directory or a run directory (its newest checkpoint)."""
    if is_checkpoint_dir(path):
        run = run_of_checkpoint(path)
        if run is None:
            raise PhalanxError(
                f"checkpoint {path} is not inside a run directory, so its tokenizer is unknown; "
                "give the run directory, or export it first"
            )
        return path, run
    run = RunDir(path)
    checkpoint = latest_checkpoint(run.checkpoints)
    if checkpoint is None:
        raise PhalanxError(f"{path} has no checkpoint yet; train it first (phalanx train)")
    return checkpoint, run


def _model_args(state: dict[str, Any], checkpoint: Path) -> ModelArgs:
    try:
        return ModelArgs(**state["model_args"])
    except (KeyError, TypeError):
        raise PhalanxError(f"checkpoint {checkpoint} has no usable model_args in its {TRAINER_STATE}") from None


@dataclass(frozen=True)
class LoraRecord:
    """What a LoRA run's checkpoint says it adapts (its trainer.json `lora` and `base`): the adapters'
    settings, and the base checkpoint's absolute path and SHA-256 (run/prepare.py pretrained_digest)."""

    rank: int
    alpha: float
    dropout: float
    targets: str
    base: Path
    sha256: str


def lora_record(state: dict[str, Any], checkpoint: Path) -> LoraRecord | None:
    """The LoRA record of a checkpoint's trainer state, or None for a checkpoint of a whole model."""
    if "lora" not in state:
        return None
    try:
        lora, base = state["lora"], state["base"]
        record = LoraRecord(
            int(lora["rank"]),
            float(lora["alpha"]),
            float(lora["dropout"]),
            str(lora["targets"]),
            Path(base["path"]),
            str(base["sha256"]),
        )
    except (KeyError, TypeError, ValueError):
        record = None
    if record is None or record.rank <= 0 or record.targets not in TARGETS:
        raise PhalanxError(f"checkpoint {checkpoint} has unusable lora or base settings in its {TRAINER_STATE}")
    return record


def _lora_base(lora: LoraRecord, args: ModelArgs, checkpoint: Path) -> Transformer:
    """The base model the LoRA checkpoint names, checked to be the one it trained on, with empty adapters
    on its target layers (load_model_weights fills them)."""
    from phalanx.run.prepare import pretrained_digest

    if not lora.base.is_dir():
        raise PhalanxError(
            f"the base model {lora.base} of LoRA checkpoint {checkpoint} is missing; put that Hugging Face "
            "checkpoint back at that path (its adapters mean nothing without it)"
        )
    digest = pretrained_digest(lora.base)
    if digest != lora.sha256:
        raise PhalanxError(
            f"the base model {lora.base} has changed since LoRA checkpoint {checkpoint} was trained on it "
            f"(SHA-256 {digest[:16]}, recorded {lora.sha256[:16]}); restore the original checkpoint at that path"
        )
    model = read_hf_model(lora.base)
    if dataclasses.replace(model.args, max_seq_len=args.max_seq_len) != args:
        raise PhalanxError(
            f"the base model {lora.base} is not of the shape LoRA checkpoint {checkpoint} was trained with "
            f"(its {TRAINER_STATE}'s model_args)"
        )
    if model.args.max_seq_len != args.max_seq_len:  # the run may use a shorter context: other RoPE tables
        model.args = args
        for name in ("rope_cos", "rope_sin"):
            model.register_buffer(name, torch.empty(args.max_seq_len, args.rope_dim), persistent=False)
        model.init_rope_tables()  # the loaded weights and buffers stay
    apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    return model


def _load_checkpoint(path: Path) -> LoadedModel:
    checkpoint, run = _locate(path)
    state = read_trainer_state(checkpoint)
    args = _model_args(state, checkpoint)
    lora = lora_record(state, checkpoint)
    model = Transformer(args) if lora is None else _lora_base(lora, args, checkpoint)
    load_model_weights(checkpoint, model)  # a LoRA model: its adapters alone
    if lora is not None:
        merge(model)
    # A run started from a checkpoint keeps its template beside the run's tokenizer.json (run/prepare.py).
    return LoadedModel(model, load_tokenizer(run.tokenizer), checkpoint, read_template(run.path) or CHAT_TEMPLATE)


@dataclass
class LoraAdapters:
    """A LoRA run's adapters alone: phalanx name (`layers.0.attention.wq.lora_A`) -> tensor (float32, CPU)."""

    checkpoint: Path
    args: ModelArgs
    lora: LoraRecord
    tensors: dict[str, torch.Tensor]


def read_adapters(path: Path) -> LoraAdapters:
    """The adapters of a LoRA run directory (its newest checkpoint) or checkpoint, without the base (which
    is neither read nor checked); anything else is refused in one line."""
    path = Path(path)
    if not path.is_dir() or is_hf_export(path) or gguf_file(path) is not None:
        raise PhalanxError(f"{path} is not a LoRA run: only a LoRA run's checkpoints hold adapters")
    checkpoint, _ = _locate(path)
    state = read_trainer_state(checkpoint)
    args = _model_args(state, checkpoint)
    lora = lora_record(state, checkpoint)
    if lora is None:
        raise PhalanxError(
            f"{checkpoint} is not from a LoRA run (no lora settings in its {TRAINER_STATE}): it has no adapters"
        )
    with torch.device("meta"):  # the base stays on meta: only the adapters get memory and are read
        model = Transformer(args)
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if is_adapter(name):
                setattr(module, name, torch.nn.Parameter(torch.empty(param.shape, device="cpu")))
    load_model_weights(checkpoint, model)
    tensors = {name: param.detach() for name, param in model.named_parameters() if is_adapter(name)}
    return LoraAdapters(checkpoint, args, lora, tensors)
