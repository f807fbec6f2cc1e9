"""Build the training model for a layout: on the meta device, split (TP, FSDP2), then materialised shard
by shard (materialize.py), or replicated (DDP). Order follows torchtitan: tensor parallelism first, then
activation checkpointing and compile per block, then data parallelism around blocks and root."""

from __future__ import annotations

import torch
from torch import nn

from phalanx.models.llama import ModelArgs, Transformer
from phalanx.parallel.apply import wrap_blocks, wrap_ddp
from phalanx.parallel.float8 import apply_float8, check_float8
from phalanx.parallel.materialize import materialize
from phalanx.parallel.mesh import Layout
from phalanx.parallel.tensor_parallel import apply_tensor_parallel


def build_parallel_model(args: ModelArgs, layout: Layout, mesh, device: torch.device, *, seed: int,
                         activation_checkpointing: bool, compile: bool, dtype: torch.dtype,
                         float8: bool = False) -> nn.Module:
    with torch.device("meta"):
        model = Transformer(args)
    rules = model.init_rules()
    if float8:
        check_float8(device, layout.tp)
        apply_float8(model)  # parameter names stay: the init rules and checkpoints still match
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    wrap_blocks(model, activation_checkpointing=activation_checkpointing, compile=compile)
    if uses_fsdp(layout):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # FSDP casts parameters itself, so the trainer skips autocast under FSDP; gradients reduce in fp32.
        # Two data-parallel dimensions make it HSDP: shards within dp_shard, replicas across dp_replicate.
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    materialize(model, rules, device, seed, init_buffers=model.init_rope)
    if layout.dp_replicate > 1 and not uses_fsdp(layout):
        model = wrap_ddp(model, device)
    return model


def uses_fsdp(layout: Layout) -> bool:
    """FSDP2 carries data parallelism whenever parameters are sharded: by dp_shard, or by TP (DDP cannot
    wrap DTensor parameters, so TP with replicas is HSDP with shard groups of one)."""
    return layout.dp_shard > 1 or (layout.tp > 1 and layout.dp > 1)
