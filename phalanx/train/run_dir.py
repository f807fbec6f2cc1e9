"""What lives in a run directory, and preparing one before any rank starts.

RUN_DIR/
  config.yaml      the resolved config (repeat, resume, export or serve from it)
  tokenizer.json   the run's tokenizer
  data.json        where the prepared token shards are (a content-addressed cache shared by runs)
  metrics.jsonl    one JSON object per step
  events.jsonl     faults, detections, restarts, rollbacks, checkpoints, stragglers (phalanx/safe/events.py)
  summary.json     the last summary of `phalanx train`
  stacks/          Python stacks of ranks caught hanging
  checkpoints/     step_XXXXXXXX/ directories
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from phalanx.config.loader import save_resolved
from phalanx.config.schema import Config
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.errors import PhalanxError
from phalanx.train.metrics import read_jsonl


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


RANKS_DIR = "ranks"


def rank_timings_file(run_dir: Path, rank: int) -> Path:
    """Each rank's own step timings (JSON lines), which the node agent copies into the run store."""
    return run_dir / RANKS_DIR / f"rank_{rank}.jsonl"


def data_cache_dir(config: Config) -> Path:
    return config.run.dir / ".cache" / "data"


def start_timeline(config: Config) -> None:
    """With `checkpoint.resume` set to `never` or a path, this launch starts a new line of checkpoints:
    the run's earlier ones are moved to checkpoints.before-<ns>/ (never deleted), so that a restart
    continues from this launch's own checkpoints and keep-rotation never mixes the two lines."""
    old = checkpoints_dir(config.run_dir)
    if config.checkpoint.resume == "auto" or not old.is_dir() or not any(old.iterdir()):
        return
    aside = config.run_dir / f"checkpoints.before-{time.time_ns()}"
    old.rename(aside)
    resume = Path(config.checkpoint.resume)
    if resume.is_relative_to(old):  # the named checkpoint moved with the others
        config.checkpoint.resume = str(aside / resume.relative_to(old))


def prepare_run(config: Config, progress: bool = True) -> PreparedData:
    """Create the run directory, save the resolved config, tokenise the corpus (or reuse the cache)."""
    run_dir = config.run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    save_resolved(config, run_dir)
    d = config.data
    data = prepare_data(d.sources, Path.cwd(), data_cache_dir(config), d.vocab_size, d.tokenizer,
                        d.val_fraction, d.text_field, progress=progress)
    shutil.copyfile(data.tokenizer_path, run_dir / "tokenizer.json")
    (run_dir / "data.json").write_text(json.dumps({"prepared": str(data.dir)}))
    return data


def prepared_data(run_dir: Path) -> PreparedData:
    try:
        return PreparedData.load(Path(json.loads((run_dir / "data.json").read_text())["prepared"]))
    except FileNotFoundError:
        raise PhalanxError(f"{run_dir} has no prepared data; run `phalanx data prepare` or `phalanx train`") from None


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Held by `phalanx train` for the whole launch: a second launch on the same run directory would
    rewrite the config its ranks re-read on restart, and could move its live checkpoints aside."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / ".lock", "a+")
    except OSError as exc:
        raise PhalanxError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PhalanxError(f"{run_dir} is in use by another `phalanx train`; wait for it or pick "
                               "another run.name") from None
        yield
