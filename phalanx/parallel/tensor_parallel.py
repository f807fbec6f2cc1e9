"""Tensor parallelism for the Llama model with DTensor, applied from outside (the model file knows nothing).

The plan is Megatron's with sequence parallelism: in each block the q/k/v and gate/up projections are
split by output (each rank computes its share of the heads and of the FFN), the output and down
projections by input, so a block costs one all-gather and one reduce-scatter each for attention and
FFN. Between them the residual stream stays split along the sequence, so the RMSNorms (SequenceParallel)
and the residual adds touch only each rank's 1/tp of the tokens. The embedding is split by vocabulary,
the output projection by vocabulary too (gathered into full logits for the loss).

A mixture of experts' block is not split: every tensor-parallel rank gathers the whole sequence, as for
the dense FFN, and routes and computes it with whole experts (or, under expert parallelism, sends it to
its ep peers of the same tp coordinate), then keeps its own slice of the result. Its weights are the same
on every tp rank, and so are their gradients, since the slice's backward gathers the whole gradient back.
Splitting the experts themselves (torchtitan's expert tensor parallelism) is not built.

Multi-head latent attention (DeepSeek-V3, models/mla.py) splits by heads too: the up-projections from
the latents (wq_b, or wq without a q bottleneck, and wkv_b) by output, wo by input. The down-projections
to the latents and their norms (wq_a, q_norm, wkv_a, kv_norm) are computed whole on every rank, as
DTensors replicated over tp (Replicated): each rank backpropagates only its own heads through them, so
their gradients are partial sums that DTensor adds up over the ranks. The rotated key part, shared by
every head, leaves wkv_a's output as a local tensor whose gradient is marked partial (mla.py) for the
same reason.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from phalanx.errors import PhalanxError
from phalanx.models.moe import MoE


class Replicated(ParallelStyle):
    """A module every tensor-parallel rank computes whole, on DTensors: its parameters replicated over
    tp, so that their partial gradients are summed over the ranks (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh)  # no partition function: every parameter replicated


def check_tp(args, tp: int) -> None:
    """Each rank must hold whole heads and an equal share of the FFN and vocabulary."""
    for what, n in (
        ("n_heads", args.n_heads),
        ("n_kv_heads", args.n_kv_heads),
        ("ffn_dim", args.ffn_dim),
        ("vocab_size", args.vocab_size),
    ):
        if n % tp:
            raise PhalanxError(f"parallel.tp={tp} does not divide the model's {what} ({n})")


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Split `model` (a phalanx Transformer, before any data-parallel wrapping) across `tp_mesh`."""
    check_tp(model.args, tp_mesh.size())
    tied = model.args.tie_embeddings
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    if tied:  # both split the shared (vocab, dim) weight by rows: one parameter again
        model.output.weight = model.tok_embeddings.weight
    # The attention takes (x, rope tables, token pass): only x is distributed.
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **(_latent_attention_plan(block.attention) if model.args.attention == "mla" else _attention_plan()),
        }
        if isinstance(block.feed_forward, MoE):
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            )
        else:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w3"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
        if model.args.qk_norm:
            # Qwen3's per-head norms see (B, T, heads, E) with this rank's share of the heads: the
            # weight is replicated and its gradient, summed over the heads of every rank, all-reduced.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def _attention_plan() -> dict:
    return {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
    }


def _latent_attention_plan(attention: nn.Module) -> dict:
    """The input stays a DTensor (replicated) through the replicated down-projections and norms, into the
    up-projections, which take it as it is and give local tensors of this rank's heads."""
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=False,
        ),
        "attention.wkv_a": Replicated(),
        "attention.kv_norm": Replicated(),
        "attention.wkv_b": ColwiseParallel(),
    }
    if attention.q_low_rank:
        plan |= {"attention.wq_a": Replicated(), "attention.q_norm": Replicated(), "attention.wq_b": ColwiseParallel()}
    else:
        plan["attention.wq"] = ColwiseParallel()
    return plan
