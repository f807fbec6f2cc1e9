"""Run by tests/parallel/test_layouts.py under torch's launcher: build the tiny model for a layout from
the meta device and save each rank's full initial parameters (RANK in the file name; under pipeline
parallelism each rank holds its stages' share), to compare across layouts."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from phalanx.config.schema import ParallelSection
from phalanx.models.decoder import ModelArgs
from phalanx.parallel.build import build_parallel_model
from phalanx.parallel.mesh import build_mesh, resolve_layout

# Untied: pipeline parallelism refuses tied embeddings (the first and last stages would share a weight).
ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=32)


def main(parallel: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    layout = resolve_layout(ParallelSection(**json.loads(parallel)), world)
    model = build_parallel_model(
        ARGS,
        layout,
        build_mesh(layout, "cpu"),
        torch.device("cpu"),
        seed=1337,
        activation_checkpointing=True,
        compile=False,
        dtype=torch.float32,
    )
    full = {
        name.replace("module.", "").replace("_checkpoint_wrapped_module.", ""): (
            p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        ).clone()
        for name, p in model.named_parameters()
    }
    torch.save(full, f"{out}.{os.environ.get('RANK', '0')}")
    if world > 1:
        dist.destroy_process_group()


def train(parallel: str, out: str, options: str) -> None:
    """A few optimizer steps (train/step.py's train_step, through the Pipeline under pp) of the model with
    `options["model"]` changed (e.g. tied embeddings), on fixed random batches every layout sees alike;
    saves each rank's full parameters before and after (every name, a tied weight's second one too), its
    per-step losses (last stage; None elsewhere), gradient norms and the numel of its local shards."""
    import dataclasses
    import gc

    from phalanx.config.schema import TrainSection
    from phalanx.parallel.mesh import dp_coordinate
    from phalanx.parallel.pipeline import Pipeline, microbatches
    from phalanx.train.optim import build_optimizer
    from phalanx.train.step import train_step

    options = json.loads(options)
    args = dataclasses.replace(ARGS, **options.get("model", {}))
    schedule = options.get("schedule", "1f1b")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    layout = resolve_layout(ParallelSection(**json.loads(parallel)), world)
    mesh = build_mesh(layout, "cpu")
    cpu = torch.device("cpu")
    model = build_parallel_model(
        args,
        layout,
        mesh,
        cpu,
        seed=1337,
        activation_checkpointing=False,
        compile=False,
        dtype=torch.float32,
        pp_schedule=schedule,
    )
    pipeline = pp_group = None
    if layout.pp > 1:
        pp_group = mesh["pp"].get_group()
        pipeline = Pipeline(model, schedule, microbatches(layout.pp, None), pp_group, cpu)
    # A high learning rate and a low clip: a gradient counted twice, or copies drifting apart, would show.
    optimizer = build_optimizer(model, TrainSection(lr=1e-2, grad_clip=0.5))
    params = [p for p in model.parameters() if p.requires_grad]

    def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {
            name.replace("module.", "").replace("_checkpoint_wrapped_module.", ""): (
                p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            ).clone()
            for name, p in model.named_parameters(remove_duplicate=False)
        }

    before = full_parameters(model)
    dp_rank, dp_world = dp_coordinate(mesh, layout)
    losses, norms = [], []
    for step in range(options.get("steps", 3)):
        tokens = torch.randint(0, args.vocab_size, (8, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[dp_rank::dp_world]  # this data-parallel rank's rows; one process takes all
        outcome = train_step(
            model,
            optimizer,
            params,
            [(mine[:, :-1], mine[:, 1:])],
            device=cpu,
            grad_clip=0.5,
            pipeline=pipeline,
            pp_group=pp_group,
        )
        last = pipeline is None or pipeline.has_last
        losses.append(outcome.loss_sum.item() / outcome.parts if last else None)
        norms.append(outcome.grad_norm.item())
    rank = os.environ.get("RANK", "0")
    # What this rank keeps between steps: its local shard of each parameter.
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).numel() for name, p in model.named_parameters()}
    saved = {"before": before, "after": full_parameters(model), "losses": losses, "norms": norms, "local": local}
    torch.save(saved, f"{out}.{rank}")
    del model, optimizer, params, pipeline  # before the group goes: the teardown flake (DESIGN.md)
    gc.collect()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) > 3:  # with options: train a few steps (test_pipeline_tied.py)
    train(*sys.argv[1:])
    sys.exit(0)

if __name__ == "__main__":
    main(*sys.argv[1:])
