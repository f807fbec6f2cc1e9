"""Peak memory of one training step on one rank, from the model's shapes, as phalanx's trainer runs it.

The trainer keeps float32 parameters, float32 gradients and AdamW's two float32 moments; computes in
bf16 on GPUs (autocast under none/ddp, FSDP2's MixedPrecisionPolicy under fsdp) and in float32 on CPU;
keeps the logits referenced until the step ends; and reduces gradients in float32. Rather than add up
"parameters + gradients + optimizer + activations", which is never what is live at one moment, this
module walks through one step (forward, backward unit by unit from the loss down to the embedding,
the optimizer step) adding and freeing what torch allocates, and reports the highest point and what
was live there.

What each unit keeps for backward was read off the model's ops (llama.py) and checked tensor by tensor
with autograd's saved-tensor hooks; the step's peaks were checked against measured allocations
(phalanx/plan/measure.py, tests/plan), and, for tensor parallelism, against the traced step
(plan/traced.py) and real gloo steps. Shape letters: B micro batch, T tokens, D dim, F ffn dim, V
vocab, H query heads, E head dim, KE = n_kv_heads * E, Nb parameters of one block.

Assumed and not modelled: SDPA runs a flash-style kernel (saves its output and a float32 logsumexp,
never the T x T scores: true on CPU, and on CUDA, where torch documents grouped-query attention for
its flash and math kernels only; a math fallback would add B x H x T x T per block); no torch.compile
(compiled blocks usually save less, so the plan errs high); on GPUs, fused AdamW (the trainer's choice,
train/optim.py) allocates no scratch, as measured on CPU. The allocator's rounding and
fragmentation, the runtime's own context and the collective library's buffers belong to the headroom.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs
from phalanx.models.lora import TARGETS
from phalanx.plan.blocks import BlockKind, block_kinds, mla_saved, moe_backward_temporaries, moe_saved

FP32, BF16, INT64 = 4, 2, 8

# What is live, grouped for the report.
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer states"
BUCKETS = "DDP gradient buckets"
WEIGHT_COPIES = "gathered/cast weights"  # FSDP's all-gathered blocks, autocast's bf16 weight copies
ACTIVATIONS = "activations"  # saved for backward, the held logits, the input tokens
TEMPORARIES = "temporaries"  # gradients of activations, collective buffers, optimizer scratch
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, BUCKETS, WEIGHT_COPIES, ACTIVATIONS, TEMPORARIES)


@dataclass(frozen=True)
class Workload:
    """One rank's share of a training step."""

    args: ModelArgs
    strategy: str  # none | ddp | fsdp
    world_size: int
    micro_batch: int
    seq_len: int
    accumulation: int = 1  # micro-batches per optimizer step on each rank
    activation_checkpointing: bool = False
    dtype: str = "bfloat16"  # the compute dtype: bfloat16 | float32
    device_kind: str = "gpu"  # gpu: nccl, bf16; cpu: gloo, float32 (fused AdamW on both)
    # Tensor parallelism (parallel/tensor_parallel.py): heads, FFN and vocabulary split tp ways, the
    # residual stream split along the sequence between the projections. world_size stays the FSDP degree.
    tp: int = 1
    # Micro-batches whose saved activations are alive together on this rank: more than one on a pipeline
    # stage (plan/parallelism.py's schedules); args.n_layers is then the stage's layers.
    in_flight: int = 1
    # LoRA (models/lora.py): adapters of this rank on lora_targets train, everything else is frozen; 0: off.
    lora_rank: int = 0
    lora_targets: str = "all"
    # Expert parallelism (parallel/expert_parallel.py): ranks of the FSDP group (world_size) that split a
    # mixture of experts' experts n_experts / ep each; FSDP shards those over the world_size / ep ranks
    # that hold the same ones, in a group of each MoE layer's own.
    ep: int = 1

    def __post_init__(self):
        if self.strategy not in ("none", "ddp", "fsdp"):
            raise PhalanxError(f"strategy must be none, ddp or fsdp, not {self.strategy!r}")
        if self.strategy == "none" and self.world_size != 1:
            raise PhalanxError("strategy none runs one process; use ddp or fsdp for more than one device")
        if self.dtype not in ("bfloat16", "float32") or self.device_kind not in ("gpu", "cpu"):
            raise PhalanxError(
                f"dtype must be bfloat16|float32 and device kind gpu|cpu, not {self.dtype}, {self.device_kind}"
            )
        for name in ("world_size", "micro_batch", "seq_len", "accumulation", "tp", "in_flight", "ep"):
            if getattr(self, name) < 1:
                raise PhalanxError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.ep > 1 and (self.strategy != "fsdp" or self.world_size % self.ep or self.args.n_experts % self.ep):
            raise PhalanxError(
                f"ep {self.ep} must divide the FSDP ranks ({self.world_size}, {self.strategy}) and the "
                f"{self.args.n_experts} experts"
            )
        if self.seq_len > self.args.max_seq_len:
            raise PhalanxError(
                f"sequence length {self.seq_len} exceeds the model's max_seq_len {self.args.max_seq_len}"
            )

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp" and self.world_size > 1  # one process: parallelize() wraps nothing

    @property
    def ddp(self) -> bool:
        return self.strategy == "ddp" and self.world_size > 1

    @property
    def regime(self) -> str:
        """float32 | autocast (fp32 weights, bf16 matmuls) | fsdp_bf16 (bf16 gathered weights)."""
        if self.dtype == "float32":
            return "float32"
        return "fsdp_bf16" if self.sharded else "autocast"


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_at: str  # the moment of the step where memory is highest
    at_peak: dict[str, int]  # what is live then, by category (sums to peak_bytes)
    parameters: int  # resident on this rank, whatever the moment
    gradients: int
    optimizer_states: int
    ddp_buckets: int
    activations: int  # saved for backward (with the held logits) when the forward ends

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def param_shapes(
    args: ModelArgs, tp: int = 1, lora_rank: int = 0, lora_targets: str = "all"
) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes by FSDP group, as Transformer(args) registers them: "root" (embedding, final
    norm, untied output) and "block" (each of the n_layers blocks has the same); with tensor
    parallelism, one rank's share (projections split by output or input, embedding and output by
    vocabulary, norms whole). "adapters": a block's LoRA matrices (besides "block"), split as
    models/lora.py's shard_adapters splits them: a column-parallel layer's B with its output, a
    row-parallel layer's A with its input."""
    d, kv, f = args.dim, args.n_kv_heads * args.head_size // tp, args.ffn_dim // tp
    hd, v = args.n_heads * args.head_size // tp, args.vocab_size // tp
    # (out, in, column-parallel) of each projection, by its name in the block
    projections = {
        "attention.wq": (hd, d, True),
        "attention.wk": (kv, d, True),
        "attention.wv": (kv, d, True),
        "attention.wo": (d, hd, False),
        "feed_forward.w1": (f, d, True),
        "feed_forward.w3": (f, d, True),
        "feed_forward.w2": (d, f, False),
    }
    block = [(out, inp) for out, inp, _ in projections.values()] + [(d,), (d,)]
    if args.qkv_bias:  # Qwen2: split with their projections
        block += [(hd,), (kv,), (kv,)]
    if args.qk_norm:  # Qwen3: one head's norm each, whole on every rank
        block += [(args.head_size,), (args.head_size,)]
    adapters = []
    for name in TARGETS[lora_targets] if lora_rank else ():
        out, inp, _ = projections[name]
        adapters += [(lora_rank, inp), (out, lora_rank)]  # local shapes: the split side is already 1/tp
    root = [(v, d), (d,)] + ([] if args.tie_embeddings else [(v, d)])
    return {"root": root, "block": block, "adapters": adapters}


