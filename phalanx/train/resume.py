"""Where an attempt resumes from: the one module that decides, the same on every rank, and says why.

The candidates, newest first:
  1. an in-memory snapshot every rank holds (this launch's own, or a peer's copy for a replaced node:
     memory_checkpoint.py), when it is newer than the newest sound checkpoint on disk;
  2. the newest sound checkpoint in the run directory, its files checked against its manifest by all
     ranks in parallel; corrupt ones are set aside, each with an event;
  3. the checkpoint `checkpoint.resume` names, when the run directory has none;
  4. step 0, which corrupt checkpoints with nothing sound left refuse (exit 2) unless checkpoint.resume
     is never, rather than retrain silently.
A restart, a re-formed group and the numerics guard's rollback take this same decision (resume_point).
Before the ranks start, check_run looks at the same files to refuse what they would refuse, in one line
from the launcher. The node agent's restart notice estimates the step from the same places without
verifying them (launch/local.py), so verification can still choose an older one: the ranks'
`checkpoint_loaded` event is the answer.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.config.schema import Config
from phalanx.data.datasets import split_datasets
from phalanx.data.prepare import PreparedData
from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.from_config import model_args
from phalanx.parallel.context_parallel import check_cp
from phalanx.parallel.distributed import DistEnv
from phalanx.parallel.pipeline import check_pipeline
from phalanx.parallel.tensor_parallel import check_tp
from phalanx.run.checkpoints import (
    check_model_shape,
    incomplete_checkpoints,
    list_checkpoints,
    newest_valid_checkpoint,
    read_trainer_state,
    verify_checkpoint,
)
from phalanx.run.layout import RunDir
from phalanx.run.records import JsonlEventSink
from phalanx.run.safe_dcp import check_metadata
from phalanx.safe.heartbeat import Heartbeat
from phalanx.train.checkpoint import Checkpointer, verify_in_parallel
from phalanx.train.memory_checkpoint import MemorySnapshots


@dataclass(frozen=True)
class ResumePoint:
    """What an attempt continues from, once loaded into the model and optimizer."""

    step: int
    source: str  # "memory", "disk" or "start"
    loaded_from: Path | None  # the snapshot's sidecar or the checkpoint directory; None at the start
    newest_on_disk: Path | None  # the newest sound checkpoint (what a memory resume is newer than)
    disk_step: int  # that checkpoint's step; 0 when there is none
    state: dict[str, Any]  # the trainer state (loader position, guard, losses); {} at the start
    seconds: float  # how long the load took

    def describe(self) -> str:
        """One line for the console: where from, and why that one."""
        if self.source == "memory":
            disk = f"step {self.disk_step}" if self.newest_on_disk else "none"
            return f"resuming from the in-memory snapshot of step {self.step} (newest checkpoint on disk: {disk})"
        if self.source == "disk":
            return f"resuming from step {self.step} (checkpoint {self.loaded_from})"
        return "starting at step 0 (no checkpoint to resume from)"


def resume_point(
    config: Config,
    env: DistEnv,
    events: JsonlEventSink | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpointer: Checkpointer,
    snapshots: MemorySnapshots,
    model_shape: dict[str, Any],
    heartbeat: Heartbeat,
) -> ResumePoint:
    """Decide where this attempt resumes (the module's order) and load it into `model` and `optimizer`
    (and the RNG). Collective: every rank calls it and gets the same answer."""
    disk = resume_path(config, env, events)
    disk_step = int(read_trainer_state(disk)["step"]) if disk is not None else 0
    if config.checkpoint.memory_interval != 0:
        heartbeat.beat("checkpoint")
        loaded = snapshots.resume(model, optimizer, disk_step, model_shape)
        if loaded is not None:
            return ResumePoint(loaded.step, "memory", loaded.path, disk, disk_step, loaded.state, loaded.seconds)
    if disk is None:
        return ResumePoint(0, "start", None, None, 0, {}, 0.0)
    check_model_shape(disk, model_shape)
    heartbeat.beat("checkpoint")
    t0 = time.perf_counter()
    state = checkpointer.load(disk, model, optimizer)
    return ResumePoint(state["step"], "disk", disk, disk, disk_step, state, time.perf_counter() - t0)


def resume_path(config: Config, env: DistEnv, events: JsonlEventSink | None = None) -> Path | None:
    """The checkpoint the ranks continue from, the same on every rank, on any attempt.

    The run directory's newest sound checkpoint: with `checkpoint.resume` set to `never` or a path, the
    launcher moved older ones aside (run.prepare.start_timeline), so whatever is there was written by this
    launch, and restarts or a re-formed group continue from it. With none there, `never` starts at step
    0 and a path loads that checkpoint. Every rank checks its share of a candidate's files against the
    manifest, in parallel (the directory is shared); rank 0 sets corrupt ones aside and says so, on the
    console and as an event each, and names step directories without a manifest, which it skips. When
    corrupt checkpoints leave none to resume from, starting over at step 0 needs checkpoint.resume=never:
    otherwise the ranks stop with the reason (exit 2) rather than retrain silently.
    """
    root = RunDir(config.run_dir).checkpoints
    corrupt: list[str] = []

    def report(path: Path, reason: str) -> None:
        corrupt.append(f"{path.name}: {reason}")
        _warn(f"checkpoint {path} is corrupt ({reason}); set aside as corrupt-{path.name}")
        if events is not None:
            events.emit("checkpoint_corrupt", rank=0, path=str(path), reason=reason)

    if env.is_main:
        for path in incomplete_checkpoints(root):
            _warn(f"{path} has no manifest (a save never finishes without one); it is skipped")
            if events is not None:
                events.emit("checkpoint_incomplete", rank=0, path=str(path))
    found: list[Any] = [
        newest_valid_checkpoint(
            root, report if env.is_main else None, verify=lambda path: verify_in_parallel(path, env)
        )
    ]
    if env.is_main and found[0] is None:
        found[0] = explicit_checkpoint(config)
        if found[0] is None and corrupt and config.checkpoint.resume != "never":
            raise PhalanxError(
                f"no sound checkpoint is left to resume from ({'; '.join(corrupt)}); set "
                "checkpoint.resume=never to start over from step 0"
            )
    if env.distributed:
        dist.broadcast_object_list(found, src=0)
    return found[0]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def explicit_checkpoint(config: Config) -> Path | None:
    """The checkpoint named by `checkpoint.resume` (which must be sound), or None for auto and never."""
    if config.checkpoint.resume in ("auto", "never"):
        return None
    path = Path(config.checkpoint.resume)
    read_trainer_state(path)  # a clear error now rather than deep inside DCP
    reason = verify_checkpoint(path)
    if reason:
        raise PhalanxError(f"checkpoint {path} cannot be trusted: {reason}")
    return path


def check_fine_tuning_layout(parallel) -> None:
    """Fine-tuning rows carry each token's position in its example, which neither a pipeline stage's
    inputs nor context parallelism's sequence shards pass on yet: refused in one line."""
    for key in ("pp", "cp"):
        if getattr(parallel, key) > 1:
            raise PhalanxError(
                f"fine-tuning data (data.kind: sft) does not run with parallel.{key} > 1 yet; use data, "
                "tensor or fully sharded parallelism (parallel.strategy, parallel.tp)"
            )


def check_lora(config: Config) -> None:
    """LoRA adapts a pretrained model, in layouts it is tested under: anything else refused in one line."""
    if not config.lora.rank:
        return
    if config.model.pretrained is None:
        raise PhalanxError("lora.rank needs model.pretrained: LoRA adapts a pretrained model's weights")
    if config.parallel.pp > 1:
        raise PhalanxError(
            "LoRA (lora.rank) does not run with parallel.pp > 1 yet; use data, tensor or FSDP parallelism"
        )
    if config.train.dtype == "float8":
        raise PhalanxError("LoRA (lora.rank) does not run with train.dtype float8; use bfloat16 or float32")
    if config.lora.quantize_base:
        check_qlora(config)


def check_moe(config: Config, shape: ModelArgs) -> None:
    """A mixture of experts trains on one process, with DDP, or with FSDP (and expert parallelism over
    its shard ranks), tensor, pipeline and context parallelism, compiled or not, and takes LoRA on its
    attention: context parallelism with expert parallelism or latent attention is refused in one line
    until it is built and tested, and so is what LoRA cannot adapt yet; parallel.ep needs experts it can
    split evenly."""
    p = config.parallel
    if p.ep > 1 and not shape.n_experts:
        raise PhalanxError(f"parallel.ep={p.ep} splits a mixture of experts' experts, and this model has none")
    if not shape.n_experts:
        return
    if shape.n_experts % p.ep:
        raise PhalanxError(f"parallel.ep={p.ep} does not divide the model's {shape.n_experts} experts")
    if p.cp > 1 and (p.ep > 1 or shape.attention == "mla"):
        what = "parallel.ep" if p.ep > 1 else "multi-head latent attention (DeepSeek-V3)"
        raise PhalanxError(
            f"a mixture of experts ({shape.n_experts} experts) does not run with parallel.cp and {what} yet; "
            "context parallelism takes its experts whole on every cp rank"
        )
    if config.lora.rank:
        check_moe_lora(config, shape)


def check_moe_lora(config: Config, shape: ModelArgs) -> None:
    """LoRA adapts a mixture of experts' attention projections, the experts and the router frozen (as
    most Mixtral fine-tunes do): the experts are stacked weights, not the linear layers LoRA wraps."""
    refusal = None
    if shape.attention == "mla":
        refusal = "LoRA does not adapt multi-head latent attention (DeepSeek-V3) yet"
    elif config.lora.targets != "attention":
        refusal = (
            f"LoRA on a mixture of experts adapts its attention only (lora.targets attention, not "
            f"{config.lora.targets}): the experts are stacked weights, not linear layers"
        )
    elif config.parallel.ep > 1:
        refusal = "LoRA on a mixture of experts does not run with parallel.ep yet; use FSDP or data parallelism"
    elif config.lora.quantize_base:
        refusal = "lora.quantize_base (QLoRA) does not quantize a mixture of experts' experts yet"
    if refusal:
        raise PhalanxError(refusal)


def check_qlora(config: Config) -> None:
    """QLoRA needs torchao, and weights that are whole on each rank (NF4 is not sharded here)."""
    from phalanx.models.lora import import_nf4

    parallel = config.parallel
    if import_nf4() is None:
        raise PhalanxError(
            "lora.quantize_base needs torchao's NF4, and torchao is not installed: pip install torchao "
            "(or train the adapters on the full-precision base: lora.quantize_base=false)"
        )
    if parallel.tp > 1 or parallel.strategy == "fsdp" or parallel.dp_shard not in (None, 1):
        raise PhalanxError(
            "lora.quantize_base (QLoRA) runs on one process or with data parallelism (parallel.strategy: "
            "ddp), not yet with FSDP or tensor parallelism"
        )


def check_run(config: Config, data: PreparedData) -> Path | None:
    """What the ranks would refuse, checked once before they start, so it is one line from the launcher:
    the model's shape, data enough for a sequence, and the shape and safe metadata of the checkpoint it
    would resume (the newest whose trainer state reads; the ranks verify its files), which it returns."""
    if data.kind == "sft":
        check_fine_tuning_layout(config.parallel)
    check_lora(config)
    shape = model_args(config.model, data.vocab_size, config.train.seq_len)
    check_moe(config, shape)
    if config.parallel.tp > 1:
        check_tp(shape, config.parallel.tp)
    if config.parallel.pp > 1:  # a set micro-batch size does not depend on the ranks: checked here too
        check_pipeline(shape, config.parallel, config.train.micro_batch_size)
    check_cp(config.parallel.cp, config.train.seq_len, config.train.compile)
    args = dataclasses.asdict(shape)
    split_datasets(data, config.train.seq_len, config.data.sft.pack)
    for path in reversed(list_checkpoints(RunDir(config.run_dir).checkpoints)):
        try:
            read_trainer_state(path)
        except PhalanxError:
            continue  # unreadable: the ranks will set it aside
        check_model_shape(path, args)
        check_metadata(path)  # a crafted checkpoint is refused here, before any rank could open it
        return path
    explicit = explicit_checkpoint(config)
    if explicit is not None:
        check_model_shape(explicit, args)
        check_metadata(explicit)
    return explicit
