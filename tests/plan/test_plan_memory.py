"""The planner's memory arithmetic: resident state to the byte, sharding, activations as autograd saves them."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.flops import count_params
from phalanx.models.presets import MODEL_PRESETS
from phalanx.plan.memory import CATEGORIES, Workload, _StepWalk, estimate, param_shapes

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=384, max_seq_len=64)


def rope_bytes(args):
    return 2 * 4 * args.max_seq_len * args.head_size


def step_counters(args):
    """AdamW's float32 `step`, one per parameter tensor (embedding, final norm, output if untied, and each
    block's)."""
    return 4 * (2 + (not args.tie_embeddings) + len(param_shapes(args)["block"]) * args.n_layers)


# Dense models (param_shapes); mixtures of experts have block kinds of their own (tests/plan/test_plan_moe.py).
@pytest.mark.parametrize("name", sorted(n for n, args in MODEL_PRESETS.items() if not args.n_experts))
def test_param_shapes_are_the_models(name):
    args = MODEL_PRESETS[name]
    with torch.device("meta"):
        model = Transformer(args)
    real = {
        "root": [tuple(p.shape) for n, p in model.named_parameters() if not n.startswith("layers.")],
        "block": [tuple(p.shape) for p in model.layers["0"].parameters()],
    }
    shapes = param_shapes(args)
    assert sorted(shapes["root"]) == sorted(real["root"]) and sorted(shapes["block"]) == sorted(real["block"])
    total = sum(math.prod(s) for s in shapes["root"]) + args.n_layers * sum(math.prod(s) for s in shapes["block"])
    assert total == count_params(args) == model.num_params()


@pytest.mark.parametrize("name", ["125m", "8b"])
def test_resident_state_is_count_params_times_bytes(name):
    args, n = MODEL_PRESETS[name], count_params(MODEL_PRESETS[name])
    for strategy, world in (("none", 1), ("ddp", 8), ("fsdp", 1)):
        est = estimate(Workload(args, strategy, world, 1, 128))
        assert est.parameters == 4 * n + rope_bytes(args)  # float32 master weights, unsharded
        assert est.gradients == 4 * n
        # exp_avg + exp_avg_sq, and fused AdamW's float32 step counter per tensor on the device
        assert est.optimizer_states == 8 * n + step_counters(args)
        assert est.ddp_buckets == (4 * n if strategy == "ddp" else 0)  # one process: nothing is wrapped
    cpu = estimate(Workload(args, "ddp", 2, 1, 128, dtype="float32", device_kind="cpu"))
    assert cpu.optimizer_states == 8 * n + step_counters(args)


def test_fsdp_divides_sharded_state_by_the_ranks():
    args = MODEL_PRESETS["8b"]  # every dim-0 divides by 8: no padding
    one = estimate(Workload(args, "ddp", 8, 1, 128))
    for world in (2, 8):
        sharded = estimate(Workload(args, "fsdp", world, 1, 128))
        assert sharded.gradients * world == one.gradients
        # the moments are sharded; the step counters are scalars, one per parameter on every rank
        assert (sharded.optimizer_states - step_counters(args)) * world == one.optimizer_states - step_counters(args)
        assert sharded.parameters - rope_bytes(args) == (one.parameters - rope_bytes(args)) // world
        assert sharded.ddp_buckets == 0 and sharded.peak_bytes < one.peak_bytes


def test_fsdp_pads_each_parameter_to_whole_rows_per_rank():
    args = dataclasses.replace(SMALL, vocab_size=385)  # 385 rows over 4 ranks: 97 each, 3 of padding
    est = estimate(Workload(args, "fsdp", 4, 1, 32))
    rows = sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for s in param_shapes(args)["root"])
    rows += args.n_layers * sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for s in param_shapes(args)["block"])
    assert est.parameters == 4 * rows + rope_bytes(args) and 4 * rows > 4 * count_params(args) / 4