def estimate(w: Workload) -> MemoryEstimate:
    """Walk one steady-state optimizer step (AdamW's moments already exist) and return its peak."""
    return _StepWalk(w).run()


class _Live:
    """Live bytes by category; remembers the highest total and what made it up."""

    def __init__(self):
        self.now: Counter[str] = Counter()
        self.peak, self.peak_at, self.at_peak = 0, "", {}

    def add(self, category: str, nbytes: float, moment: str) -> None:
        self.now[category] += int(nbytes)
        self._check(moment)

    def free(self, category: str, nbytes: float) -> None:
        self.now[category] -= int(nbytes)

    def spike(self, category: str, nbytes: float, moment: str) -> None:
        """Bytes alive for one moment only (made and freed inside one op)."""
        self.add(category, nbytes, moment)
        self.free(category, nbytes)

    def _check(self, moment: str) -> None:
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.peak_at = total, moment
            self.at_peak = {c: self.now[c] for c in CATEGORIES if self.now[c]}


@dataclass(frozen=True)
class _KindSizes:
    """One block kind's sizes on this rank (blocks.py): FSDP's group and expert parallelism's experts."""

    numel: int  # FSDP's group (the experts too unless expert parallelism holds them)
    padded: int
    matmul: int  # linear weights, which autocast copies to bf16 and caches
    trained: int
    trained_padded: int
    tensors: int  # trained parameter tensors (AdamW's step counters)
    experts: float  # under expert parallelism: this rank's shard of its n_experts / ep experts
    expert_gather: float  # ... and those n_experts / ep, gathered by their FSDP group (padded)
    expert_cast: int  # bytes of the experts' bf16 copies MoE.experts makes and the grouped GEMMs keep


