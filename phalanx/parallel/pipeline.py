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

Tied embeddings (model.tie_embeddings): one process has one (vocab, dim) weight, used by the embedding and
by the output head. Its two users sit on different pp ranks (stage 0 on pp rank 0, the last stage on pp
rank pp - 1, for every schedule here), so each of those ranks holds a copy, as Megatron-LM does: both
start from the same values (the head's copy is initialised under the embedding's name), after each
backward their gradients are summed between exactly those two ranks (Pipeline), so with the same
optimizer state both copies take the same update and stay equal, bit for bit. The copy is a replica, like
a data-parallel one, so the last stage's rank also lists it under the name one process gives the weight,
`tok_embeddings.weight` (TiedEmbeddingCopy): its optimizer state is saved and loaded under that one name,
DCP writes the two ranks' equal values once, and checkpoints reshard between pp and any other layout in
both directions with the same keys one process writes (`tok_embeddings.weight`, `output.weight`, and the
optimizer's state under `tok_embeddings.weight`). The gradient norm counts the weight once
(counted_in_grad_norm). Why copies rather than one weight sent between the two ranks: both ends use it in
every micro-batch's forward and backward, so sending it would cost more traffic and a wait per
micro-batch; with copies only the gradient crosses, once per step (one all-reduce of the vocab x dim
weight's local shard between two ranks), and the result is the same sum one process forms.
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
# Set on the last stage's copy of a tied embedding weight: the first stage's rank counts the same (summed)
# gradient in the gradient norm already.
_TIED_COPY = "_phalanx_tied_embedding_copy"


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
    the model cannot take, layouts it does not compose with yet, and (given the micro-batch rows per
    data-parallel rank) micro-batches that do not divide into the pipeline's."""
    pp, schedule = parallel.pp, parallel.pp_schedule
    n_microbatches = microbatches(pp, parallel.pp_microbatches)
    if schedule not in SCHEDULES:
        raise PhalanxError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    split_layers(args.n_layers, pp * stages_per_rank(schedule))
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


class TiedEmbeddingCopy(nn.Module):
    """On the rank of the last stage (and not the first), the output head's copy of a tied embedding
    weight, registered a second time as `tok_embeddings.weight`: the name one process lists the tied weight
    under (named_parameters yields it first), so the optimizer's state for it, checkpoints and pretrained
    loading use the same keys as under any other layout. It computes nothing: the head uses the weight."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class PipelinedModel(nn.Module):
    """A pp rank's share of the model as one module, for the optimizer and checkpoints: all of its
    stages' parts under the whole model's names (a layer's FQN is the same as in one process). The stages
    themselves (`self.stages`, not registered, so names are not doubled) share these modules and run the
    forward. With tied embeddings, the last stage's rank holds the head's copy of the tied weight under
    the embedding's name too (TiedEmbeddingCopy)."""

    def __init__(self, model: Transformer, stages: list[TransformerStage]):
        super().__init__()
        self.args = model.args
        first, last = any(s.plan.first for s in stages), any(s.plan.last for s in stages)
        if model.args.tie_embeddings and first and last:
            # Not reachable with loop placement and pp > 1 (stage 0 is on pp rank 0, the last on pp - 1).
            # It would be one parameter in two stages: each stage's schedule would scale its gradient by
            # 1 / n_microbatches, and two FSDP roots cannot share a parameter; refused rather than wrong.
            raise PhalanxError("a tied embedding weight's first and last pipeline stage are on one rank")
        # Registered first, as in the Transformer: a tied weight's name is then `tok_embeddings.weight`.
        self.tok_embeddings = model.tok_embeddings if first else None
        if model.args.tie_embeddings and last:
            self.tok_embeddings = TiedEmbeddingCopy(model.output.weight)
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for s in stages for i in s.plan.layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.stages = stages  # a plain list: not submodules

    def retie(self) -> None:
        """After FSDP and materialisation: point the copy's second name at the head's parameter again
        (fully_shard and to_empty replace it on the head's module, the only one they see), and mark it
        so that the gradient norm leaves it out (counted_in_grad_norm)."""
        if isinstance(self.tok_embeddings, TiedEmbeddingCopy):
            self.tok_embeddings.weight = self.output.weight
            setattr(self.output.weight, _TIED_COPY, True)

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


def counted_in_grad_norm(param: torch.Tensor) -> bool:
    """Whether `param`'s gradient adds to the gradient norm summed over the pp group: all but the last
    stage's copy of a tied embedding weight, whose (summed) gradient the first stage's rank counts."""
    return not getattr(param, _TIED_COPY, False)


def tied_embedding_group(model: PipelinedModel, pp_group, schedule: str):
    """The process group of the ranks in this rank's pp group that hold the tied embedding weight (the
    first stage's and the last stage's); None for an untied model or a rank holding neither. Collective
    over every rank (all ranks make every new group together), called once, when the Pipeline is built."""
    import torch.distributed as dist

    if not model.args.tie_embeddings:
        return None
    pp, per_rank = dist.get_world_size(pp_group), stages_per_rank(schedule)
    plans = split_layers(model.args.n_layers, pp * per_rank)
    # The pp ranks whose stages hold the embedding or the head (pp rank 0 and pp - 1: loop placement).
    ends = [r for r in range(pp) if any(plans[i].first or plans[i].last for i in rank_stage_indices(r, pp, per_rank))]
    if len(ends) == pp:  # pp = 2: the pp group itself, no new group needed
        return pp_group
    ranks = dist.get_process_group_ranks(pp_group)
    mine = [ranks[i] for i in ends]
    # Every rank must take part in making every group, in the same order: learn all pp groups' pairs.
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    group = None
    for pair in sorted({tuple(p) for p in everyone}):
        made = dist.new_group(list(pair))
        if list(pair) == mine:
            group = made
    return group


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
        # Tied embeddings: the group that sums the two copies' gradients, and the module holding this rank's
        # copy (the embedding on the first stage's rank, TiedEmbeddingCopy on the last's). The module, not
        # its parameter: FSDP may yet swap the parameter object, so it is read when it is needed.
        self.tied_group = tied_embedding_group(model, pp_group, schedule)
        self.tied_holder = model.tok_embeddings if self.tied_group is not None else None
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
            self._sum_tied_gradients()
            return self._losses(losses)
        finally:
            self.poison = False

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """The tied weight's gradient is the embedding's plus the head's, as in one process: sum the two
        ranks' parts, so both copies take the same update. Under FSDP and TP each rank sums its local
        shard: the two ranks share every other mesh coordinate, so their shards are the same slice."""
        if self.tied_holder is None:  # untied, or a middle stage's rank
            return
        import torch.distributed as dist

        weight = self.tied_holder.weight
        grad = weight.grad
        if hasattr(grad, "placements") and grad.placements != weight.placements:
            # Under TP the embedding's gradient comes back whole (Replicate) while the head's is split by
            # vocabulary like the weight: both in the weight's layout (a local slice, no traffic), so that
            # the two ranks sum the same slice.
            grad = weight.grad = grad.redistribute(grad.device_mesh, weight.placements)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.tied_group)

    @torch.no_grad()
    def eval_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross entropy of one batch (last stage; 0 elsewhere), forward only."""
        chunk_tokens = targets.numel() // self.n_microbatches  # equal chunks: check_pipeline
        losses: list[torch.Tensor] = []
        self.schedule.eval(*((inputs,) if self.has_first else ()), target=targets, losses=losses)
        return self._losses(losses).double() * chunk_tokens
