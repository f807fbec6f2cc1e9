"""One training step of a model in a test's own process: its loss and every parameter's gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_and_grads(model, tokens, autocast: bool):
    """The next-token loss over `tokens` (under CPU bf16 autocast or not) and each parameter's gradient."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
