"""Pipeline parallelism with torch.distributed.pipelining: the model split by layer into stages, one stage
per pp rank (two under `interleaved_1f1b`: "virtual stages"), driven by a 1F1B, interleaved 1F1B or GPipe
schedule.

The split happens on the meta device, after tensor parallelism (stages then pass on their
sequence-parallel shard of the hidden states) and activation checkpointing, and before FSDP, so each
stage is sharded and materialised on its own. A stage runs the model's own forward on its part of the
model (Transformer.part: the layers it does not own left out, the embedding only on the first stage, the
norm and head only on the last), as torchtitan does, and keeps the whole model's parameter names
(`tok_embeddings.weight`, `layers.3.attention.wq.weight`, `output.weight`): the model's layers live in a
ModuleDict keyed by their index in the whole model, so the per-name seeded initialisation gives the same
weights as one process, and DCP checkpoints reshard between any pp (and pp=1) because every rank saves and
loads its parameters under the names one process uses.

Balance: the embedding and the output head (final norm + vocabulary projection) are each counted as one
layer's worth of work, and the n_layers + 2 units are cut into contiguous, near-equal runs, one per
stage. With 4 layers and 2 stages: [embedding, 0, 1] and [2, 3, head].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.token_pass import Causal

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
# Interleaving gives each rank this many stages ("virtual stages"); two is what torchtitan defaults to and
# already halves the bubble.
INTERLEAVED_STAGES_PER_RANK = 2


@dataclass(frozen=True)
class StagePlan:
    index: int
    layers: tuple[int, ...]  # indices into the whole model's layers
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the output projection


def stages_per_rank(schedule: str) -> int:
    return INTERLEAVED_STAGES_PER_RANK if schedule == "interleaved_1f1b" else 1


def split_layers(n_layers: int, n_stages: int) -> list[StagePlan]:
    """Contiguous, balanced stages over the units [embedding, layer 0, ..., layer n-1, head]."""
    units = n_layers + 2
    if n_stages > units:
        raise PhalanxError(
            f"{n_stages} pipeline stages need at least {n_stages - 2} layers (the embedding and the "
            f"head count as one each); the model has {n_layers}"
        )
    plans = []
    for s in range(n_stages):
        lo, hi = s * units // n_stages, (s + 1) * units // n_stages
        # Unit u is layer u - 1; unit 0 is the embedding, unit n_layers + 1 the head.
        layers = tuple(u - 1 for u in range(lo, hi) if 1 <= u <= n_layers)
        plans.append(StagePlan(s, layers, first=lo == 0, last=hi == units))
    return plans


def rank_stage_indices(pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages a pp rank runs: "loop" placement (rank r holds r, r + pp, ...), what the interleaved
    schedule expects."""
    return [pp_rank + i * pp for i in range(per_rank)]


def microbatches(pp: int, configured: int | None) -> int:
    return configured or pp


def check_pipeline(args: ModelArgs, parallel, micro_rows: int | None = None) -> None:
    """What pipelining refuses (`parallel`: the config's ParallelSection, pp > 1), as one line: a split
    the model cannot take, tied embeddings across stages, layouts it does not compose with yet, and (given
    the micro-batch rows per data-parallel rank) micro-batches that do not divide into the pipeline's."""
    pp, schedule = parallel.pp, parallel.pp_schedule
    n_microbatches = microbatches(pp, parallel.pp_microbatches)
    if schedule not in SCHEDULES:
        raise PhalanxError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    split_layers(args.n_layers, pp * stages_per_rank(schedule))
    if args.tie_embeddings:
        raise PhalanxError(
            "model.tie_embeddings=true shares one weight between the first and the last pipeline "
            "stage, which parallel.pp > 1 does not support: set model.tie_embeddings=false"
        )
    if parallel.cp > 1:
        raise PhalanxError("parallel.pp > 1 does not compose with parallel.cp > 1 yet")
    if schedule == "interleaved_1f1b" and n_microbatches % pp:
        raise PhalanxError(
            f"interleaved_1f1b needs parallel.pp_microbatches ({n_microbatches}) to be a multiple of parallel.pp ({pp})"
        )
    if micro_rows is not None and micro_rows % n_microbatches:
        raise PhalanxError(
            f"parallel.pp_microbatches={n_microbatches} does not divide the micro-batch of "
            f"{micro_rows} sequences per data-parallel rank (train.micro_batch_size)"
        )


