"""`model.pretrained` naming a model phalanx trained (a run directory, one of its checkpoints) or a GGUF
export: converted once into the new run's base/ as a Hugging Face checkpoint, which the run then starts
from as from any other.

A conversion rather than a second way to read pretrained weights: everything that reads a pretrained
model (each rank's sharded load through DCP's Hugging Face reader, the architecture and the tokenizer,
the digest in pretrained.json, a LoRA run's base read back by the model loader and by export) reads one
format. The copy costs the model's size on disk once, and the run no longer depends on the other one:
its newer checkpoints, or its removal, change nothing here. The conversion loads the whole model in one
process on the CPU (the model loader), so the source must fit in this machine's memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from phalanx.config.schema import Config
from phalanx.console import say
from phalanx.errors import PhalanxError
from phalanx.run.gguf_format import gguf_file
from phalanx.run.hf_format import is_hf_export
from phalanx.run.layout import RunDir, is_checkpoint_dir

SOURCE_RECORD = "phalanx_source.json"  # in base/: what it was converted from


def resolve_pretrained(config: Config) -> None:
    """Point config.model.pretrained at a Hugging Face checkpoint: itself when it is one, else its
    conversion in RUN_DIR/base (made by the run's first launch, reused by later ones). Called where a
    command loads its config, before any launcher: the nodes and ranks all get the converted path."""
    if config.model.pretrained is not None:
        config.model.pretrained = str(base_checkpoint(Path(config.model.pretrained), RunDir(config.run_dir)))


def base_checkpoint(source: Path, run: RunDir) -> Path:
    """The Hugging Face checkpoint a run starts from `source`."""
    source, base = Path(source).expanduser().absolute(), run.base.absolute()
    if source == base:
        return base  # the saved config of a run that was converted
    if source == run.path.absolute() or run.path.absolute() in source.parents:
        raise PhalanxError(f"model.pretrained={source} is this run's own directory; name another run")
    if not source.exists():
        raise PhalanxError(
            f"model.pretrained={source} does not exist: name a Hugging Face checkpoint, or a run phalanx "
            "trained (train it first)"
        )
    if not _phalanx_model(source):
        return source  # a Hugging Face checkpoint (the checkpoint's reader says in one line what it lacks)
    if is_hf_export(base):
        converted_from = _converted_from(base)
        if converted_from != str(source):
            raise PhalanxError(
                f"{base} was converted from {converted_from}, not model.pretrained={source}; give this run "
                f"another run.name, or remove {base} to start from the new source"
            )
        return base
    _convert(source, base)
    return base


def _phalanx_model(path: Path) -> bool:
    """A run directory, a checkpoint directory or a GGUF export, rather than a Hugging Face checkpoint."""
    if is_hf_export(path):
        return False
    return RunDir(path).config.is_file() or is_checkpoint_dir(path) or gguf_file(path) is not None


def _converted_from(base: Path) -> str | None:
    try:
        return json.loads((base / SOURCE_RECORD).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _convert(source: Path, base: Path) -> None:
    """Write `source` as a float32 Hugging Face checkpoint at `base`, atomically: into a hidden sibling,
    renamed into place once complete. Where another node of the run got there first, its copy stands."""
    from phalanx.extras import require

    require("export", f"model.pretrained={source} (a model phalanx trained, converted to safetensors)")
    from phalanx.export.hf import write_hf_export
    from phalanx.run.model_loader import load_model

    try:
        loaded = load_model(source)
    except PhalanxError as e:
        raise PhalanxError(f"model.pretrained={source}: {e}") from None
    tmp = base.with_name(f".{base.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_hf_export(loaded, tmp, "f32")  # float32: the weights exactly as trained on a CPU
        record = {"source": str(source), "checkpoint": str(Path(loaded.checkpoint).absolute())}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        try:
            tmp.rename(base)
        except OSError:
            if not is_hf_export(base):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"converted {loaded.checkpoint} to a Hugging Face checkpoint in {base}, to start from")
