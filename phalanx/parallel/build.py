"""Build the training model for a layout: on the meta device, split (TP, FSDP2), then materialised shard
by shard (materialize.py), or replicated (DDP). Order follows torchtitan: tensor parallelism first, then
activation checkpointing and compile per block, then data parallelism around blocks and root."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from phalanx.config.schema import LoraSection
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.lora import adapter_rule, apply_lora, is_adapter, shard_adapters
from phalanx.parallel.apply import wrap_blocks, wrap_ddp
from phalanx.parallel.context_parallel import gradient_mesh
from phalanx.parallel.expert_parallel import apply_expert_parallel, shard_experts
from phalanx.parallel.float8 import apply_float8, check_float8
from phalanx.parallel.materialize import materialize
from phalanx.parallel.mesh import Layout
from phalanx.parallel.pipeline import split_model
from phalanx.parallel.tensor_parallel import apply_tensor_parallel


def build_parallel_model(
    args: ModelArgs,
    layout: Layout,
    mesh,
    device: torch.device,
    *,
    seed: int,
    activation_checkpointing: bool,
    compile: bool,
    dtype: torch.dtype,
    float8: bool = False,
    pp_schedule: str = "1f1b",
    initialise: bool = True,
    lora: LoraSection | None = None,
) -> nn.Module:
    """The model this rank trains. Under pipeline parallelism (layout.pp > 1) it is a PipelinedModel:
    this rank's stages (parallel/pipeline.py), split after TP and activation checkpointing, each sharded
    (FSDP) and materialised on its own, under the whole model's parameter names; a tied embedding weight
    is a copy on the first and on the last stage's rank, both starting from the embedding's values.
    initialise=False leaves the parameters unfilled, for a run that loads all of them (a pretrained
    checkpoint: train/pretrained.py), which saves drawing a whole random model first. `lora` with a rank
    adds adapters to its target layers and freezes the rest (models/lora.py); they are always initialised."""
    with torch.device("meta"):
        model = Transformer(args)
    adapters = bool(lora and lora.rank)
    if adapters:  # before any split: the plans and FSDP see the adapted modules
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.targets)
    rules = model.init_rules() if initialise else {}
    if adapters:
        rules |= {name: adapter_rule(name, lora.rank) for name, _ in model.named_parameters() if is_adapter(name)}
    rules = rules or None
    # A pipeline's last stage holds its own copy of a tied embedding weight (parallel/pipeline.py), which
    # one process lists only as the embedding: it starts as the embedding does (same rule, same generator).
    aliases = {"output.weight": "tok_embeddings.weight"} if args.tie_embeddings else {}
    if float8:
        check_float8(device, layout.tp)
        apply_float8(model)  # parameter names stay: the init rules and checkpoints still match
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
        if adapters:
            shard_adapters(model, mesh["tp"])
    if layout.ep > 1:
        apply_expert_parallel(model, mesh, layout)
    wrap_blocks(model, activation_checkpointing=activation_checkpointing, compile=compile)
    if layout.pp > 1:
        pipelined = split_model(model, mesh["pp"].get_local_rank(), layout.pp, pp_schedule, layout.tp)
        for stage in pipelined.stages:  # each stage is an FSDP root of its own: the pipeline drives each
            if uses_fsdp(layout):
                _shard(stage, stage.part.layers.values(), layout, mesh, dtype)
            materialize(stage, rules, device, seed, init_buffers=stage.part.init_rope, prefix="part.", aliases=aliases)
        pipelined.retie()  # the tied copy's second name, onto the parameter FSDP and to_empty left
        return pipelined
    if uses_fsdp(layout):
        _shard(model, model.layers.values(), layout, mesh, dtype)
    materialize(model, rules, device, seed, init_buffers=model.init_rope)
    if layout.dp_replicate * layout.cp > 1 and not uses_fsdp(layout):
        model = wrap_ddp(model, device, gradient_mesh(mesh, layout, sharded=False).get_group())
    return model


def _shard(root: nn.Module, blocks, layout: Layout, mesh, dtype: torch.dtype) -> None:
    """FSDP2 over each block, then the root (the model, or a pipeline stage)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP casts parameters itself, so the trainer skips autocast under FSDP; gradients reduce in fp32.
    # Two data-parallel dimensions make it HSDP: shards within dp_shard, replicas across dp_replicate.
    # Parameters are replicated over cp too, so cp ranks join the shard groups (dp_shard x cp).
    # Experts split by expert parallelism are sharded over the ranks holding the same ones instead
    # (parallel/expert_parallel.py), in groups of their own.
    dp_mesh = gradient_mesh(mesh, layout, sharded=True)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in blocks:
        if layout.ep > 1:
            shard_experts(block, dp_mesh, policy, layout.dp)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(root, mesh=dp_mesh, mp_policy=policy)


def uses_fsdp(layout: Layout) -> bool:
    """FSDP2 carries data parallelism whenever parameters are sharded: by dp_shard, or by TP (DDP cannot
    wrap DTensor parameters, so TP with replicas is HSDP with shard groups of one); and under pipeline
    parallelism, whose stages torch's pipelining drives as FSDP modules (replicas: shard groups of one)."""
    return layout.dp_shard > 1 or ((layout.tp > 1 or layout.pp > 1) and layout.dp * layout.cp > 1)