class TransformerStage(nn.Module):
    """One pipeline stage: its part of the Transformer (Transformer.part), run by the model's forward."""

    def __init__(self, model: Transformer, plan: StagePlan, sequence_shards: int = 1):
        super().__init__()
        self.plan = plan
        self.part = model.part(plan.layers, plan.first, plan.last)
        # Under tensor parallelism the hidden states between stages are split along the sequence
        # (sequence parallelism): each rank holds 1/tp of the tokens.
        self.sequence_shards = sequence_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (B, T) into the first stage, hidden states (B, T, D) between stages, logits out of the
        last."""
        if self.plan.first:
            return self.part(x)
        return self.part(x, Causal(length=x.shape[1] * self.sequence_shards))


class PipelinedModel(nn.Module):
    """A pp rank's share of the model as one module, for the optimizer and checkpoints: all of its
    stages' parts under the whole model's names (a layer's FQN is the same as in one process). The stages
    themselves (`self.stages`, not registered, so names are not doubled) share these modules and run the
    forward."""

    def __init__(self, model: Transformer, stages: list[TransformerStage]):
        super().__init__()
        self.args = model.args
        self.tok_embeddings = model.tok_embeddings if any(s.plan.first for s in stages) else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for s in stages for i in s.plan.layers})
        self.norm = model.norm if any(s.plan.last for s in stages) else None
        self.output = model.output if any(s.plan.last for s in stages) else None
        self.stages = stages  # a plain list: not submodules

    def train(self, mode: bool = True):
        super().train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its schedule (phalanx.parallel.pipeline.Pipeline)")


def split_model(model: Transformer, pp_rank: int, pp: int, schedule: str, tp: int = 1) -> PipelinedModel:
    """This pp rank's stages of `model` (built on the meta device, tensor-parallel over `tp` ranks
    already if tp > 1), as one PipelinedModel."""
    per_rank = stages_per_rank(schedule)
    plans = split_layers(model.args.n_layers, pp * per_rank)
    stages = [TransformerStage(model, plans[i], tp) for i in rank_stage_indices(pp_rank, pp, per_rank)]
    return PipelinedModel(model, stages)


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss: mean cross entropy over the micro-batch's tokens, in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Pipeline:
    """The schedule that runs a PipelinedModel's stages, on every rank of the pp group together.

    Each step takes this data-parallel rank's whole share of the global batch and splits it into
    `n_microbatches` equal pipeline micro-batches; the schedule scales gradients by 1 / n_microbatches,
    so with the mean-cross-entropy loss per micro-batch the gradients are those of the mean over the
    share, as without pipelining."""

    def __init__(self, model: PipelinedModel, schedule: str, n_microbatches: int, pp_group, device: torch.device):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        n_stages = len(model.stages) * torch.distributed.get_world_size(pp_group)
        self.stages = [PipelineStage(s, s.plan.index, n_stages, device, group=pp_group) for s in model.stages]
        self.has_first = any(s.plan.first for s in model.stages)
        self.has_last = any(s.plan.last for s in model.stages)
        self.n_microbatches = n_microbatches
        self.poison = False  # the fault injector's NaN loss, applied on the last stage
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, n_microbatches, loss_fn=self._loss)
        else:
            single = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            self.schedule = single(self.stages[0], n_microbatches, loss_fn=self._loss)
        self.device = device

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = token_loss(logits, targets)
        return loss * float("nan") if self.poison else loss

    def _losses(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the micro-batches' mean losses on last-stage ranks, zero elsewhere."""
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, poison: bool = False) -> torch.Tensor:
        """Forward and backward over the share; the sum of the micro-batch losses (last stage; 0 elsewhere)."""
        self.poison = poison
        try:
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.has_first else ()
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return self._losses(losses)
        finally:
            self.poison = False

    @torch.no_grad()
    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross entropy of one batch (last stage; 0 elsewhere), forward only."""
        chunk_tokens = targets.numel() // self.n_microbatches  # equal chunks: check_pipeline
        losses: list[torch.Tensor] = []
        self.schedule.eval(*((inputs,) if self.has_first else ()), target=targets, losses=losses)
        return self._losses(losses).double() * chunk_tokens
