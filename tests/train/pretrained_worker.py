"""Run by tests/train/test_train_pretrained.py, alone or under torch's launcher: build the model of a
pretrained checkpoint for a layout on the meta device, load the checkpoint into it (train/pretrained.py)
and save each rank's full parameters (RANK in the file name; a pipeline rank holds its stages' share)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.config.schema import ParallelSection
from phalanx.models.from_config import pretrained_args
from phalanx.parallel.build import build_parallel_model
from phalanx.parallel.materialize import plain_name
from phalanx.parallel.mesh import build_mesh, resolve_layout
from phalanx.train.pretrained import load_pretrained


def main(parallel: str, checkpoint: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    args = pretrained_args(Path(checkpoint))
    layout = resolve_layout(ParallelSection(**json.loads(parallel)), world)
    model = build_parallel_model(
        args,
        layout,
        build_mesh(layout, "cpu"),
        torch.device("cpu"),
        seed=1337,
        activation_checkpointing=True,
        compile=False,
        dtype=torch.float32,
        initialise=False,  # every parameter must come from the checkpoint
    )
    load_pretrained(model, args, Path(checkpoint))
    full = {
        plain_name(name).removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
        for name, p in model.named_parameters()
    }
    torch.save(full, f"{out}.{os.environ.get('RANK', '0')}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
