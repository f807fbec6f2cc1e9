"""Preparing a run directory before any rank starts: the resolved config, the data, the tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from phalanx.config.loader import dump_yaml
from phalanx.config.schema import Config
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.errors import PhalanxError
from phalanx.run.layout import RunDir, data_cache_dir


def save_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config next to the run's outputs (atomically), so the run can be repeated."""
    target = RunDir(run_dir).config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # several nodes may write it at once
    tmp.write_text(dump_yaml(config))
    tmp.replace(target)
    return target


def prepare_run(config: Config, progress: bool = True) -> PreparedData:
    """Create the run directory, save the resolved config, tokenise the corpus (or reuse the cache)."""
    run = RunDir(config.run_dir)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run.path}: {exc.strerror}") from None
    save_config(config, run.path)
    d = config.data
    data = prepare_data(
        d.sources,
        Path.cwd(),
        data_cache_dir(config.run.dir),
        d.vocab_size,
        d.tokenizer,
        d.val_fraction,
        d.text_field,
        progress=progress,
    )
    shutil.copyfile(data.tokenizer_path, run.tokenizer)
    run.data_pointer.write_text(json.dumps({"prepared": str(data.dir)}))
    return data


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
