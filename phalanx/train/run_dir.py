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

import json
import shutil
import time
from pathlib import Path

from phalanx.config.loader import save_resolved
from phalanx.config.schema import Config
from phalanx.data.prepare import PreparedData, prepare_data
from phalanx.errors import PhalanxError


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def data_cache_dir(config: Config) -> Path:
    return config.run.dir / ".cache" / "data"


def prepare_run(config: Config, progress: bool = True) -> PreparedData:
    """Create the run directory, save the resolved config, tokenise the corpus (or reuse the cache).

    With `checkpoint.resume=never`, earlier checkpoints are moved aside (never deleted): a restart
    within this launch must continue from this launch's checkpoints only.
    """
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    old = checkpoints_dir(run_dir)
    if config.checkpoint.resume == "never" and old.is_dir() and any(old.iterdir()):
        old.rename(run_dir / f"checkpoints.before-{time.time_ns()}")
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
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash mid-write
    return records
