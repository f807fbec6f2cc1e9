"""A 4-D layout as the planner sees it: pipeline bubble, micro-batches in flight, communication per step,
and the projected step time that follows from them.

The mesh is parallel/mesh.py's (pp, dp_replicate, dp_shard, cp, tp; tp innermost), so a group stays
inside one node of GPUS_PER_NODE when the product of its own and the inner dimensions fits there.
Volumes are bytes one rank sends per optimizer step (a ring collective over n ranks moves (n-1)/n of
its buffer per rank); times divide them by the link the group crosses. Only tensor-parallel and
pipeline traffic is counted as exposed: FSDP's gathers and reduce-scatters and CP's ring passes overlap
the compute (torch prefetches them), so only what exceeds the compute shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.plan.blocks import block_kinds
from phalanx.plan.memory import BF16, FP32, param_shapes

SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
GPUS_PER_NODE = 8
INTERLEAVED_STAGES_PER_RANK = 2  # torchtitan's default for interleaved 1F1B


@dataclass(frozen=True)
class Parallelism:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = "1f1b"
    # Micro-batches per optimizer step on each data-parallel replica: the pipeline's, or (pp=1) gradient
    # accumulation's.
    microbatches: int = 1
    # Expert parallelism: ranks of dp_shard that split a mixture of experts' experts (not a mesh
    # dimension of its own: parallel/mesh.py).
    ep: int = 1

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "microbatches", "ep"):
            if getattr(self, name) < 1:
                raise PhalanxError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULES:
            raise PhalanxError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, not {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank."""
        return INTERLEAVED_STAGES_PER_RANK if self.schedule == "interleaved_1f1b" and self.pp > 1 else 1

    @property
    def uses_fsdp(self) -> bool:
        """As parallel/build.py: FSDP2 whenever parameters are sharded by dp_shard, or TP or PP meets
        replicas."""
        return self.dp_shard > 1 or ((self.tp > 1 or self.pp > 1) and self.dp * self.cp > 1)

    @property
    def shard_degree(self) -> int:
        """Ranks one FSDP shard group spans: parameters are replicated over cp, so cp ranks join it."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        parts = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("dp_shard", self.dp_shard),
            ("cp", self.cp),
            ("tp", self.tp),
            ("ep", self.ep),
        ]
        text = " x ".join(f"{name}={size}" for name, size in parts if size > 1) or "one rank"
        if self.pp > 1:
            text += f" ({self.schedule}, {self.microbatches} micro-batches)"
        return text

    def check(self, args: ModelArgs, seq_len: int, world_size: int) -> None:
        """A PhalanxError naming what does not fit together."""
        from phalanx.parallel.tensor_parallel import check_tp

        if self.world_size != world_size:
            raise PhalanxError(
                f"the layout {self.describe()} has {self.world_size} ranks, not the {world_size} of --gpus"
            )
        if self.tp > 1:
            check_tp(args, self.tp)
            if args.attention == "mla":  # the trainer splits its heads; the memory walk does not model it
                raise PhalanxError("the planner does not model tensor parallelism of multi-head latent attention yet")
        if self.ep > 1 and (self.dp_shard % self.ep or args.n_experts % self.ep):
            raise PhalanxError(
                f"--ep {self.ep} must divide dp_shard ({self.dp_shard}) and the model's {args.n_experts} experts"
            )
        if args.n_experts and self.cp > 1 and (self.ep > 1 or args.attention == "mla"):  # as train/resume.py
            what = "--ep" if self.ep > 1 else "multi-head latent attention"
            raise PhalanxError(
                f"a mixture of experts ({args.n_experts} experts) does not run with context parallelism and {what} yet"
            )
        chunks = self.pp * self.virtual_stages
        if chunks > args.n_layers:
            raise PhalanxError(f"--pp {self.pp} makes {chunks} pipeline stages for {args.n_layers} layers")
        if seq_len % self.cp:
            raise PhalanxError(f"--cp {self.cp} does not divide the sequence length {seq_len}")
        if self.pp > 1 and self.microbatches < self.pp:
            raise PhalanxError(
                f"{self.microbatches} pipeline micro-batches cannot fill {self.pp} stages (--pp-microbatches >= --pp)"
            )

    # -- pipeline -----------------------------------------------------------------------------------
    def bubble_fraction(self) -> float:
        """Idle share of a pipeline step: (pp-1)/(m+pp-1) for 1F1B and GPipe; interleaving with v chunks
        per rank divides the warm-up and drain by v."""
        if self.pp == 1:
            return 0.0
        idle = (self.pp - 1) / self.virtual_stages
        return idle / (self.microbatches + idle)

    def in_flight(self) -> float:
        """Micro-batches of a whole stage's saved activations alive at once on the first stage, the
        busiest: GPipe runs every forward first; 1F1B holds at most pp; interleaved 1F1B warms up with
        2(pp-1) + (v-1)pp + 1 chunk forwards of 1/v of a stage each (Megatron's schedule)."""
        m, pp, v = self.microbatches, self.pp, self.virtual_stages
        if pp == 1:
            return 1.0
        if self.schedule == "gpipe":
            return float(m)
        if self.schedule == "1f1b":
            return float(min(m, pp))
        return min(m * v, 2 * (pp - 1) + (v - 1) * pp + 1) / v

    def stage_layers(self, args: ModelArgs) -> int:
        """Blocks on the busiest pipeline rank (the split is by layer, the remainder to the first ranks)."""
        return math.ceil(args.n_layers / self.pp)

    # -- where each group's ranks are ---------------------------------------------------------------
    def intra_node(self, dim: str) -> bool:
        inner = {
            "tp": self.tp,
            "cp": self.cp * self.tp,
            "ep": self.ep * self.cp * self.tp,  # ep ranks are the innermost of dp_shard
            "dp_shard": self.dp_shard * self.cp * self.tp,
            "dp_replicate": self.dp * self.cp * self.tp,
            "pp": self.world_size,
        }[dim]
        return inner <= GPUS_PER_NODE


def stage_param_numel(args: ModelArgs, par: Parallelism, experts: bool = False) -> int:
    """Parameters one TP rank of the busiest stage holds before FSDP shards them (embedding and head
    counted on it: the planner takes the heavier of the first and last stage as both); its blocks are
    the model's last (a mixture of experts' MoE blocks, not its dense first ones). experts=False: FSDP's
    share, which leaves out the experts that expert parallelism splits; True: those experts alone (each
    rank's 1/ep of them, before their own FSDP group shards them)."""
    root = sum(math.prod(s) for s in param_shapes(args, par.tp)["root"])
    stage = block_kinds(args, par.tp)[-par.stage_layers(args) :]
    if experts:
        return sum(math.prod(s) for k in stage for s in k.experts) // par.ep if par.ep > 1 else 0
    own = sum(math.prod(s) for k in stage for s in k.shapes + (k.experts if par.ep == 1 else []))
    return root + own


def moe_layers_on_stage(args: ModelArgs, par: Parallelism) -> int:
    return sum(k.moe for k in block_kinds(args, par.tp)[-par.stage_layers(args) :])


def unsplit_flops_per_token(args: ModelArgs) -> float:
    """Training FLOPs per token (6 x parameters, as flops.py counts them) of the MoE layers, which TP
    does not split: their router, k routed experts and shared experts, active for each token."""
    if not args.n_experts:
        return 0.0
    experts = args.n_experts_per_token + args.n_shared_experts
    per_layer = args.dim * args.n_experts + experts * 3 * args.dim * args.moe_ffn_dim
    return 6.0 * per_layer * sum(args.is_moe_layer(i) for i in range(args.n_layers))


def communication(args: ModelArgs, par: Parallelism, micro_batch: int, seq_len: int, dtype: str) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by kind."""
    act = BF16 if dtype == "bfloat16" else FP32
    gather = act if par.uses_fsdp else FP32
    m = par.microbatches
    tokens = micro_batch * seq_len // par.cp  # this rank's tokens of one micro-batch
    layers = par.stage_layers(args)
    params = stage_param_numel(args, par)
    ring = lambda n: (n - 1) / n
    out = {}
    if par.uses_fsdp:
        # all-gather before forward and again before backward (reshard after forward), per micro-batch;
        # one float32 reduce-scatter of the gradients per step.
        out["fsdp all-gather"] = 2 * m * params * gather * ring(par.shard_degree)
        out["fsdp reduce-scatter"] = params * FP32 * ring(par.shard_degree)
    if par.dp_replicate > 1:  # HSDP's (or DDP's) all-reduce of each shard across replicas
        shard = params / (par.shard_degree if par.uses_fsdp else 1)
        out["dp all-reduce"] = 2 * shard * FP32 * ring(par.dp_replicate)
    if par.tp > 1:
        # Each block: all-gather into attention and FFN, reduce-scatter out of them, forward and backward;
        # the head gathers the logits (vocabulary-split) for the loss, and scatters their gradient.
        per_block = 8 * tokens * args.dim * act * ring(par.tp)
        logits = 2 * tokens * args.vocab_size * act * ring(par.tp)
        out["tp activations"] = m * (layers * per_block + logits)
    if par.pp > 1:
        # Each micro-batch's activations go to the next stage, their gradients come back; under
        # sequence parallelism each TP rank sends its 1/tp of the tokens.
        out["pp send/recv"] = 2 * m * par.virtual_stages * tokens * args.dim * act / par.tp
    moe_layers = moe_layers_on_stage(args, par)
    if par.ep > 1 and moe_layers:
        # Each MoE layer sends its routed rows (k per token, whole sequences under TP) to the ranks
        # holding their experts and brings the results back, forward and backward: 4 all-to-alls, of
        # which (ep-1)/ep leaves the rank on average (routing evenly spread).
        rows = micro_batch * seq_len * args.n_experts_per_token * args.dim * act
        out["ep all-to-all"] = m * moe_layers * 4 * rows * ring(par.ep)
        # FSDP over the ranks holding the same experts (parallel/expert_parallel.py), as for the rest:
        # gathered for forward and for backward, their gradients reduce-scattered once a step.
        experts = stage_param_numel(args, par, experts=True)
        out["expert all-gather"] = 2 * m * experts * gather * ring(par.dp // par.ep)
        out["expert reduce-scatter"] = experts * FP32 * ring(par.dp // par.ep)
    if par.cp > 1:
        # Ring attention: each rank's K and V chunk passes round the other cp-1 ranks in forward; backward
        # passes K, V and their gradients: three passes' worth in all.
        kv = 2 * tokens * args.n_kv_heads * args.head_size // par.tp * act
        out["cp K/V ring"] = 3 * m * layers * kv * (par.cp - 1)
    return out


def step_time(
    args: ModelArgs,
    par: Parallelism,
    comm: dict[str, float],
    *,
    micro_batch: int,
    seq_len: int,
    flops_per_token: float,
    peak_tflops: float,
    mfu: float,
    intra_gbps: float,
    inter_gbps: float,
    recompute: bool,
    unsplit_flops_per_token: float = 0.0,
) -> dict[str, float]:
    """Seconds per optimizer step on the busiest rank: compute at `mfu` of peak stretched by the bubble
    (and by activation checkpointing's recomputed forward), plus exposed communication.
    unsplit_flops_per_token: the part of flops_per_token that TP does not split (a mixture of experts'
    layers: every TP rank runs them on the whole sequence), so each TP rank computes it in full."""
    m = par.microbatches
    tokens_per_replica = m * micro_batch * seq_len
    ac = 4 / 3 if recompute else 1  # AC: 8N instead of 6N
    split = (flops_per_token - unsplit_flops_per_token) / par.tp + unsplit_flops_per_token
    flops = tokens_per_replica * split * ac
    compute = flops / (par.pp * par.cp) / (mfu * peak_tflops * 1e12)
    bubble = par.bubble_fraction()
    busy = compute / (1 - bubble)

    def seconds(kind: str, dim: str) -> float:
        bw = intra_gbps if par.intra_node(dim) else inter_gbps
        return comm.get(kind, 0.0) / (bw * 1e9)

    # The experts' all-to-alls sit between routing and the experts, and the experts and the next layer:
    # exposed, as TP's are (no overlap of dispatch with compute is built).
    exposed = seconds("tp activations", "tp") + seconds("pp send/recv", "pp") + seconds("ep all-to-all", "ep")
    overlapped = (
        seconds("fsdp all-gather", "dp_shard")
        + seconds("fsdp reduce-scatter", "dp_shard")
        + seconds("dp all-reduce", "dp_replicate")
        + seconds("expert all-gather", "dp_shard")
        + seconds("expert reduce-scatter", "dp_shard")
        + seconds("cp K/V ring", "cp")
    )
    total = busy + exposed + max(0.0, overlapped - compute)
    return {
        "compute_s": compute,
        "bubble_s": busy - compute,
        "exposed_comm_s": total - busy,
        "step_s": total,
        "tokens_per_step": tokens_per_replica * par.dp,
        "tokens_per_sec": tokens_per_replica * par.dp / total,
    }
