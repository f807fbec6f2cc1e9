"""train_job: lock the run, prepare it, check it, preflight the job, make it observable, launch the node
agent, and report. `phalanx train` is this function behind a command line; a cluster launcher (Ray,
Slurm, Kubernetes) runs the same function on every node.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import torch

from phalanx.config.schema import Config
from phalanx.console import err, say
from phalanx.data.loader import check_batch_sizes
from phalanx.errors import FinalSaveFailedError, PhalanxError, StoppedBySignal
from phalanx.job.fresh_run_dir import owned_run_dir
from phalanx.launch.local import LaunchSpec, launch
from phalanx.models.flops import count_params
from phalanx.models.from_config import model_args
from phalanx.observe.availability import check_observe_settings
from phalanx.observe.observer import observe_run
from phalanx.parallel.float8 import check_float8
from phalanx.parallel.mesh import resolve_layout
from phalanx.preflight.gate import node_preflight_before_restart, preflight_before_training, refuse_if_quarantined
from phalanx.preflight.thresholds import config_overrides
from phalanx.run.checkpoints import checkpoint_step, latest_checkpoint, read_trainer_state
from phalanx.run.layout import RunDir
from phalanx.run.prepare import prepare_run, start_timeline
from phalanx.run.records import read_metrics
from phalanx.run.resolved import resolved
from phalanx.run.retention import apply_retention
from phalanx.safe.goodput import run_report
from phalanx.train.background_eval import check_eval_settings
from phalanx.train.checkpoint_space import free_now, low_space_warning
from phalanx.train.resume import check_run


def check_job(config: Config, spec: LaunchSpec) -> None:
    """What can be refused before anything is written: the launch options against the config."""
    spec.validate()
    if spec.world_sizes() != [1] and config.parallel.strategy == "none":
        raise PhalanxError("parallel.strategy=none runs one process; set parallel.strategy=ddp or fsdp for --nproc")
    for world_size in spec.world_sizes():  # an elastic job must fit every size it may shrink or grow to
        layout = resolve_layout(config.parallel, world_size)
        check_batch_sizes(config.train.global_batch_size, config.train.micro_batch_size, layout.dp)
    config_overrides(config.safe.preflight_thresholds)  # unknown check names, even with the preflight off
    check_observe_settings(config)  # a store, /metrics or TensorBoard asked for that this install lacks
    check_eval_settings(config)  # eval.tasks: the harness's extras, a local task folder that is there
    if config.train.dtype == "float8" and (config.parallel.device == "cpu" or not torch.cuda.is_available()):
        check_float8(torch.device("cpu"))  # refused here, in one line; the ranks check their GPUs' kind


def train_job(config: Config, spec: LaunchSpec, progress: bool = True) -> dict[str, Any] | None:
    """Train (or resume) the run on this node's ranks. Returns the run's summary on the node that ran
    global rank 0, None on the others; raises a PhalanxError (with its exit code) when the job fails.
    What it is doing is said on stderr, a line at a time."""
    started = time.time()
    check_job(config, spec)
    run = RunDir(config.run_dir)
    owner = spec.node_rank == 0  # node 0 owns the run directory: the lock, and a new line of checkpoints
    # A launch refused before anything ran (bad data, a model the checkpoint does not fit, Ctrl-C while
    # preparing) leaves no run directory behind that it made; from the preflight on, the run has a record.
    with owned_run_dir(config, owner) as keep:
        if owner:
            start_timeline(config)
            apply_retention(run.path)  # empty stack files, old corrupt-step_* directories
        refuse_if_quarantined(config)  # before the data work: a quarantined node does nothing
        say(f"preparing data for {run.path}")
        data = prepare_run(config, progress=progress and err.is_terminal)  # a spinner: terminals only
        examples = (
            f" in {data.examples['train']:,} and {data.examples['val']:,} fine-tuning examples"
            if data.kind == "sft"
            else ""
        )
        say(
            f"data: {data.train_tokens:,} training and {data.val_tokens:,} validation tokens{examples}, "
            f"vocabulary {data.vocab_size:,}"
        )
        done = _already_done(config, run, check_run(config, data))
        if done is not None:
            return done if owner else None
        keep()
        if config.safe.preflight != "off":
            preflight_before_training(config, spec, progress=progress)
        before_restart = node_preflight_before_restart(config, spec.nproc) if config.safe.preflight != "off" else None
        args = model_args(config.model, data.vocab_size, config.train.seq_len)
        model = f"{config.model.preset} ({count_params(args) / 1e6:,.1f}M)"
        if owner and (low := low_space_warning(run.checkpoints, count_params(args))):
            say(f"warning: {low}")
        world = spec.nproc * spec.node_range()[1]
        say(_starting_line(config, spec, model))
        # The store (and the dashboard) show what the run trains: the preset's shape, the micro batch.
        shown = resolved(config, data.vocab_size, resolve_layout(config.parallel, world).dp)
        with observe_run(shown, spec.node_rank, world, model, started):
            if not _launch(spec, config, before_restart, run):
                return None  # global rank 0 ran elsewhere: that node reports
            _refuse_an_unsaved_end(run)  # inside observe_run: the store records the failure
    summary = json.loads(run.summary.read_text())
    summary.update(run_report(run.path, read_metrics(run.path), started, time.time()))
    run.summary.write_text(json.dumps(summary, indent=1))
    return summary


def _refuse_an_unsaved_end(run: RunDir) -> None:
    """A run whose last save failed (a full disk) has trained steps no checkpoint holds: not a success."""
    failed = json.loads(run.summary.read_text()).get("final_save_failed")
    if failed:
        newest = latest_checkpoint(run.checkpoints)
        resumes = f"step {checkpoint_step(newest)}" if newest else "step 0 (no checkpoint was saved)"
        raise FinalSaveFailedError(
            f"the final checkpoint (step {failed['step']}) could not be saved: "
            f"{failed['error']}; {free_now(run.checkpoints)}free space and rerun: the same "
            f"command resumes from {resumes}"
        )


def _launch(spec: LaunchSpec, config: Config, before_restart: Any, run: RunDir) -> bool:
    """launch(), with a stop by a signal (Ctrl-C, a scheduler's SIGTERM) told as where the run resumes."""
    try:
        return launch(spec, config, before_restart=before_restart)
    except StoppedBySignal as exc:
        newest = latest_checkpoint(run.checkpoints)
        where = f"step {checkpoint_step(newest)} ({newest})" if newest else "step 0 (no checkpoint yet)"
        name = "SIGINT (Ctrl-C)" if exc.exit_code == 128 + signal.SIGINT else signal.Signals(exc.exit_code - 128).name
        stopped = StoppedBySignal(exc.exit_code - 128)
        stopped.args = (f"stopped by {name}; the same command resumes from {where}",)
        raise stopped from None


def _already_done(config: Config, run: RunDir, resume: Path | None) -> dict[str, Any] | None:
    """The run's summary when its checkpoint is already at the step this launch would end at (nothing to
    train, and the summary of the run that got there is kept); None when there is training to do."""
    if resume is None:
        return None
    state = read_trainer_state(resume)
    step, tc = int(state["step"]), config.train
    if step > tc.max_steps:
        raise PhalanxError(
            f"train.max_steps={tc.max_steps} is below the step of the newest checkpoint, {step} "
            f"({resume}); raise train.max_steps, or start over with checkpoint.resume=never"
        )
    end = tc.halt_at_step or tc.max_steps
    if step < end:
        return None
    if step >= tc.max_steps:
        say(
            f"{run.path} is already at step {step} of {tc.max_steps}; nothing to do (raise train.max_steps to train on)"
        )
    else:
        say(
            f"{run.path} is already at step {step}, train.halt_at_step={end}; nothing to do (raise or drop "
            "train.halt_at_step to train on)"
        )
    try:
        summary = json.loads(run.summary.read_text())
    except (OSError, ValueError):
        summary = {}
    if summary.get("steps") == step:
        return summary
    # No summary of that step (a launch stopped after its last save): what the checkpoint knows.
    return {
        "run_dir": str(run.path),
        "steps": step,
        "tokens_seen": step * tc.global_batch_size * tc.seq_len,
        "val_loss_start": state.get("val_loss_start"),
        "val_loss_final": state.get("val_loss"),
        "train_loss_final": state.get("train_loss"),
        "last_checkpoint": str(resume),
        "halted": step < tc.max_steps,
    }


def _starting_line(config: Config, spec: LaunchSpec, model: str) -> str:
    tc = config.train
    n, (low, high) = spec.nproc, spec.node_range()
    where = f" on this node (node {spec.node_rank} of {low if low == high else f'{low}-{high}'})" if high > 1 else ""
    ranks = spec.world_sizes()[0]
    layout = resolve_layout(config.parallel, ranks)
    how = (layout.describe() if layout.model_parallel > 1 else config.parallel.strategy) if ranks > 1 else "one process"
    micro = tc.micro_batch(layout.dp)
    accumulation = tc.global_batch_size // (micro * layout.dp) if micro else 1
    batch = f"{tc.global_batch_size} x {tc.seq_len} tokens" + (
        f" ({accumulation} micro-batches of {micro} per rank)" if accumulation > 1 else ""
    )
    return f"starting {n} rank{'s' if n > 1 else ''}{where} ({how}): {model} params, {tc.max_steps} steps of {batch}"
