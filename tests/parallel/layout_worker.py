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


if __name__ == "__main__":
    main(*sys.argv[1:])
