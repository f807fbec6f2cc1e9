"""Preparing a run directory before any rank starts: the resolved config, the data, the tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from phalanx.config.loader import dump_yaml
from phalanx.config.schema import Config
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.data.sft import SftOptions
from phalanx.errors import PhalanxError
from phalanx.models.from_config import pretrained_args
from phalanx.run.layout import RunDir, data_cache_dir


def save_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config next to the run's outputs (atomically), so the run can be repeated."""
    target = RunDir(run_dir).config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # several nodes may write it at once
    tmp.write_text(dump_yaml(config))
    tmp.replace(target)
    return target


def prepare_run(config: Config, progress: bool = True, ray_address: str | None = None) -> PreparedData:
    """Create the run directory, save the resolved config, tokenise the corpus (or reuse the cache).
    ray_address: tokenise as tasks on that Ray cluster (`phalanx data prepare --ray-address`)."""
    run = RunDir(config.run_dir)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run.path}: {exc.strerror}") from None
    if config.model.pretrained is not None:  # the ranks and a later resume read it from the saved config
        config.model.pretrained = str(Path(config.model.pretrained).expanduser().absolute())
    save_config(config, run.path)
    d = config.data
    tokenizer, vocab_size = d.tokenizer, d.vocab_size
    if config.model.pretrained is not None:
        if tokenizer is not None:
            raise PhalanxError(
                "data.tokenizer and model.pretrained both name a tokenizer: a pretrained model is trained "
                "with its own (its tokenizer.json); remove data.tokenizer"
            )
        tokenizer = str(record_pretrained(Path(config.model.pretrained), run) / "tokenizer.json")
        vocab_size = pretrained_args(Path(config.model.pretrained)).vocab_size  # its tokenizer's ids fit in it
    data = prepare_data(
        d.sources,
        Path.cwd(),
        data_cache_dir(config.run.dir),
        vocab_size,
        tokenizer,
        d.val_fraction,
        d.text_field,
        progress=progress,
        sft=sft_options(config),
        workers=d.workers,
        ray_address=ray_address,
        tokenizer_sample_bytes=d.tokenizer_sample_bytes,
    )
    shutil.copyfile(data.tokenizer_path, run.tokenizer)
    keep_tokenizer_companions(data.tokenizer_path.parent, run)
    run.data_pointer.write_text(json.dumps({"prepared": str(data.dir)}))
    return data


def sft_options(config: Config) -> SftOptions | None:
    """How fine-tuning records become examples (None for text): data.sft, and the longest example a row of
    train.seq_len + 1 tokens holds."""
    if config.data.kind != "sft":
        return None
    s = config.data.sft
    return SftOptions(s.shape, s.train_on_prompts, s.too_long, max_tokens=config.train.seq_len + 1)


def keep_tokenizer_companions(source: Path, run: RunDir) -> None:
    """Copy the files that came with the run's tokenizer (a checkpoint's tokenizer_config.json,
    generation_config.json, ...: kept beside it in the prepared data) into the run, so that serve,
    generate, chat and export of the run use the checkpoint's special tokens, stop ids and chat template;
    remove any an earlier tokenizer of this run left, which would name tokens this one may lack."""
    for target in run.tokenizer_companions():
        kept = Path(source) / target.name
        if kept.is_file():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # several nodes may write it at once
            shutil.copyfile(kept, tmp)
            tmp.replace(target)
        else:
            target.unlink(missing_ok=True)


# The files of a Hugging Face checkpoint that decide what a run starting from it computes.
_CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.jinja")


def pretrained_files(checkpoint: Path) -> list[Path]:
    """The files of the checkpoint the digest covers (its JSON, safetensors and template files), by name."""
    return sorted({f for pattern in _CHECKPOINT_FILES for f in Path(checkpoint).glob(pattern) if f.is_file()})


def pretrained_digest(checkpoint: Path) -> str:
    """SHA-256 over the checkpoint's pretrained_files (name, size and content of each, in name order): what
    RUN_DIR/pretrained.json records, and a LoRA checkpoint's `base` (the model loader checks it again)."""
    digest = hashlib.sha256()
    for f in pretrained_files(checkpoint):
        digest.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with f.open("rb") as stream:
            while chunk := stream.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def record_pretrained(checkpoint: Path, run: RunDir) -> Path:
    """Write the run's pretrained.json: the checkpoint's absolute path and its pretrained_digest, so a run
    says exactly which weights it started from. The hash is taken again only when a file's size or time
    changed since the record (a relaunch does not re-read gigabytes). Returns the checkpoint's absolute
    path."""
    checkpoint = checkpoint.expanduser().absolute()
    if not checkpoint.is_dir():
        raise PhalanxError(f"model.pretrained={checkpoint} is not a directory (a Hugging Face checkpoint)")
    stamps = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in pretrained_files(checkpoint)}
    try:
        old = json.loads(run.pretrained.read_text())
        if old.get("path") == str(checkpoint) and old.get("files") == stamps:
            return checkpoint
    except (OSError, ValueError):
        pass
    record = {"path": str(checkpoint), "sha256": pretrained_digest(checkpoint), "files": stamps}
    tmp = run.pretrained.with_name(f".{run.pretrained.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(run.pretrained)
    return checkpoint


def prepared_data(run_dir: Path) -> PreparedData:
    try:
        return PreparedData.load(Path(json.loads(RunDir(run_dir).data_pointer.read_text())["prepared"]))
    except FileNotFoundError:
        raise PhalanxError(f"{run_dir} has no prepared data; run `phalanx data prepare` or `phalanx train`") from None


def start_timeline(config: Config) -> None:
    """With `checkpoint.resume` set to `never` or a path, this launch starts a new line of checkpoints:
    the run's earlier ones are moved to checkpoints.before-<ns>/ (never deleted), so that a restart
    continues from this launch's own checkpoints and keep-rotation never mixes the two lines."""
    run = RunDir(config.run_dir)
    old = run.checkpoints
    if config.checkpoint.resume == "auto" or not old.is_dir() or not any(old.iterdir()):
        return
    aside = run.checkpoints_aside(time.time_ns())
    old.rename(aside)
    resume = Path(config.checkpoint.resume)
    if resume.is_relative_to(old):  # the named checkpoint moved with the others
        config.checkpoint.resume = str(aside / resume.relative_to(old))
