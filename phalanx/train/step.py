"""One optimizer step, the same code for `phalanx train`, `phalanx bench` and the planner's memory
measurement (plan/measure.py), so that what is timed and measured is what trains.

A step: each micro-batch's forward (under the given autocast), the float32 cross-entropy, and its
backward, scaled by the number of micro-batches, with the gradient all-reduce (DDP) or reduce-scatter
(FSDP2) only on the last one; or, under pipeline parallelism, the pipeline schedule over the step's whole
share. Then the gradient norm (clipped to grad_clip when > 0), the optimizer step unless the hooks
decide otherwise, and zero_grad.

Supervision reaches a step only through StepHooks: a phase name before each part (the trainer's
heartbeats), the first forward (fault injection), a poisoned loss (fault injection) and the decision to
apply the update (the trainer's all-reduced loss and its numerics guard). Their defaults do nothing,
which is what bench and the planner run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from phalanx.data.sft_batches import IGNORE
from phalanx.models.token_pass import Packed
from phalanx.parallel.apply import gradient_sync
from phalanx.parallel.context_parallel import ContextParallel, NoContextParallel
from phalanx.parallel.distributed import all_reduce_sum
from phalanx.train.optim import clip_gradients

# (inputs, targets), each (batch, seq_len); fine-tuning adds positions, with targets -100 where a token is
# not trained (data/sft_batches.py).
Batch = tuple[torch.Tensor, ...]


_memory_kept: bool | None = None  # keep_freed_memory's outcome, once it has run


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep the memory a CPU training step frees for the next step's reuse, instead of
    handing it back to the kernel. Once per process (train_step calls it on CPU); True where it is in force.

    Why: a step allocates and frees the same activation- and logits-sized blocks every time. glibc serves
    blocks above its mmap threshold (128 KiB, raised by frees to at most 32 MiB) with a fresh mmap each and
    unmaps them on free, and trims the free top of its heap; every reuse then pays a page fault and the
    kernel's zeroing per 4 KiB page, which in a virtual machine costs more than the arithmetic on it. At the
    CPU bench's shape (nanoGPT's, bf16 autocast) a step took 150-160 thousand page faults (600 MB of fresh
    pages), and none from the third step on with this: steps 1.10-1.13x as fast in bf16 and in float32
    (bench/cpu_train_ab.py --arms malloc); torch.zeros(4096, 4096) takes 2.5 ms instead of 28 (one thread). With
    mmap off (M_MMAP_MAX 0) every block comes from the heap and goes back to its free lists, and with
    trimming off the heap keeps its pages: the process holds on to its peak, which every step reaches
    again anyway (peak RSS 1290 MB against 1256 MB at that shape).
    Numerics are untouched: only where tensors live changes. Other C libraries are left as they are."""
    global _memory_kept
    if _memory_kept is None:
        _memory_kept = False
        libc_name = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
        if libc_name and libc_name.startswith("glibc"):
            try:
                libc = ctypes.CDLL(None)
                m_trim_threshold, m_mmap_max = -1, -4  # malloc.h's M_TRIM_THRESHOLD and M_MMAP_MAX
                _memory_kept = bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
            except (OSError, AttributeError):  # no C library to open, or one without mallopt
                pass
    return _memory_kept


class StepHooks:
    """What a caller may do at a step's named points; the base class does nothing."""

    def phase(self, name: str) -> None:
        """Before each part of the step: "forward", "backward", "collective", "optimizer"."""

    def first_forward(self) -> None:
        """Inside the step's first forward (before any of its work)."""

    def poison_loss(self) -> bool:
        """Whether the first micro-batch's loss is to be made NaN."""
        return False

    def apply_update(self, loss_sum: torch.Tensor, parts: int, grad_norm: torch.Tensor) -> bool:
        """Whether to step the optimizer, given this rank's summed loss over `parts` micro-batches and the
        gradient norm."""
        return True


