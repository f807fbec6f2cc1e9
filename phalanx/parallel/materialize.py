"""Meta-device initialisation: build the model without memory, split it, then fill in only each rank's
shards, with the same values under every layout.

A model of any size is built on the meta device (no storage), parallelised (TP, FSDP2, DDP), moved to
its device empty (`to_empty`: each rank allocates only its own shards), and then each parameter is
filled one at a time: the whole parameter is drawn on the device from its own generator (seeded by the
run's seed and the parameter's name, models/decoder.py init_rules), the rank keeps its slice, and the
whole is dropped. So no rank ever holds more than its shards plus one parameter, and 1 process, DDP,
FSDP, TP and any mix of them start from identical weights.
"""

from __future__ import annotations

import torch
from torch import nn

from phalanx.models.decoder import init_parameter

# Wrappers that insert a path segment into parameter names (activation checkpointing, compile).
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@torch.no_grad()
def materialize(
    model: nn.Module,
    rules: dict[str, tuple[str, float]] | None,
    device: torch.device,
    seed: int,
    init_buffers,
    prefix: str = "",
    aliases: dict[str, str] | None = None,
) -> None:
    """Allocate `model` (parallelised on the meta device) on `device` and initialise it by `rules`
    (Transformer.init_rules() of the unwrapped model; None: allocate only, for a caller that fills every
    parameter itself, as a pretrained checkpoint does; parameters without a rule are left to the caller); `init_buffers()` then rebuilds the buffers.
    `prefix`: what `model`'s parameter names start with beyond the whole model's (a pipeline stage's
    "part."). `aliases`: names to initialise as another parameter, by its rule and from its generator (a
    tied weight's copy held apart from it, on a pipeline's last stage: "output.weight" as the embedding)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    ties = _shared_parameters(model)
    model.to_empty(device=device)
    for places in ties:  # to_empty replaces a plain module's parameters one module at a time: re-tie
        first = getattr(*places[0])
        for module, attr in places[1:]:
            if getattr(module, attr) is not first:
                setattr(module, attr, first)
    for name, param in model.named_parameters() if rules is not None else ():
        clean = plain_name(name.removeprefix(prefix))
        clean = (aliases or {}).get(clean, clean)
        if clean not in rules:
            continue  # filled by the caller: a pretrained checkpoint's weights under its adapters (LoRA)
        if isinstance(param, DTensor):
            full = torch.empty(param.shape, dtype=param.dtype, device=device)
            init_parameter(full, clean, rules[clean], seed)
            # src_data_rank=None: every rank drew the same full tensor, so each just keeps its slice.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
            del full, local
        else:
            init_parameter(param, clean, rules[clean], seed)
    init_buffers()


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter registered on more than one module (tied embeddings), as (module, name) places."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, attr))
    return [p for p in places.values() if len(p) > 1]
