"""train_job: lock the run, prepare it, check it, preflight the job, make it observable, launch the node
agent, and report. `phalanx train` is this function behind a command line; a cluster launcher (Ray,
Slurm, Kubernetes) runs the same function on every node.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from phalanx.config.schema import Config
from phalanx.data.loader import check_batch_sizes
from phalanx.errors import PhalanxError
from phalanx.launch.local import LaunchSpec, launch
from phalanx.models.flops import count_params
from phalanx.models.from_config import model_args
from phalanx.observe.observer import observe_run
from phalanx.preflight.gate import node_preflight_before_restart, preflight_before_training, refuse_if_quarantined
from phalanx.preflight.thresholds import config_overrides
from phalanx.run.layout import RunDir
from phalanx.run.lock import run_lock
from phalanx.run.prepare import prepare_run, start_timeline
from phalanx.run.records import read_metrics
from phalanx.safe.goodput import run_report
from phalanx.train.trainer import check_run


def check_job(config: Config, spec: LaunchSpec) -> None:
    """What can be refused before anything is written: the launch options against the config."""
    spec.validate()
    if spec.world_sizes() != [1] and config.parallel.strategy == "none":
        raise PhalanxError("parallel.strategy=none runs one process; set parallel.strategy=ddp or fsdp for --nproc")
    for world_size in spec.world_sizes():  # an elastic job must fit every size it may shrink or grow to
        check_batch_sizes(config.train.global_batch_size, config.train.micro_batch_size, world_size)
    config_overrides(config.safe.preflight_thresholds)  # unknown check names, even with the preflight off


def train_job(config: Config, spec: LaunchSpec, progress: bool = True) -> dict[str, Any] | None:
    """Train (or resume) the run on this node's ranks. Returns the run's summary on the node that ran
    global rank 0, None on the others; raises a PhalanxError (with its exit code) when the job fails."""
    started = time.time()
    check_job(config, spec)
    run = RunDir(config.run_dir)
    owner = spec.node_rank == 0  # node 0 owns the run directory: the lock, and a new line of checkpoints
    with run_lock(run.path) if owner else contextlib.nullcontext():
        if owner:
            start_timeline(config)
        refuse_if_quarantined(config)  # before the data work: a quarantined node does nothing
        data = prepare_run(config, progress=progress)
        check_run(config, data)
        if config.safe.preflight != "off":
            preflight_before_training(config, spec, progress=progress)
        before_restart = node_preflight_before_restart(config, spec.nproc) if config.safe.preflight != "off" else None
        args = model_args(config.model, data.vocab_size, config.train.seq_len)
        model = f"{config.model.preset} ({count_params(args) / 1e6:,.1f}M)"
        with observe_run(config, spec.node_rank, spec.nproc * spec.node_range()[1], model, started):
            if not launch(spec, config, before_restart=before_restart):
                return None  # global rank 0 ran elsewhere: that node reports
    summary = json.loads(run.summary.read_text())
    summary.update(run_report(run.path, read_metrics(run.path), started, time.time()))
    run.summary.write_text(json.dumps(summary, indent=1))
    return summary