def test_activation_checkpointing_keeps_only_block_inputs():
    args = MODEL_PRESETS["8b"]
    plain = estimate(Workload(args, "fsdp", 8, 2, 4096))
    ac = estimate(Workload(args, "fsdp", 8, 2, 4096, activation_checkpointing=True))
    assert ac.activations < plain.activations / 4 and ac.peak_bytes < plain.peak_bytes
    walk = _StepWalk(Workload(args, "fsdp", 8, 2, 4096, activation_checkpointing=True))
    assert walk.block_input() == 2 * 2 * 4096 * args.dim  # bf16 residual stream of B x T tokens


def test_activations_grow_linearly_with_tokens():
    args = MODEL_PRESETS["1b"]
    acts = [estimate(Workload(args, "ddp", 8, b, 1024)).activations for b in (1, 2, 4)]
    assert acts[2] - acts[1] == 2 * (acts[1] - acts[0]) > 0


def test_peak_is_what_is_live_at_its_moment():
    for strategy, world, ac, accumulation in (("ddp", 4, False, 1), ("fsdp", 8, True, 4), ("none", 1, False, 2)):
        est = estimate(Workload(MODEL_PRESETS["1b"], strategy, world, 2, 2048, accumulation, ac))
        assert sum(est.at_peak.values()) == est.peak_bytes and set(est.at_peak) <= set(CATEGORIES)
        resident = est.parameters + est.optimizer_states + est.ddp_buckets
        assert est.peak_bytes > resident + est.gradients  # the optimizer step alone holds all of these


def test_accumulation_keeps_gradients_alive_between_micro_batches():
    args = MODEL_PRESETS["1b"]
    for strategy in ("ddp", "fsdp"):
        one = estimate(Workload(args, strategy, 8, 2, 2048, 1)).peak_bytes
        four = estimate(Workload(args, strategy, 8, 2, 2048, 4)).peak_bytes
        assert four > one
    # FSDP2 without gradient sync keeps unsharded float32 gradients: the whole model's, on every rank
    fsdp = estimate(Workload(args, "fsdp", 8, 1, 256, 2))
    assert fsdp.at_peak.get("gradients", 0) >= 4 * count_params(args) * 0.9


# -- activations as autograd saves them ---------------------------------------------------------------
def saved_bytes_by_unit(args, regime, batch, seq):
    """Bytes of the distinct storages autograd saves, by the unit whose forward saved them ("shared":
    saved by more than one unit)."""
    torch.manual_seed(0)
    model = Transformer(args)
    autocast = regime == "autocast"
    if regime == "fsdp_bf16":  # what FSDP2's MixedPrecisionPolicy gives: bf16 weights, buffers untouched
        model = model.to(torch.bfloat16)
        model.rope_cos.data, model.rope_sin.data = model.rope_cos.float(), model.rope_sin.float()
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    unit, saved = ["embedding"], {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and t.dtype != torch.int64:  # tokens are counted apart
            nbytes, where = saved.get(storage.data_ptr(), (storage.nbytes(), unit[0]))
            saved[storage.data_ptr()] = (nbytes, where if where == unit[0] else "shared")
        return t

    for i, layer in enumerate(model.layers.values()):
        layer.register_forward_pre_hook(lambda *_, i=i: unit.__setitem__(0, f"block{i}"))
    model.norm.register_forward_pre_hook(lambda *_: unit.__setitem__(0, "head"))
    tokens = torch.randint(0, args.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    totals = {}
    for nbytes, where in saved.values():
        totals[where] = totals.get(where, 0) + nbytes
    return totals


@pytest.mark.parametrize("regime", ["float32", "autocast", "fsdp_bf16"])
def test_block_and_head_activations_match_what_autograd_saves(regime):
    batch, seq = 2, 48
    dtype = "float32" if regime == "float32" else "bfloat16"
    strategy, world = ("fsdp", 2) if regime == "fsdp_bf16" else ("ddp", 2)
    walk = _StepWalk(Workload(SMALL, strategy, world, batch, seq, dtype=dtype, device_kind="cpu"))
    assert walk.w.regime == regime
    measured = saved_bytes_by_unit(SMALL, regime, batch, seq)
    per_block, output_copy = walk.autocast_copies()
    assert measured["block0"] == measured["block1"] == walk.block_saved() + per_block
    assert measured["shared"] == walk.rope_saved()  # RoPE's tables, made once for every block
    assert measured["head"] == walk.head_saved() + output_copy
