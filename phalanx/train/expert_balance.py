"""What the trainer does with a mixture of experts' routing each step: count the tokens every expert was
sent (every rank's, summed), report how balanced each layer was, and say how much the load-balancing loss
weighs in the step's gradients.

The MoE layers are found once, when the trainer is built, under their index in the whole model (a
pipeline rank holds only its stages' layers, and wrappers put segments into module names): the step's
counts are laid out by that index, zeros for the layers another pipeline rank holds, so one all-reduce
over every rank gives each layer's counts over all of them.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from phalanx.models.decoder import ModelArgs
from phalanx.models.moe import MoE, imbalance
from phalanx.parallel.distributed import all_reduce_sum

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertBalance:
    def __init__(self, model: nn.Module, args: ModelArgs, device: torch.device):
        self.device = device
        self.first_moe_layer = args.n_dense_layers
        self.shape = (args.n_layers - args.n_dense_layers, args.n_experts)
        self.layers: dict[int, MoE] = {}
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                self.layers[int(_LAYER.search(name).group(1))] = module

    def start_step(self) -> None:
        """Count this step's routing alone (not the evaluation's forwards before it)."""
        for moe in self.layers.values():
            moe.routed = None

    def step_metrics(self) -> dict:
        """The busiest expert's tokens over the mean expert's, per MoE layer and the worst of them, over
        every rank's tokens of the step (one small all-reduce; collective on every rank)."""
        counts = torch.zeros(self.shape, device=self.device)
        for index, moe in self.layers.items():
            if moe.routed is not None:
                counts[index - self.first_moe_layer] = moe.routed.float()
        counts = all_reduce_sum(counts)
        by_layer = imbalance(counts)
        return {"moe_imbalance": round(max(by_layer), 4), "moe_imbalance_by_layer": [round(x, 4) for x in by_layer]}


def expert_balance(model: nn.Module, args: ModelArgs, device: torch.device) -> ExpertBalance | None:
    """None for a dense model."""
    return ExpertBalance(model, args, device) if args.n_experts else None