class _StepWalk:
    def __init__(self, w: Workload):
        self.w, a = w, w.args
        self.live = _Live()
        n = w.world_size if w.sharded else 1
        shapes = param_shapes(a, w.tp, w.lora_rank, w.lora_targets)
        numel = lambda s: math.prod(s)  # noqa: E731
        padded = lambda s: math.ceil(s[0] / n) * n * math.prod(s[1:])  # FSDP2 pads dim 0 to N rows
        # Expert parallelism: FSDP shards each rank's n_experts / ep experts over the ranks holding the
        # same ones, by expert where they divide evenly, else along dim 1 (parallel/expert_parallel.py).
        replicas = self.expert_replicas = max(1, n // w.ep)

        def expert_padded(shape) -> int:  # one of the rank's 1/ep stacked expert weights, as FSDP pads it
            local = shape[0] // w.ep
            if local % replicas == 0:
                return local * math.prod(shape[1:])
            return local * math.ceil(shape[1] / replicas) * replicas * math.prod(shape[2:])

        lora = w.lora_rank > 0
        # Each layer's kind (one for a dense model; dense and MoE blocks for a mixture of experts).
        self.layers = block_kinds(a, w.tp)
        self.sizes: dict[str, _KindSizes] = {}
        for kind in {k.name: k for k in self.layers}.values():
            group = kind.shapes + shapes["adapters"] + (kind.experts if w.ep == 1 else [])
            trained = shapes["adapters"] if lora else group
            gathered = sum(expert_padded(s) for s in kind.experts) if w.ep > 1 else 0
            # The experts' .to(compute dtype) (models/moe.py) copies them where FSDP has not already
            # gathered them in bf16: under autocast.
            held = sum(numel(s) for s in kind.experts) / w.ep
            cast = w.regime == "autocast"
            self.sizes[kind.name] = _KindSizes(
                numel=sum(numel(s) for s in group),
                padded=sum(padded(s) for s in group),
                matmul=sum(numel(s) for s in group if len(s) == 2),
                trained=sum(numel(s) for s in trained),
                trained_padded=sum(padded(s) for s in trained),
                tensors=len(trained) + (len(kind.experts) if w.ep > 1 else 0),
                experts=gathered / replicas,
                expert_gather=gathered,
                expert_cast=int(BF16 * held) if cast and kind.experts else 0,
            )
        layer_sizes = [self.sizes[k.name] for k in self.layers]
        self.root_numel = sum(numel(s) for s in shapes["root"])
        self.root_padded = sum(padded(s) for s in shapes["root"])
        self.experts = sum(s.experts for s in layer_sizes)  # expert parallelism's shards, in groups of their own
        local_numel = (self.root_padded + sum(s.padded for s in layer_sizes)) / n + self.experts
        self.params = FP32 * local_numel
        # RoPE cos and sin tables (never sharded), and DeepSeek-V3's routing biases (float32 buffers).
        biases = a.n_experts * sum(k.moe for k in self.layers) if a.router_scoring == "sigmoid" else 0
        self.buffers = 2 * FP32 * a.max_seq_len * a.rope_dim + FP32 * biases
        # What trains: everything, or under LoRA the adapters alone (the root and the base are frozen:
        # no gradient, no optimizer state, nothing to reduce).
        self.root_trained = 0 if lora else self.root_numel
        self.root_trained_padded = 0 if lora else self.root_padded
        local_trained = (self.root_trained_padded + sum(s.trained_padded for s in layer_sizes)) / n + self.experts
        self.grads = FP32 * local_trained
        # AdamW: exp_avg and exp_avg_sq like each parameter, and one float32 `step` counter per parameter
        # tensor, which fused AdamW keeps on the parameter's device (on GPUs too, unlike the default).
        n_tensors = (0 if lora else len(shapes["root"])) + sum(s.tensors for s in layer_sizes)
        self.states = 2 * FP32 * local_trained + FP32 * n_tensors
        # gradient_as_bucket_view=False: a copy
        self.buckets = FP32 * (self.root_trained + sum(s.trained for s in layer_sizes)) if w.ddp else 0
        # FSDP's all-gathered weights and their unsharded gradients: bf16 under its mixed precision.
        self.gather = BF16 if w.regime == "fsdp_bf16" else FP32
        self.act = FP32 if w.regime == "float32" else BF16  # matmul outputs
        self.residual = BF16 if w.regime == "fsdp_bf16" else FP32  # the residual stream
        self.gloo_copies = w.device_kind == "cpu"  # gloo copies a collective's buffer; nccl does not
        bt = w.micro_batch * w.seq_len
        self.bt, self.btv = bt, bt * a.vocab_size
        self.logits = self.act * self.btv  # the trainer's `logits`, referenced until the step returns

    # -- what each unit saves for backward ---------------------------------------------------------
    def block_saved(self, kind: BlockKind | None = None) -> int:
        """Bytes autograd keeps for one block of `kind` (default: the first layer's), without activation
        checkpointing."""
        kind = kind or self.layers[0]
        if kind.moe or self.w.args.attention == "mla":
            return self._mixed_block_saved(kind)
        a, w, bt, tp = self.w.args, self.w, self.bt, self.w.tp
        d, kv, f = a.dim, a.n_kv_heads * a.head_size // tp, a.ffn_dim // tp
        # Under TP, tensors of the residual stream (x, norms, h) hold 1/tp of the tokens ("seq"), each
        # projection's all-gathered input is whole ("whole"), q and the attention output 1/tp of the heads.
        seq, whole, heads = bt * d // tp, bt * d, bt * a.n_heads * a.head_size // tp
        # Two RMSNorm rsqrt (B, T, 1) and SDPA's logsumexp (B, H, T), float32 in every regime.
        small = FP32 * (2 * bt // tp + w.micro_batch * a.n_heads // tp * w.seq_len)
        # Each norm's own tensors (its output is the projections'): on CPU without TP its hand-written
        # backward (models/rms_norm.py) keeps the float32 normalised value only; the composite keeps its
        # float32 input (in float32 the block input x or h itself) and the normalised value cast back.
        norms = 2 * self._norm_saved(seq) + self._adapters_saved()
        if w.regime == "float32":
            # norm out (shared by wq/wk/wv), q, SDPA out (= wo's input, a view), ffn norm out; k, v;
            # w1 out (silu's input), silu out, w3 out, their product.
            return norms + FP32 * (2 * whole + 2 * heads + 2 * bt * kv + 4 * bt * f) + small
        # bf16: each norm output cast once for the projections that share it (wq/wk/wv, w1/w3:
        # models/fused_linear.py), q, SDPA out; k, v; the four SwiGLU tensors.
        return norms + BF16 * (2 * whole + 2 * heads + 2 * bt * kv + 4 * bt * f) + small

    def _mixed_block_saved(self, kind: BlockKind) -> int:
        """A block whose attention is latent (MLA) or whose feed-forward is a mixture of experts: its two
        halves, each with its norm's tensors (blocks.py has what MLA and the MoE layer keep)."""
        a, w, bt, tp = self.w.args, self.w, self.bt, self.w.tp
        seq, whole = bt * a.dim // tp, bt * a.dim
        act = self.act
        if a.attention == "mla":
            cpu = w.device_kind == "cpu"
            attention = mla_saved(a, bt, w.micro_batch, w.seq_len, act, w.regime, self._norm_saved, cpu)
        else:
            kv, heads = a.n_kv_heads * a.head_size // tp, bt * a.n_heads * a.head_size // tp
            lse = FP32 * w.micro_batch * a.n_heads // tp * w.seq_len
            attention = act * (whole + 2 * heads + 2 * bt * kv) + lse
        if kind.moe:  # not split by TP: the whole sequence goes through it
            ffn = moe_saved(a, bt, act, self.residual, w.regime, w.ep)
        else:
            ffn = act * (whole + 4 * bt * a.ffn_dim // tp)
        return 2 * self._norm_saved(seq) + 2 * FP32 * bt // tp + attention + ffn

    def _adapters_saved(self) -> int:
        """What LoRA's adapters add to a block's saved tensors: each A's output (for B's gradient), and
        under bf16 each adapter's own cast of its input (for A's gradient): a LoraLinear is not fused
        with its neighbours (models/fused_linear.py), so q, k and v (and w1, w3) no longer share one
        cast. The frozen base projections save nothing more for themselves."""
        w, a = self.w, self.w.args
        if not w.lora_rank:
            return 0
        targets = TARGETS[w.lora_targets]
        saved = self.act * self.bt * w.lora_rank * len(targets)
        if w.regime != "float32":
            for group in (("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3")):
                # each adapter's own cast, where the fused projections saved one between them
                saved += BF16 * self.bt * a.dim * (len([t for t in targets if t in group]) - 1)
        return saved

    def _norm_saved(self, tokens_x_dim: int) -> int:
        """What one RMSNorm keeps for its backward, besides its rsqrt, for this many elements."""
        if self.w.device_kind == "cpu" and self.w.tp == 1:
            return FP32 * tokens_x_dim
        return FP32 * tokens_x_dim + (BF16 if self.w.regime == "fsdp_bf16" else FP32) * tokens_x_dim

    def rope_saved(self) -> int:
        """RoPE's tables, made once per forward for every block (models/decoder.py: rope_rotation) and kept
        by each block's products: under bf16 the cos cast and the signed sin, both bf16, T x E; in
        float32 the signed sin only (cos is the buffer itself)."""
        return (2 * BF16 if self.w.dtype == "bfloat16" else FP32) * self.w.seq_len * self.w.args.rope_dim

    def head_saved(self) -> int:
        """Final norm, output projection and loss: log_softmax's float32 result and the norm's tensors."""
        d, bt, tp = self.w.args.dim, self.bt, self.w.tp
        # The norm's own tensors hold 1/tp of the tokens under TP; the output projection's gathered input
        # is whole (the last of the three terms of each regime). The logits are gathered whole.
        seq = bt * d // tp
        norm = self._norm_saved(seq) + (FP32 if self.w.regime == "float32" else BF16) * bt * d
        return FP32 * self.btv + norm + FP32 * bt + FP32  # and nll_loss's total weight, a scalar

    def block_input(self) -> int:
        """What a checkpointed block keeps: its input (the residual stream)."""
        return self.residual * self.bt * self.w.args.dim // self.w.tp

    def autocast_copies(self, kind: BlockKind | None = None) -> tuple[int, int]:
        """bf16 copies of the matmul weights autocast makes and autograd keeps: (per block, output)."""
        if self.w.regime != "autocast":
            return 0, 0
        matmul = self.sizes[(kind or self.layers[0]).name].matmul
        return BF16 * matmul, BF16 * self.w.args.vocab_size // self.w.tp * self.w.args.dim

    # -- the step ------------------------------------------------------------------------------------
    def run(self) -> MemoryEstimate:
        w, live = self.w, self.live
        live.add(PARAMETERS, self.params + self.buffers, "start")
        live.add(OPTIMIZER, self.states, "start")
        live.add(BUCKETS, self.buckets, "start")
        live.add(ACTIVATIONS, 2 * INT64 * self.bt * w.accumulation, "start")  # every micro-batch's tokens
        # A pipeline stage's earlier micro-batches, waiting for their backward: their blocks' saved tensors.
        live.add(ACTIVATIONS, (w.in_flight - 1) * (self._blocks_saved() + self.rope_saved()), "start")
        saved = self._forward_saved()
        # Later micro-batches start with the earlier ones' gradients (and logits) alive; the last one
        # also reduces them, so the first and the last show the peak of any number.
        for micro in sorted({0, w.accumulation - 1}):
            self._forward(micro)
            self._backward(last=micro == w.accumulation - 1)
        self._optimizer_step()
        return MemoryEstimate(
            peak_bytes=live.peak,
            peak_at=live.peak_at,
            at_peak=live.at_peak,
            parameters=int(self.params + self.buffers),
            gradients=int(self.grads),
            optimizer_states=int(self.states),
            ddp_buckets=int(self.buckets),
            activations=int(saved),
        )

    def _blocks_saved(self) -> int:
        """What every block keeps between its forward and its backward: its input under activation
        checkpointing, else its saved tensors (and the experts' bf16 copies the grouped GEMMs keep)."""
        if self.w.activation_checkpointing:
            return len(self.layers) * self.block_input()
        return sum(self.block_saved(k) + self.sizes[k.name].expert_cast for k in self.layers)

    def _forward_saved(self) -> int:
        return self._blocks_saved() + self.rope_saved() + self.head_saved() + self.logits

    def _gather(self, numel_padded: float, moment: str) -> None:
        """FSDP all-gather of one group: the flat output buffer (and gloo's copy of it), then the
        copy-out into the unsharded parameters; the flat buffer is freed after."""
        nbytes = self.gather * numel_padded
        self.live.add(TEMPORARIES, nbytes, moment)
        if self.gloo_copies:
            self.live.spike(TEMPORARIES, nbytes, moment)
        self.live.add(WEIGHT_COPIES, nbytes, moment)
        self.live.free(TEMPORARIES, nbytes)

    def _forward(self, micro: int) -> None:
        w, live = self.w, self.live
        output_copy = self.autocast_copies()[1]
        cached = 0  # autocast's weight copies made so far
        if self.w.sharded:
            self._gather(self.root_padded, "forward: all-gather of the root group")
        live.add(ACTIVATIONS, self.rope_saved(), "forward: RoPE tables")
        for i, kind in enumerate(self.layers):
            where = f"forward: block {i}"
            size, copies = self.sizes[kind.name], self.autocast_copies(kind)[0]
            cached += copies
            if w.sharded:
                self._gather(size.padded, where)
            if size.expert_gather:  # the experts' own group, gathered while the MoE layer runs
                self._gather(size.expert_gather, where)
            if w.activation_checkpointing:
                live.add(ACTIVATIONS, self.block_input(), where)
                # autocast caches its weight copies until the autocast region ends, checkpoint or not;
                # the experts' explicit casts live only while the checkpointed block runs
                live.add(WEIGHT_COPIES, copies, where)
                live.spike(WEIGHT_COPIES, size.expert_cast, where)
            else:
                live.add(ACTIVATIONS, self.block_saved(kind), where)
                live.add(WEIGHT_COPIES, copies + size.expert_cast, where)
            live.free(WEIGHT_COPIES, self.gather * size.expert_gather)  # resharded after its forward
            if w.sharded and w.device_kind == "gpu":
                # The host runs ahead of the GPU: the next block's all-gather lands while this one computes.
                following = self.layers[i + 1] if i + 1 < len(self.layers) else kind
                live.spike(TEMPORARIES, self.gather * self.sizes[following.name].padded, where)
            if w.sharded:
                live.free(WEIGHT_COPIES, self.gather * size.padded)
        live.add(WEIGHT_COPIES, output_copy, "forward: output projection")
        live.add(ACTIVATIONS, self.logits, "forward: logits")
        head = self.head_saved()
        if w.dtype == "bfloat16":  # logits.float() lives while log_softmax runs
            live.spike(TEMPORARIES, FP32 * self.btv, "forward: loss")
        live.add(ACTIVATIONS, head, "forward: loss")
        if micro > 0:
            live.free(ACTIVATIONS, self.logits)  # the previous micro-batch's logits, now unreferenced
        if w.activation_checkpointing:  # leaving autocast: copies nobody saved are freed
            live.free(WEIGHT_COPIES, cached)

    def _backward(self, last: bool) -> None:
        w, live, a = self.w, self.live, self.w.args
        output_copy = self.autocast_copies()[1]
        d, f, v = a.dim, a.ffn_dim // w.tp, a.vocab_size // w.tp
        fsdp_grad = self.gather  # FSDP's unsharded gradients come in the gathered dtype
        gathered = lambda i: self.gather * self.sizes[self.layers[i].name].padded if w.sharded else 0  # noqa: E731
        prefetch = gathered(len(self.layers) - 1)

        # Loss, then the output projection. The gradient reaching the logits fires FSDP's root
        # pre-backward, which prefetches the last block.
        live.spike(TEMPORARIES, 2 * FP32 * self.btv, "backward: loss (log_softmax gradient)")
        live.free(ACTIVATIONS, FP32 * self.btv)  # log_softmax's result, released by its backward
        live.add(TEMPORARIES, FP32 * self.btv, "backward: output projection")
        self._prefetch(prefetch, "backward: output projection")
        if w.dtype == "bfloat16":
            live.spike(TEMPORARIES, BF16 * self.btv, "backward: output projection")
        if self.root_trained:
            self._weight_grad(v * d + d, "backward: output projection")  # output weight and final norm
        live.free(TEMPORARIES, FP32 * self.btv)
        live.free(ACTIVATIONS, self.head_saved() - FP32 * self.btv)
        live.free(WEIGHT_COPIES, output_copy)

        rs_input = 0  # FSDP keeps the latest reduce-scatter input until the next one
        for i in reversed(range(len(self.layers))):
            where = f"backward: block {i}"
            kind = self.layers[i]
            size, copies = self.sizes[kind.name], self.autocast_copies(kind)[0]
            if w.sharded:  # the prefetched all-gather is copied out; the next block is prefetched
                live.add(WEIGHT_COPIES, gathered(i), where)
                live.free(TEMPORARIES, prefetch)
                prefetch = gathered(i - 1) if i > 0 else 0
                self._prefetch(prefetch, where)
            if size.expert_gather:  # gathered again for the MoE layer's recompute and backward
                self._gather(size.expert_gather, where)
            if w.activation_checkpointing:  # recompute the block's forward
                live.add(ACTIVATIONS, self.block_saved(kind), where + " (recompute)")
                live.add(WEIGHT_COPIES, copies + size.expert_cast, where + " (recompute)")
            # Inside the block: SwiGLU's backward holds the gradients of w2's input and of both its
            # factors (3 x B T F) while w2's input is already freed, beside the residual gradients; an
            # MoE layer's the same over its routed rows (blocks.py).
            ffn = moe_backward_temporaries(a, self.bt, self.act) if kind.moe else 2 * self.act * self.bt * f
            live.spike(TEMPORARIES, ffn + 2 * self.residual * self.bt * d, where)
            if size.expert_gather:  # the MoE layer's backward ends first: its group reduce-scatters
                self._weight_grad(size.expert_gather, where)
                live.free(WEIGHT_COPIES, self.gather * size.expert_gather)
                rs_input = self._reduce_scatter(
                    size.expert_gather,
                    size.expert_gather,
                    fsdp_grad,
                    rs_input,
                    last,
                    where + " experts' reduce-scatter",
                    shards=self.expert_replicas,
                )
            self._weight_grad(size.trained, where)
            saved = self.block_saved(kind) + (self.block_input() if w.activation_checkpointing else 0)
            live.free(ACTIVATIONS, saved)
            live.free(WEIGHT_COPIES, copies + size.expert_cast)
            if w.sharded:
                live.free(WEIGHT_COPIES, gathered(i))  # reshard
                rs_input = self._reduce_scatter(
                    size.trained, size.trained_padded, fsdp_grad, rs_input, last, where + " reduce-scatter"
                )

        live.free(ACTIVATIONS, self.rope_saved())  # the last block that kept them is done
        # Embedding: a dense V x D gradient. Tied, autograd adds it to the output projection's (waiting
        # in the engine's input buffer) out of place: old, new and sum are alive together for a moment.
        where = "backward: embedding"
        emb = (FP32 if not w.sharded else fsdp_grad) * v * d
        if not self.root_trained:  # frozen (LoRA): no gradient
            pass
        elif a.tie_embeddings:
            live.spike(TEMPORARIES, 2 * emb, where)
        else:
            self._weight_grad(v * d, where)
        if w.sharded:
            live.free(WEIGHT_COPIES, self.gather * self.root_padded)  # root reshards after backward
            rs_input = self._reduce_scatter(
                self.root_trained,
                self.root_trained_padded,
                fsdp_grad,
                rs_input,
                last,
                "backward: reduce-scatter of the root group",
            )
            live.free(TEMPORARIES, rs_input)

    def _prefetch(self, nbytes: float, moment: str) -> None:
        """FSDP's backward prefetch: the next block's all-gather output waits for its copy-out."""
        self.live.add(TEMPORARIES, nbytes, moment)
        if self.gloo_copies:
            self.live.spike(TEMPORARIES, nbytes, moment)

    def _weight_grad(self, numel: float, moment: str) -> None:
        """A group's weight gradients appear: float32 gradients (DDP, one process), FSDP's unsharded
        ones (gathered dtype) until the reduce-scatter, or onto accumulated float32 ones."""
        if not self.w.sharded:
            if self.live.now[GRADIENTS] < self.grads:  # the first micro-batch allocates them
                self.live.add(GRADIENTS, FP32 * numel, moment)
            return
        self.live.add(TEMPORARIES, self.gather * numel, moment)

    def _reduce_scatter(
        self,
        numel: float,
        padded: float,
        grad_bytes: int,
        previous_input: float,
        last: bool,
        moment: str,
        shards: int | None = None,
    ) -> float:
        """FSDP post-backward of one group (over `shards` ranks, by default the FSDP degree); returns the
        reduce-scatter input it leaves alive."""
        live, n = self.live, shards or self.w.world_size
        if not last:  # no gradient sync: keep the unsharded gradients, upcast to float32
            live.free(TEMPORARIES, grad_bytes * numel)
            live.add(GRADIENTS, FP32 * numel, moment)
            return previous_input
        live.free(TEMPORARIES, previous_input)
        rs_input = FP32 * padded
        live.add(TEMPORARIES, rs_input, moment)
        if self.w.accumulation > 1:  # the accumulated float32 gradients are copied in, then dropped
            live.free(GRADIENTS, FP32 * numel)
        live.free(TEMPORARIES, grad_bytes * numel)
        live.add(GRADIENTS, FP32 * padded / n, moment)  # this rank's shard, views of the output
        if self.gloo_copies:
            live.spike(TEMPORARIES, rs_input, moment)
        return rs_input

    def _optimizer_step(self) -> None:
        """Gradients (all of them now), the held logits and AdamW's moments: the trainer's fused AdamW
        (train/optim.py) updates each parameter in place in one kernel and allocates no scratch (measured
        with torch's memory tracker on CPU, plain and DTensor parameters; the per-tensor default held two
        tensors of the largest parameter here, foreach a whole group's sqrt(exp_avg_sq)). Clipping's
        norms are scalars. So the step's moment is what is live when it starts."""
        self.live.add(TEMPORARIES, 0, "optimizer step")
