"""Validation loss over a fixed set of held-out windows, the same set whatever the number of ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config.schema import TrainSection
from phalanx.data.loader import TokenDataset
from phalanx.parallel.distributed import DistEnv, all_reduce_sum


class Evaluator:
    def __init__(self, dataset: TokenDataset, train: TrainSection, env: DistEnv,
                 autocast: Callable[[], AbstractContextManager]):
        total = min(len(dataset), train.eval_batches * train.micro_batch_size)
        mine = range(env.rank, total, env.world_size)  # strided: the union over ranks is the fixed set
        windows = torch.from_numpy(np.stack([dataset.window(i) for i in mine]).astype(np.int64)) if mine else None
        self.batches = [] if windows is None else [
            (w[:, :-1].to(env.device), w[:, 1:].to(env.device)) for w in windows.split(train.micro_batch_size)]
        # Every rank runs the same number of forwards: FSDP all-gathers parameters inside each one.
        self.forwards = math.ceil(math.ceil(total / env.world_size) / train.micro_batch_size)
        self.dummy = torch.zeros(1, train.seq_len, dtype=torch.long, device=env.device)
        self.device, self.autocast = env.device, autocast

    @torch.no_grad()
    def loss(self, model: nn.Module) -> float:
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for i in range(self.forwards):
            with self.autocast():
                if i >= len(self.batches):
                    model(self.dummy)
                    continue
                inputs, targets = self.batches[i]
                logits = model(inputs)
            sums[0] += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").double()
            sums[1] += targets.numel()
        model.train()
        loss_sum, count = all_reduce_sum(sums).tolist()
        return loss_sum / count
