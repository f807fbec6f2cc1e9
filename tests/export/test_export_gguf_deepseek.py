"""GGUF export of DeepSeek-V3 (family deepseek_v3) as llama.cpp's `deepseek2` architecture
(phalanx/export/gguf_deepseek.py): small seeded random models (float32), loaded in real llama.cpp
(llama-cpp-python), must give phalanx's logits and greedy tokens, with q through a low-rank bottleneck
and without one, rotary pairs in DeepSeek's layout and in halves, expert groups, shared experts, dense
first layers, tied embeddings and YaRN in each of the three forms llama.cpp scales differently. The
routing and RoPE settings are shown to matter: phalanx with any one of them changed is far from what
llama.cpp computes. The file holds deepseek2's own tensors and keys, read_deepseek2 gives back the very
model, and what llama.cpp would compute otherwise is refused in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from phalanx.data.tokenizer import train_tokenizer
from phalanx.errors import PhalanxError
from phalanx.export.gguf_export import write_gguf
from phalanx.models.decoder import Transformer
from phalanx.models.presets import MODEL_PRESETS
from phalanx.models.rope import yarn_attention_factor
from phalanx.run.gguf_deepseek import read_deepseek2
from phalanx.run.gguf_format import interleave_rotary_rows
from phalanx.run.model_loader import LoadedModel, load_model
from tests.export.test_export_gguf_families import (
    BASE,
    NEW_TOKENS,
    TOLERANCE,
    llama_cpp_greedy,
    llama_cpp_logits,
    phalanx_greedy,
    phalanx_logits,
    prompt_ids,
    random_model,
)
from tests.helpers import phalanx, train_json

# A small DeepSeek-V3: 1 dense layer then 2 of 8 experts in 4 groups (a token's 2 from its best 2 groups),
# one shared expert, q through a rank-32 bottleneck, a 32-dim latent, heads of 32 + 16 q/k dims and 32
# value dims. norm_eps 1e-6, which llama.cpp normalises the latents with (see the last test).
DEEPSEEK = dict(
    family="deepseek_v3",
    attention="mla",
    n_layers=3,
    n_kv_heads=BASE["n_heads"],
    norm_eps=1e-6,
    rope_theta=10000.0,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_interleave=True,
    n_experts=8,
    n_experts_per_token=2,
    expert_ffn_dim=64,
    n_dense_layers=1,
    router_scoring="sigmoid",
    n_expert_groups=4,
    n_expert_groups_per_token=2,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
)
# YaRN that bites within the prompt (16 original positions, stretched 4 times).
YARN = dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=16)
CASES = {
    "deepseek_v3": {},
    "pairs_in_halves_plain_q": dict(rope_interleave=False, q_lora_rank=0),
    "unnormalised_two_shared_tied": dict(
        norm_topk_prob=False,
        n_shared_experts=2,
        n_dense_layers=0,
        tie_embeddings=True,
        n_expert_groups=1,
        n_expert_groups_per_token=1,
    ),
    # DeepSeek-V3's own form: mscale equal to mscale_all_dim.
    "yarn": dict(**YARN, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),
    "yarn_mscales": dict(**YARN, yarn_mscale=0.707, yarn_mscale_all_dim=0.5),
    "yarn_without_mscale_all_dim": dict(**YARN, yarn_mscale=0.707, rope_interleave=False),
}


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer([corpus.read_text()], BASE["vocab_size"])


def deepseek_model(seed: int = 0, **overrides) -> Transformer:
    """random_model's weights, with routing biases (a buffer, not a parameter) random too, so that
    llama.cpp leaving them out would change its choices."""
    model = random_model(seed, **{**DEEPSEEK, **overrides})
    with torch.no_grad():
        for layer in model.layers.values():
            if getattr(layer.feed_forward, "expert_bias", None) is not None:
                layer.feed_forward.expert_bias.normal_(0.0, 0.05)
    return model


def variant(model: Transformer, **changes) -> Transformer:
    """The same weights under changed ModelArgs."""
    other = Transformer(dataclasses.replace(model.args, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


@pytest.fixture(scope="module")
def exports(tokenizer, tmp_path_factory) -> dict[str, tuple[Transformer, Path]]:
    root = tmp_path_factory.mktemp("gguf-deepseek")
    out = {}
    for seed, (name, overrides) in enumerate(CASES.items()):
        model = deepseek_model(seed, **overrides)
        write_gguf(LoadedModel(model, tokenizer, root), root / f"{name}.gguf", name)
        out[name] = model, root / f"{name}.gguf"
    return out


@pytest.mark.slow  # needs llama-cpp-python
@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_computes_phalanxs_logits_and_greedy_tokens(exports, tokenizer, name):
    model, path = exports[name]
    ids = prompt_ids(tokenizer)
    diff = float(np.abs(phalanx_logits(model, ids) - llama_cpp_logits(path, ids)).max())
    ours, margin = phalanx_greedy(model, ids, NEW_TOKENS)
    theirs = llama_cpp_greedy(path, ids, NEW_TOKENS)
    print(f"{name}: max abs logit diff {diff:.3g}, smallest greedy margin {margin:.3g}, tokens {ours}")
    assert diff < TOLERANCE
    assert margin > 100 * TOLERANCE  # else equal tokens would prove little
    assert len(set(ours)) > 1  # a model that repeats one token would not tell positions apart
    assert theirs == ours


@pytest.mark.slow  # needs llama-cpp-python
def test_what_llama_cpp_computes_depends_on_each_routing_and_rope_setting(exports, tokenizer):
    """The file's settings are not matched by luck: phalanx with any one changed (same weights) is far
    from llama.cpp's logits, so llama.cpp applied each as phalanx does."""
    model, path = exports["deepseek_v3"]
    ids = prompt_ids(tokenizer)
    theirs = llama_cpp_logits(path, ids)
    no_bias = variant(model)
    with torch.no_grad():
        for layer in no_bias.layers.values():
            if getattr(layer.feed_forward, "expert_bias", None) is not None:
                layer.feed_forward.expert_bias.zero_()
    others = {
        "no routing bias": no_bias,
        "all groups": variant(model, n_expert_groups_per_token=model.args.n_expert_groups),
        "unnormalised weights": variant(model, norm_topk_prob=False),
        "routed_scaling_factor 1": variant(model, routed_scaling_factor=1.0),
        "rotary pairs in halves": variant(model, rope_interleave=False),
    }
    for what, other in others.items():
        off = float(np.abs(phalanx_logits(other, ids) - theirs).max())
        print(f"{what}: {off:.3g} from llama.cpp")
        assert off > 0.1, what


