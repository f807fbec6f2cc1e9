"""What the trainer does with a mixture of experts' routing each step: say how much each layer's
load-balancing loss weighs in the step's gradients, count the tokens every expert was sent (every rank's,
summed), report how balanced each layer was, and move routing biases towards even load (DeepSeek-V3's
auxiliary-loss-free balancing, train.moe_bias_rate).

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
    def __init__(self, model: nn.Module, args: ModelArgs, device: torch.device, bias_rate: float):
        self.device, self.bias_rate = device, bias_rate
        self.first_moe_layer = args.n_dense_layers
        self.shape = (args.n_layers - args.n_dense_layers, args.n_experts)
        self.layers: dict[int, MoE] = {}
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                self.layers[int(_LAYER.search(name).group(1))] = module

    def start_step(self, parts: int) -> None:
        """Before a step whose loss is the mean over `parts` micro-batches (1 under pipeline parallelism,
        whose schedule divides the gradients itself): each layer's load-balancing loss enters backward as
        router_aux_loss_coef times the mean over the MoE layers, divided as the cross-entropy is (the
        sum over the whole model's MoE layers, a pipeline rank's included). Counts this step's routing
        alone (not the evaluation's forwards before it)."""
        for moe in self.layers.values():
            moe.aux_loss_scale = moe.aux_loss_coef / self.shape[0] / parts
            moe.routed = None

    def finish_step(self) -> dict:
        """After the optimizer step: the busiest expert's tokens over the mean expert's, per MoE layer and
        the worst of them, over every rank's tokens of the step (one small all-reduce; collective on
        every rank); and each routing bias moved by those counts, the same on every rank."""
        counts = torch.zeros(self.shape, device=self.device)
        for index, moe in self.layers.items():
            if moe.routed is not None:
                counts[index - self.first_moe_layer] = moe.routed.float()
        counts = all_reduce_sum(counts)
        if self.bias_rate:
            for index, moe in self.layers.items():
                moe.update_bias(counts[index - self.first_moe_layer], self.bias_rate)
        by_layer = imbalance(counts)
        return {"moe_imbalance": round(max(by_layer), 4), "moe_imbalance_by_layer": [round(x, 4) for x in by_layer]}


def expert_balance(model: nn.Module, args: ModelArgs, device: torch.device, bias_rate: float) -> ExpertBalance | None:
    """None for a dense model."""
    return ExpertBalance(model, args, device, bias_rate) if args.n_experts else None
