"""Apply activation checkpointing, torch.compile and DDP / FSDP2 to a single-device model from outside.

Order follows torchtitan: activation checkpointing wraps each block, compile works per block (in place,
so parameter names do not change), then data parallelism wraps the blocks and the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from phalanx.parallel.distributed import DistEnv


def wrap_blocks(model: nn.Module, *, activation_checkpointing: bool, compile: bool) -> None:
    """Activation checkpointing around each block, then torch.compile of each (in place, so parameter
    names do not change)."""
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for key, block in model.layers.items():
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    if compile:
        for block in model.layers.values():
            block.compile()


def wrap_ddp(model: nn.Module, device: torch.device, process_group=None) -> nn.Module:
    """DDP over `process_group` (default: every rank; context parallelism passes its replicas x cp)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # No buffer broadcast: the model's only buffers are RoPE tables derived from its shape, and the
    # broadcast would put a collective into every forward.
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False, process_group=process_group)


def parallelize(
    model: nn.Module, strategy: str, env: DistEnv, *, activation_checkpointing: bool, compile: bool, dtype: torch.dtype
) -> nn.Module:
    """A built model wrapped for `strategy` (bench and the planner's measurements; training builds its
    model for a layout with parallel/build.py)."""
    wrap_blocks(model, activation_checkpointing=activation_checkpointing, compile=compile)
    if not env.distributed:
        return model
    if strategy == "ddp":
        return wrap_ddp(model, env.device)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP casts parameters itself, so the trainer skips autocast under fsdp; gradients reduce in fp32.
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    raise ValueError(f"unknown parallel strategy {strategy!r}")


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch of a step."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
