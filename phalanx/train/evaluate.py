"""Validation loss over a fixed set of held-out windows (fine-tuning: rows, over their trained tokens), the
same set whatever the number of ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.config.schema import TrainSection
from phalanx.data.loader import TokenDataset, val_batches
from phalanx.data.sft_batches import IGNORE
from phalanx.models.token_pass import Packed
from phalanx.parallel.context_parallel import ContextParallel, NoContextParallel
from phalanx.parallel.distributed import DistEnv, all_reduce_sum


class Evaluator:
    def __init__(
        self,
        dataset: TokenDataset,
        train: TrainSection,
        env: DistEnv,
        autocast: Callable[[], AbstractContextManager],
        pipeline=None,
        split: ContextParallel | NoContextParallel = NoContextParallel(),
    ):
        """`pipeline` (parallel/pipeline.py's Pipeline) runs the forwards through the pipeline stages;
        `split` keeps this rank's tokens of each sequence and says how they attend (context parallelism;
        token counts stay exact)."""
        # The same windows on any rank count (train.eval_windows), in forwards of a training micro batch.
        micro = train.micro_batch(env.dp_world)
        # Fine-tuning rows add positions (and targets -100 where not trained: only trained tokens count).
        self.batches = [
            tuple(split.shard(t.to(env.device)) for t in batch)
            for batch in val_batches(
                dataset, train.seq_len, micro, math.ceil(train.eval_windows / micro), env.dp_rank, env.dp_world
            )
        ]
        # Ranks may hold unequal numbers of batches, yet all must run the same number of forwards: FSDP
        # all-gathers parameters inside each one. Ranks short of batches run a throw-away forward.
        windows = min(len(dataset), train.eval_windows)
        self.forwards = math.ceil(math.ceil(windows / micro) / env.dp_world)
        # A pipeline splits every forward into its micro-batches: the throw-away one needs as many rows.
        rows = pipeline.n_microbatches if pipeline is not None else 1
        self.dummy = split.shard(torch.zeros(rows, train.seq_len, dtype=torch.long, device=env.device))
        self.device, self.autocast, self.pipeline, self.split = env.device, autocast, pipeline, split

    @torch.no_grad()
    def loss(self, model: nn.Module) -> float:
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, token count
        for i in range(self.forwards):
            if self.pipeline is not None:
                self._pipeline_forward(i, sums)
                continue
            with self.autocast():
                if i >= len(self.batches):
                    model(self.dummy, self.split.token_pass())
                    continue
                inputs, targets, *positions = self.batches[i]
                logits = model(inputs, Packed(positions[0]) if positions else self.split.token_pass())
            sums[0] += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").double()
            sums[1] += (targets != IGNORE).sum()
        model.train()
        loss_sum, count = all_reduce_sum(sums).tolist()
        return loss_sum / count

    def _pipeline_forward(self, i: int, sums: torch.Tensor) -> None:
        """Forward i through the stages; only last-stage ranks see the loss, so only they count tokens."""
        inputs, targets = self.batches[i] if i < len(self.batches) else (self.dummy, self.dummy)
        with self.autocast():
            loss_sum = self.pipeline.eval_sum(inputs, targets)
        if i < len(self.batches) and self.pipeline.has_last:
            sums[0] += loss_sum
            sums[1] += targets.numel()