@dataclass
class StepOutcome:
    loss_sum: torch.Tensor  # this rank's sum of its micro-batches' mean losses (detached)
    parts: int  # how many micro-batches that sum is over
    grad_norm: torch.Tensor
    applied: bool  # whether the optimizer stepped


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    micro_batches: list[Batch],
    *,
    device: torch.device,
    grad_clip: float,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    split: ContextParallel | NoContextParallel = NoContextParallel(),
    measure: Callable[[], Any] = contextlib.nullcontext,
    pipeline: Any = None,
    pp_group: Any = None,
    hooks: StepHooks | None = None,
    trained_share: float | None = None,
) -> StepOutcome:
    """One step over this rank's micro-batches. split: this rank's share of each sequence and how its
    forward attends (context parallelism); measure: a context around this rank's own work (the straggler
    clock). trained_share: for fine-tuning batches, the step's trained tokens over all data-parallel ranks
    divided by their number (sft_loss_scale)."""
    hooks = hooks or StepHooks()
    if device.type == "cpu":
        keep_freed_memory()
    if pipeline is not None:
        loss_sum, parts = _pipeline_forward_backward(micro_batches, device, autocast, measure, pipeline, hooks)
    else:
        loss_sum, parts = torch.zeros((), device=device), len(micro_batches)
        for i, (inputs, targets, *positions) in enumerate(micro_batches):
            hooks.phase("forward")
            with gradient_sync(model, enabled=i == len(micro_batches) - 1):
                with measure():  # a rank's own work: backward may wait on its peers
                    if i == 0:
                        hooks.first_forward()
                    inputs = split.shard(inputs.to(device, non_blocking=True))
                    targets = split.shard(targets.to(device, non_blocking=True))
                    if positions:  # fine-tuning's packed rows (context parallelism is refused for them)
                        token_pass = Packed(positions[0].to(device, non_blocking=True))
                    else:
                        token_pass = split.token_pass()
                    with autocast():
                        logits = model(inputs, token_pass)
                        if trained_share is None:
                            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                        else:
                            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
                            loss = loss * (len(micro_batches) / trained_share)
                if i == 0 and hooks.poison_loss():
                    loss = loss * float("nan")
                hooks.phase("backward")
                (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
    hooks.phase("collective")
    grad_norm = clip_gradients(params, grad_clip, pp_group=pp_group)
    applied = hooks.apply_update(loss_sum, parts, grad_norm)
    hooks.phase("optimizer")
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(loss_sum, parts, grad_norm, applied)


def sft_loss_scale(micro_batches: list[Batch], device: torch.device) -> float | None:
    """For fine-tuning batches (targets -100 where not trained), the step's trained tokens summed over the
    data-parallel ranks, divided by their number; None for text batches. train_step divides each rank's
    summed loss by it: the gradients the ranks average are then those of the mean over every trained token
    of the step, however the tokens fall into rows, micro batches and ranks (so packing changes nothing).
    Collective over every rank: tensor-parallel ranks hold the same rows, so the sum over all ranks over
    their number is the same quotient (fine-tuning refuses pipeline and context parallelism)."""
    if len(micro_batches[0]) < 3:
        return None
    count = sum(int((y != IGNORE).sum()) for _, y, *_ in micro_batches)
    total = all_reduce_sum(torch.tensor([float(count)], dtype=torch.float64, device=device))
    world = dist.get_world_size() if dist.is_initialized() else 1
    return max(float(total), 1.0) / world  # a step without trained tokens: a zero loss, not a division by 0


def _pipeline_forward_backward(
    micro_batches: list[Batch],
    device: torch.device,
    autocast: Callable[[], Any],
    measure: Callable[[], Any],
    pipeline: Any,
    hooks: StepHooks,
) -> tuple[torch.Tensor, int]:
    """The schedule runs the step's whole share itself (split into parallel.pp_microbatches pieces): the
    sum of their mean losses on the last stage, else 0."""
    hooks.phase("forward")
    inputs = torch.cat([x for x, _ in micro_batches]).to(device, non_blocking=True)
    targets = torch.cat([y for _, y in micro_batches]).to(device, non_blocking=True)
    with measure():
        hooks.first_forward()
        with autocast():
            return pipeline.train_step(inputs, targets, poison=hooks.poison_loss()), pipeline.n_microbatches
