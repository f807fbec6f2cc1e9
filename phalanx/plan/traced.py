"""Measure one rank's peak memory of a real parallelised training step without the hardware.

The model is built exactly as training builds it (parallel/build.py: meta device, tensor parallelism,
activation checkpointing, FSDP2 with its mixed precision), on a fake process group of the job's world
size with one rank simulated in this process (torch's `fake` backend: collectives return at once and
move nothing). It is then allocated under FakeTensorMode (tensors with shapes and no storage) and two
optimizer steps of what the trainer runs (forward, float32 cross-entropy, backward, gradient clipping,
AdamW, zero_grad) are traced by torch's FSDP memory tracker, which counts the bytes of every tensor
as it is created and freed, by kind (sharded/unsharded parameters and gradients, activations,
optimizer states, collective buffers). So a 70B model on 64 ranks is measured in seconds on a laptop.

What this cannot see, and the hand model (memory.py) adds: pipeline schedules (one stage is traced
with one micro-batch in flight), context parallelism's ring buffers, and allocations that never
surface as an op's output (kernel workspaces; the collective library's own buffers belong to the
headroom). The fake process group copies nothing, as NCCL/RCCL do not: on CPU, gloo's copies of a
collective's buffers are not in these numbers (tests/plan compares against real gloo steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs

# FSDPMemTracker's kinds, grouped as the hand model reports them (memory.CATEGORIES).
_KIND_TO_CATEGORY = {
    "Sharded Param": "parameters",
    "Buffer": "parameters",
    "Parameter": "parameters",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer states",
    "Optstate": "optimizer states",
    "Unsharded Param": "gathered/cast weights",
    "Activation": "activations",
    "Inputs": "activations",
    "Unsharded Grad": "temporaries",
    "Temp": "temporaries",
    "All Gather": "temporaries",
    "Reduce Scatter": "temporaries",
}


@dataclass(frozen=True)
class TracedStep:
    peak_bytes: int
    at_peak: dict[str, int]  # what was live at the peak, by the hand model's categories
    activations: int  # live after the forward of the steady-state step (saved tensors, logits, tokens)
    # The peak up to the end of backward: above it, the rest of `peak_bytes` came from gradient clipping
    # and the optimizer step (under FSDP x TP, clipping's norm gathers whole gradients: see the README).
    through_backward_bytes: int
    seconds: float  # how long building and tracing took here


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of `world_size` ranks for the duration: this process plays `rank`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise PhalanxError("the traced plan needs a process of its own: a process group is already set up")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trace_step(
    args: ModelArgs,
    *,
    dp_replicate: int = 1,
    dp_shard: int = 1,
    tp: int = 1,
    ep: int = 1,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    dtype: str = "bfloat16",
) -> TracedStep:
    """The peak of one rank over one steady-state step (AdamW's moments exist) of
    `args` laid out as dp_replicate x dp_shard x tp, with ep of the dp_shard ranks splitting a mixture
    of experts' experts (no pipeline, no context parallelism: the caller passes one stage's layers and
    each rank's slice of the sequence). Under expert parallelism the rows are spread evenly over the
    ranks and experts (fake tensors hold no routing: parallel/expert_parallel.py), as in the hand model."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from phalanx.config.schema import TrainSection
    from phalanx.parallel.build import build_parallel_model, uses_fsdp
    from phalanx.parallel.mesh import Layout, build_mesh
    from phalanx.train.optim import build_optimizer, clip_gradients

    layout = Layout(dp_replicate, dp_shard, tp, ep=ep)
    if layout.dp_replicate > 1 and not uses_fsdp(layout):
        raise PhalanxError(
            "the traced plan covers FSDP/HSDP and TP layouts; DDP keeps real gradient buckets "
            "in C++, which a fake tensor cannot stand in for"
        )
    started = time.perf_counter()
    args = dataclasses.replace(args, max_seq_len=max(seq_len, 1))  # the RoPE tables the run would build
    cdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    with fake_world(layout.world_size) if layout.world_size > 1 else contextlib.nullcontext(), _quiet():
        mesh = build_mesh(layout, "cpu")
        # Built on meta outside the fake mode: the mesh's own bookkeeping (coordinates, FSDP x TP
        # submeshes) needs real integer tensors. Nothing here allocates parameter memory.
        model = build_parallel_model(
            args,
            layout,
            mesh,
            torch.device("meta"),
            seed=0,
            activation_checkpointing=activation_checkpointing,
            compile=False,
            dtype=cdtype,
        )
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.init_rope()
            batch = micro_batch * layout.dp
            optimizer = build_optimizer(
                model, TrainSection(seq_len=seq_len, micro_batch_size=micro_batch, global_batch_size=batch)
            )
            params = [p for p in model.parameters() if p.requires_grad]
            fsdp = uses_fsdp(layout) and layout.world_size > 1
            # As the trainer: autocast only where FSDP does not already cast the weights.
            autocast = (
                torch.autocast("cpu", dtype=cdtype)
                if cdtype != torch.float32 and not fsdp
                else contextlib.nullcontext()
            )
            # The steady state has AdamW's moments: make them with one step on zero gradients, outside
            # the tracker (a first step's lazily created states confuse its categories), then trace a step.
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker = FSDPMemTracker(model, optimizer) if fsdp else _plain_tracker(model, optimizer)
            with tracker:
                tokens = torch.randint(0, args.vocab_size, (micro_batch, seq_len + 1))
                with autocast:
                    logits = model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                activations = _by_category(tracker.get_tracker_snapshot()).get("activations", 0)
                loss.backward()
                through_backward = sum(_by_category(tracker.get_tracker_snapshot("peak")).values())
                clip_gradients(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del logits, loss, tokens
            peak = tracker.get_tracker_snapshot("peak")
    at_peak = _by_category(peak)
    return TracedStep(sum(at_peak.values()), at_peak, activations, through_backward, time.perf_counter() - started)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence what torch says about the traced model that is not news to a planner's user: FSDP's
    note on view outputs, DTensor's on the gradient norm's two sequential all-reduces over dp x tp."""
    import logging
    import warnings

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            yield
    finally:
        logger.setLevel(level)


def _plain_tracker(model, optimizer):
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _by_category(snapshot: dict) -> dict[str, int]:
    """One device's snapshot (kind -> bytes, and 'Total') as the hand model's categories."""
    out: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for kind, nbytes in device_snapshot.items():
            if kind == "Total" or not nbytes:
                continue
            name = kind.value if hasattr(kind, "value") else str(kind)
            category = _KIND_TO_CATEGORY.get(name, "temporaries")
            out[category] = out.get(category, 0) + int(nbytes)
    return out
