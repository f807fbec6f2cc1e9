"""Context parallelism: the cp ranks of one replica each hold a slice of every sequence, and causal
attention runs over the whole sequence by ring attention.

Load balance. Causal attention makes late tokens dearer than early ones (each sees more keys), so a
plain split into cp consecutive pieces would leave the last rank with most of the work. Each sequence is
cut into 2*cp chunks instead and rank r holds chunks r and 2*cp-1-r (the "zig-zag" split): every rank
gets one early and one late chunk, hence the same number of query-key pairs.

Attention. Each rank projects q, k and v for its own tokens only, with RoPE at their global positions.
The (k, v) blocks then travel once around the cp group (send to the next rank, receive from the
previous, cp-1 times); at each step a rank attends its queries to the block it holds, masked by global
position, and folds the result into a running softmax (the flash-attention recurrence: running row
maximum, running sum of exponentials, running weighted sum of values), so the full sequence's scores are
never held at once. The pass is an autograd.Function whose backward sends the keys' and values'
gradients the opposite way round the ring, so autograd gives exact gradients for every rank's keys and
values. torch's own `torch.distributed.tensor.experimental.context_parallel` only rewrites the CUDA SDPA
kernels (flash, efficient, cuDNN), not CPU's, which is why phalanx carries this ring.

Gradients. Parameters are replicated over cp, and each rank's loss is the mean over its own tokens; all
ranks hold equally many, so averaging gradients over cp, as over data-parallel ranks, is the gradient of
the whole sequence's token mean. parallel/build.py does that by giving DDP or FSDP2 the flattened
data-parallel x cp ranks (torchtitan's "dp_shard_cp").

The model (models/decoder.py) knows nothing of this: the trainer hands its forward a RingPass (a
TokenPass, models/token_pass.py), which gives RoPE the local tokens' global positions and runs the
attention round the ring.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from phalanx.errors import PhalanxError
from phalanx.models.token_pass import TokenPass, check_length, heads_last, visible


def check_cp(cp: int, seq_len: int, compile: bool = False) -> None:
    """What context parallelism needs of a run, as one clear line (pipelining refuses cp itself:
    parallel/pipeline.py)."""
    if cp <= 1:
        return
    if seq_len % (2 * cp):
        raise PhalanxError(
            f"train.seq_len={seq_len} must be divisible by 2 x parallel.cp = {2 * cp} (each cp "
            "rank holds two equal chunks of every sequence)"
        )
    if compile:
        # The ring's point-to-point exchange is not traceable by dynamo: untested, so refused.
        raise PhalanxError("parallel.cp > 1 does not work with train.compile=true yet")


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions (seq_len / cp,) that cp rank `rank` holds: chunks rank and 2*cp-1-rank of
    2*cp equal chunks."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat((first, second))


def _exchange(x: torch.Tensor, group, send_to: int, receive_from: int) -> torch.Tensor:
    """Send x to group rank `send_to` while receiving a tensor like it from `receive_from`."""
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, group=group, group_peer=send_to),
        dist.P2POp(dist.irecv, received, group=group, group_peer=receive_from),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _RingPass(torch.autograd.Function):
    """One step round the ring: what the previous rank held, with gradients going back the other way."""

    @staticmethod
    def forward(ctx, x, group, send_to: int, receive_from: int):
        ctx.group, ctx.send_to, ctx.receive_from = group, send_to, receive_from
        return _exchange(x, group, send_to, receive_from)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.receive_from, ctx.send_to), None, None, None


def ring_attention(
    q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, group, positions_of, window: int | None = None
) -> torch.Tensor:
    """Causal attention of this rank's queries over the keys and values of every rank in `group`.

    `positions_of(group_rank)` gives the global positions (T,) of that rank's tokens (queries and keys
    alike); a query sees a key whose position is not after its own (and, with a sliding window, fewer
    than `window` positions before it). Grouped-query heads as in SDPA's
    enable_gqa (query head h reads kv head h // group size). Computed in float32 whatever the inputs'
    dtype; returns (B, H, T, E) in q's dtype."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    B, H, T, E = q_BHTE.shape
    K = k_BKTE.shape[1]
    q_BKGTE = q_BHTE.float().reshape(B, K, H // K, T, E) * (1.0 / math.sqrt(E))
    kv_2BKTE = torch.stack((k_BKTE, v_BKTE)).float()
    q_pos_T = positions_of(me)
    with torch.autocast(q_BHTE.device.type, enabled=False):  # autocast would run the matmuls in bf16
        weighted, row_sum = _ring_softmax(q_BKGTE, kv_2BKTE, q_pos_T, group, me, cp, positions_of, window)
    return (weighted / row_sum).reshape(B, H, T, E).to(q_BHTE.dtype)


def _ring_softmax(q_BKGTE, kv_2BKTE, q_pos_T, group, me: int, cp: int, positions_of, window):
    """The running softmax over the blocks round the ring: (weighted values, sum of exponentials)."""
    row_max = row_sum = weighted = None
    for step in range(cp):
        if step:
            kv_2BKTE = _RingPass.apply(kv_2BKTE, group, (me + 1) % cp, (me - 1) % cp)
        source = (me - step) % cp  # whose keys and values this rank holds now
        k_BK1SE, v_BK1SE = kv_2BKTE[0].unsqueeze(2), kv_2BKTE[1].unsqueeze(2)
        scores = q_BKGTE @ k_BK1SE.transpose(-1, -2)  # (B, K, G, T, S)
        scores = scores.masked_fill(~visible(q_pos_T, positions_of(source), window), float("-inf"))
        # The running maximum only keeps exp() in range; the result does not depend on it, so it needs no
        # gradient. Step 0 is the rank's own block, where every query sees at least itself: finite. A block
        # a sliding window hides wholly from a query gives it -inf, which the running maximum absorbs.
        block_max = scores.amax(-1, keepdim=True).detach()
        new_max = block_max if row_max is None else torch.maximum(row_max, block_max)
        probs = torch.exp(scores - new_max)
        if row_max is None:
            row_sum, weighted = probs.sum(-1, keepdim=True), probs @ v_BK1SE
        else:
            rescale = torch.exp(row_max - new_max)
            row_sum = row_sum * rescale + probs.sum(-1, keepdim=True)
            weighted = weighted * rescale + probs @ v_BK1SE
        row_max = new_max
    return weighted, row_sum


class ContextParallel:
    """One rank's share of context parallelism over `group`: which tokens it holds and how it attends."""

    def __init__(self, group):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._positions: dict[tuple, torch.Tensor] = {}

    def positions(self, local_len: int, device, rank: int | None = None) -> torch.Tensor:
        """Global positions of the `local_len` tokens that `rank` (default this one) holds."""
        rank = self.rank if rank is None else rank
        key = (local_len, str(device), rank)
        if key not in self._positions:
            self._positions[key] = zigzag_positions(local_len * self.cp, self.cp, rank, device)
        return self._positions[key]

    def shard(self, tensor_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of every sequence (dim 1) of a batch: inputs and targets alike."""
        seq_len = tensor_BT.shape[1]
        if seq_len % (2 * self.cp):
            raise PhalanxError(f"a sequence of {seq_len} tokens cannot be split into 2 x cp = {2 * self.cp} chunks")
        return tensor_BT.index_select(1, self.positions(seq_len // self.cp, tensor_BT.device))

    def attend(self, q_BHTE, k_BKTE, v_BKTE, window: int | None = None) -> torch.Tensor:
        """This rank's queries over the whole sequence's keys and values, round the ring: (B, H, T, E)."""
        T, device = q_BHTE.shape[2], q_BHTE.device
        return ring_attention(q_BHTE, k_BKTE, v_BKTE, self.group, lambda r: self.positions(T, device, r), window)

    def token_pass(self) -> RingPass:
        return RingPass(self)


class RingPass(TokenPass):
    """The forward of this rank's slice of every sequence: RoPE at the tokens' global positions, and
    attention round the cp ring."""

    def __init__(self, split: ContextParallel):
        self.split = split

    def rope_positions(self, length, max_seq_len, device):
        check_length(length * self.split.cp, max_seq_len)  # the whole sequence, not this rank's slice
        return self.split.positions(length, device)

    def attend(self, attention, q_BHTE, k_BKTE, v_BKTE):
        return heads_last(self.split.attend(q_BHTE, k_BKTE, v_BKTE, attention.sliding_window))


class SequenceBalance:
    """MoE.sequence_balance under context parallelism: a mixture of experts' load-balancing loss over the
    whole sequences of the micro-batch (tokens per expert and summed routing scores of every cp rank's
    slice), as one process computes it, rather than over this rank's slice.

    Each cp rank then holds the same loss and backpropagates it through its own tokens' scores, the
    other ranks' taken as constants. Scaled by cp there: the gradients' mean over the cp ranks (this
    module's docstring) then sums every token's share, which is one process's gradient."""

    def __init__(self, group):
        self.group, self.cp = group, dist.get_world_size(group)

    def __call__(self, counts_E: torch.Tensor, probs_sum_E: torch.Tensor, tokens: int):
        E = counts_E.numel()
        mine = torch.cat((counts_E.float(), probs_sum_E.detach().float(), counts_E.new_tensor([tokens]).float()))
        everyone = mine.clone()
        dist.all_reduce(everyone, group=self.group)
        scores_E = everyone[E : 2 * E] + self.cp * (probs_sum_E - probs_sum_E.detach())
        return everyone[:E], scores_E, everyone[-1]


def apply_sequence_balance(model, split) -> None:
    """Give each MoE layer the cp group's whole-sequence balance (nothing without context parallelism)."""
    from phalanx.models.moe import moe_layers

    if isinstance(split, ContextParallel):
        for moe in moe_layers(model):
            moe.sequence_balance = SequenceBalance(split.group)


class NoContextParallel:
    """cp = 1: every rank holds whole sequences."""

    @staticmethod
    def shard(tensor_BT: torch.Tensor) -> torch.Tensor:
        return tensor_BT

    @staticmethod
    def token_pass() -> None:
        return None  # the model's default: whole sequences


def context_split(layout, mesh) -> ContextParallel | NoContextParallel:
    """How this rank's batches are split along the sequence under `layout` (parallel/mesh.py)."""
    if layout.cp == 1:
        return NoContextParallel()
    return ContextParallel(mesh["cp"].get_group())


def gradient_mesh(mesh, layout, sharded: bool):
    """The ranks that average parameter gradients: data-parallel ranks and cp ranks together (parameters
    are replicated over cp). For FSDP2 (`sharded`) a 1-D shard mesh, or 2-D (replicate, shard) for HSDP,
    with cp folded into the shard dimension; for DDP one flat mesh of every replica, cp folded in."""
    if sharded:
        if layout.cp == 1:
            return mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        if layout.dp_replicate == 1:
            return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        # HSDP: (replicate, shard x cp). Slicing a flattened dimension back out of the root mesh is
        # deprecated, so flatten the three data dimensions and unflatten them into the two FSDP wants.
        every = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return every._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.cp), ("dp_replicate", "dp_shard_cp"))
    if layout.cp == 1:
        return mesh["dp_replicate"]
    return mesh["dp_replicate", "cp"]._flatten("dp_replicate_cp")