@pytest.mark.slow  # needs llama-cpp-python
def test_an_f16_export_stays_close(exports, tokenizer, tmp_path):
    """f16 weights, the latent's k_b and v_b included (3-d tensors): llama.cpp stays within f16's rounding
    (measured 8.9e-3, logits of std ~0.8) with the same greedy tokens. (Block-quantised types round the
    activations too: q8_0 was measured 0.11 apart at the median position, and far more where the rounding
    moves an expert choice, so no bound is set for them here.)"""
    model, _ = exports["deepseek_v3"]
    path = tmp_path / "f16.gguf"
    write_gguf(LoadedModel(model, tokenizer, tmp_path), path, "f16", "f16")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.2.attn_k_b.weight"] == types["blk.2.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.2.exp_probs_b.bias"] == gguf.GGMLQuantizationType.F32
    ids = prompt_ids(tokenizer)
    diff = float(np.abs(phalanx_logits(model, ids) - llama_cpp_logits(path, ids)).max())
    print(f"f16: max abs logit diff {diff:.3g}")
    assert diff < 3e-2
    assert llama_cpp_greedy(path, ids, NEW_TOKENS) == phalanx_greedy(model, ids, NEW_TOKENS)[0]


def _fields_and_tensors(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {t.name: torch.tensor(np.asarray(t.data, dtype=np.float32)) for t in reader.tensors}
    return fields, tensors


@pytest.mark.parametrize("name", list(CASES))
def test_the_file_holds_deepseek2s_tensors_and_keys(exports, name):
    model, path = exports[name]
    args = model.args
    fields, tensors = _fields_and_tensors(path)
    arch = "deepseek2"
    assert fields["general.architecture"] == arch and fields["phalanx.family"] == "deepseek_v3"
    # MLA as llama.cpp caches it: one KV head of the latent and the shared rotated key part.
    expected = {
        "attention.head_count": args.n_heads,
        "attention.head_count_kv": 1,
        "attention.key_length": args.kv_lora_rank + args.qk_rope_head_dim,
        "attention.value_length": args.kv_lora_rank,
        "attention.key_length_mla": args.qk_nope_head_dim + args.qk_rope_head_dim,
        "attention.value_length_mla": args.v_head_dim,
        "attention.q_lora_rank": args.q_lora_rank,
        "attention.kv_lora_rank": args.kv_lora_rank,
        "rope.dimension_count": args.qk_rope_head_dim,
        "feed_forward_length": args.ffn_dim,
        "leading_dense_block_count": args.n_dense_layers,
        "expert_count": args.n_experts,
        "expert_used_count": args.n_experts_per_token,
        "expert_feed_forward_length": args.moe_ffn_dim,
        "expert_shared_count": args.n_shared_experts,
        "expert_weights_norm": args.norm_topk_prob,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "expert_group_count": args.n_expert_groups,
        "expert_group_used_count": args.n_expert_groups_per_token,
    }
    assert {key: fields[f"{arch}.{key}"] for key in expected} == expected
    assert fields[f"{arch}.expert_weights_scale"] == pytest.approx(args.routed_scaling_factor)
    yarn = args.rope_scaling_factor != 1
    assert (fields.get(f"{arch}.rope.scaling.type") == "yarn") == yarn
    if yarn:
        assert fields[f"{arch}.rope.scaling.factor"] == args.rope_scaling_factor
        assert fields[f"{arch}.rope.scaling.original_context_length"] == args.rope_original_max_seq_len
        assert fields[f"{arch}.rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * args.yarn_mscale_all_dim)

    # Every tensor is one the gguf package lists for deepseek2; kv_b only as its two halves.
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i)
        for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2]
        for i in range(args.n_layers)
    }
    assert {n.rsplit(".", 1)[0] for n in tensors} <= allowed
    assert ("output.weight" in tensors) != args.tie_embeddings
    assert not any("attn_kv_b" in n for n in tensors)
    for i in range(args.n_layers):
        dense = i < args.n_dense_layers
        assert (f"blk.{i}.ffn_gate.weight" in tensors) == dense
        assert (f"blk.{i}.ffn_gate_exps.weight" in tensors) != dense
        assert (f"blk.{i}.exp_probs_b.bias" in tensors) != dense
        assert (f"blk.{i}.attn_q.weight" in tensors) == (not args.q_lora_rank)
        assert (f"blk.{i}.attn_q_a.weight" in tensors) == bool(args.q_lora_rank)

    # kv_b's halves put back together give phalanx's wkv_b.
    layer = args.n_layers - 1
    attention = model.layers[str(layer)].attention
    heads, nope, rope = args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim
    k_b = tensors[f"blk.{layer}.attn_k_b.weight"].reshape(heads, args.kv_lora_rank, nope)
    v_b = tensors[f"blk.{layer}.attn_v_b.weight"].reshape(heads, args.v_head_dim, args.kv_lora_rank)
    rebuilt = torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, args.kv_lora_rank)
    assert torch.equal(rebuilt, attention.wkv_b.weight.detach())
    assert torch.equal(tensors[f"blk.{layer}.exp_probs_b.bias"], model.layers[str(layer)].feed_forward.expert_bias)

    # Rotated rows: in pairs as they are where the model has them so, moved into pairs from halves
    # otherwise; q's also scaled under YaRN (gguf_deepseek._q_rows).
    kv_a = attention.wkv_a.weight.detach()
    stored_kv_a = tensors[f"blk.{layer}.attn_kv_a_mqa.weight"].reshape(kv_a.shape)
    assert torch.equal(stored_kv_a[: args.kv_lora_rank], kv_a[: args.kv_lora_rank])
    pe = kv_a[args.kv_lora_rank :]
    assert torch.equal(stored_kv_a[args.kv_lora_rank :], pe if args.rope_interleave else interleave_rotary_rows(pe, 1))
    q = (attention.wq_b if args.q_lora_rank else attention.wq).weight.detach()
    stored_q = tensors[f"blk.{layer}.attn_q{'_b' if args.q_lora_rank else ''}.weight"].reshape(q.shape)
    q_HED, stored_HED = q.view(heads, nope + rope, -1), stored_q.view(heads, nope + rope, -1)
    t = yarn_attention_factor(args) if yarn else 1.0
    nope_scale, rope_scale = (1 / t**2, 1.0) if yarn and not args.yarn_mscale_all_dim else (1.0, t**2)
    pe = q_HED[:, nope:].reshape(heads * rope, -1)
    pe = (pe if args.rope_interleave else interleave_rotary_rows(pe, heads)).view(heads, rope, -1)
    torch.testing.assert_close(stored_HED[:, :nope], q_HED[:, :nope] * nope_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(stored_HED[:, nope:], pe * rope_scale * nope_scale, rtol=1e-6, atol=0)
    if not args.rope_interleave:  # so the checks above tell the layouts apart
        assert not torch.equal(
            interleave_rotary_rows(pe.reshape(heads * rope, -1), heads), pe.reshape(heads * rope, -1)
        )


@pytest.mark.parametrize("name", list(CASES))
def test_read_deepseek2_gives_back_the_model(exports, tokenizer, name):
    """The reader phalanx's model loader can read these files with: the very ModelArgs, the weights (the
    YaRN cases' q rows to float32 rounding, scaled and scaled back), the same logits."""
    model, path = exports[name]
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    back = read_deepseek2(path, fields, {t.name: t for t in reader.tensors})
    assert back.args == model.args
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(theirs[key], ours[key], rtol=1e-6, atol=0, msg=key)
        if model.args.rope_scaling_factor == 1 or "attention.wq" not in key:
            assert torch.equal(theirs[key], ours[key]), key
    assert (back.output.weight is back.tok_embeddings.weight) == model.args.tie_embeddings
    ids = prompt_ids(tokenizer)
    np.testing.assert_allclose(phalanx_logits(back, ids), phalanx_logits(model, ids), rtol=0, atol=1e-5)


def test_the_tiny_preset_is_exportable():
    from phalanx.export.gguf_export import check_llama_cpp_computes

    check_llama_cpp_computes(MODEL_PRESETS["deepseek-v3-tiny"])
    check_llama_cpp_computes(MODEL_PRESETS["deepseek-v3-671b"])


REFUSED = {
    "Llama 3.1 RoPE scaling": dict(rope_scaling_factor=8.0, rope_original_max_seq_len=16),
    "with grouped-query attention is not built": dict(
        attention="gqa",
        rope_interleave=False,
        q_lora_rank=0,
        kv_lora_rank=0,
        qk_nope_head_dim=0,
        qk_rope_head_dim=0,
        v_head_dim=0,
    ),
    "with softmax routing is not built": dict(router_scoring="softmax"),
}


@pytest.mark.parametrize("reason", list(REFUSED))
def test_what_llama_cpp_cannot_run_is_refused_in_one_line(tokenizer, tmp_path, reason):
    model = deepseek_model(**REFUSED[reason])
    with pytest.raises(PhalanxError, match=reason) as refused:
        write_gguf(LoadedModel(model, tokenizer, tmp_path), tmp_path / "model.gguf", "x")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.slow  # needs llama-cpp-python
def test_a_norm_eps_other_than_the_latents_is_exported_a_little_apart(tokenizer, tmp_path):
    """llama.cpp normalises the q and kv latents with norm_eps, phalanx with 1e-6 whatever norm_eps says:
    with norm_eps 1e-5 the two compute slightly different models (measured 5.4e-5 apart), exported all
    the same (gguf_deepseek.py) since that is far below what f16 weights change. The lower bound shows
    the difference is the one described; should it grow, the upper bound fails."""
    model = deepseek_model(norm_eps=1e-5)
    path = tmp_path / "eps.gguf"
    write_gguf(LoadedModel(model, tokenizer, tmp_path), path, "eps")
    ids = prompt_ids(tokenizer)
    off = float(np.abs(phalanx_logits(model, ids) - llama_cpp_logits(path, ids)).max())
    print(f"norm_eps 1e-5: llama.cpp {off:.3g} from phalanx")
    assert 2 * TOLERANCE < off < 1e-3
    assert llama_cpp_greedy(path, ids, NEW_TOKENS) == phalanx_greedy(model, ids, NEW_TOKENS)[0]


@pytest.mark.slow  # trains a run; needs llama-cpp-python
def test_the_cli_exports_a_trained_deepseek_v3_tiny_run(tiny_args, tmp_path):
    """`phalanx export --format gguf` on a run of the deepseek-v3-tiny preset (tied embeddings, routing
    biases the trainer moved): the file is deepseek2, llama.cpp computes the run's logits and greedy tokens,
    and read_deepseek2 gives back the run's model."""
    summary = train_json(
        *[a for a in tiny_args if not a.startswith("model.")],
        "model.preset=deepseek-v3-tiny",
        "model.max_seq_len=64",
        "train.max_steps=4",
    )
    run = load_model(Path(summary["run_dir"]))
    phalanx("export", summary["run_dir"], "--format", "gguf", "--out", str(tmp_path / "gguf"), "--json")
    path = tmp_path / "gguf" / "model.gguf"
    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    assert fields["general.architecture"] == "deepseek2"
    assert np.abs(np.asarray(tensors["blk.1.exp_probs_b.bias"].data)).max() > 0  # the trainer moved them
    ids = prompt_ids(run.tokenizer)
    # A few steps of training mostly repeat one token, so the logits at every prompt position are compared too.
    assert np.abs(llama_cpp_logits(path, ids) - phalanx_logits(run.model, ids)).max() < TOLERANCE
    assert llama_cpp_greedy(path, ids, NEW_TOKENS) == phalanx_greedy(run.model, ids, NEW_TOKENS)[0]
    back = read_deepseek2(path, fields, tensors)
    assert back.args == run.model.args
    assert all(torch.equal(back.state_dict()[k], v) for k, v in run.model.state_dict().items())
    # phalanx's own loader (generate, serve, chat) reads it too: the run's greedy text from the file.
    from_run = phalanx("generate", summary["run_dir"], "ROMEO:", "--max-new-tokens", "8", "--seed", "0").stdout
    assert phalanx("generate", str(path), "ROMEO:", "--max-new-tokens", "8", "--seed", "0").stdout == from_run
