"""DeepSeek-V3 (family deepseek_v3: models/mla.py, the sigmoid routing of models/moe.py) against transformers'
own DeepseekV3ForCausalLM: small random checkpoints made by transformers here (float32; q through a
low-rank bottleneck and without one, expert groups, shared experts, a first dense layer, YaRN) load into
phalanx with logits within 1e-5 and the same greedy tokens, decoded through phalanx's KV cache; phalanx's
export loads into transformers with its logits; the router chooses transformers' experts with their
weights; DeepSeek's balancing-bias update; the 671B preset's shape, RoPE tables and counts; refusals in
one line; and the tiny preset trains, is served, and exports through the real CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.families import args_from_hf_config, hf_config
from phalanx.models.flops import count_params, flops_per_token
from phalanx.models.moe import MoE, moe_layers
from phalanx.models.presets import MODEL_PRESETS
from phalanx.models.rope import model_rope_tables, yarn_softmax_factor
from phalanx.models.token_pass import Cached, DecodeRows
from phalanx.run.hf_format import read_hf_model
from tests.helpers import phalanx, train_json

transformers = pytest.importorskip("transformers")

# transformers' config keys for a small DeepSeek-V3: q_lora_rank set, 4 groups of 2 experts (a token's 3
# from its best 2 groups), one shared expert, a dense first layer, (even, odd) rotary pairs.
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}
CHECKPOINTS = {
    "q_lora": {},
    "plain_q": {"q_lora_rank": None},
    "one_group_pairs_in_halves": {"n_group": 1, "topk_group": 1, "rope_interleave": False},
    "yarn": {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
    "yarn_mscales": {"rope_parameters": {**YARN, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 0.5}},
    "two_shared_unnormalised": {"n_shared_experts": 2, "norm_topk_prob": False, "first_k_dense_replace": 0},
}


def transformers_checkpoint(out, seed: int = 0, **changes):
    """A random DeepseekV3ForCausalLM saved with save_pretrained into `out`; returns the model. Its norms and
    routing biases get random values, so that one loaded into the wrong place shows."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**BASE, **changes})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.normal_(1.0, 0.2)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy_through_the_cache(model: Transformer, prompt_BT: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens (B, steps) as the serving engine decodes: a prefill into a KV cache, then one token
    per row per step (DecodeRows)."""
    B, T = prompt_BT.shape
    cache = KVCache(model.args, B, T + steps)
    next_B = model(prompt_BT, Cached(cache, 0, last_only=True))[:, -1].argmax(-1)
    out = [next_B]
    for position in range(T, T + steps - 1):
        next_B = model(next_B[:, None], DecodeRows(cache, torch.full((B,), position)))[:, -1].argmax(-1)
        out.append(next_B)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_transformers_checkpoint_loads_with_its_logits_and_greedy_tokens(name, tmp_path):
    theirs = transformers_checkpoint(tmp_path, **CHECKPOINTS[name])
    ours = read_hf_model(tmp_path).eval()
    assert ours.args.family == "deepseek_v3" and ours.args.attention == "mla"
    assert ours.num_params() == count_params(ours.args) == sum(p.numel() for p in theirs.parameters())
    x = tokens(2, 40)
    with torch.no_grad():
        expected, got = theirs(x).logits, ours(x)
    print(f"{name}: max |logit difference| {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    prompt = tokens(2, 9, seed=2)
    theirs.generation_config.eos_token_id = None  # 12 tokens whatever they are: no stop at token 1
    generated = theirs.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 9:]
    assert torch.equal(greedy_through_the_cache(ours, prompt, 12), generated)


def test_the_checkpoints_tell_their_settings_apart(tmp_path):
    """The settings the checks above vary change the logits by far more than their 1e-5: a reader that
    dropped one would fail them."""
    x = tokens(1, 40)
    transformers_checkpoint(tmp_path / "base")
    ours = read_hf_model(tmp_path / "base").eval()
    args = ours.args
    assert (args.q_lora_rank, args.n_expert_groups, args.n_expert_groups_per_token, args.n_dense_layers) == (
        24,
        4,
        2,
        1,
    )
    assert (args.router_scoring, args.routed_scaling_factor, args.n_shared_experts, args.rope_interleave) == (
        "sigmoid",
        2.5,
        1,
        True,
    )
    with torch.no_grad():
        base = ours(x)
        for changed in (
            dict(rope_interleave=False),
            dict(n_expert_groups=1, n_expert_groups_per_token=1),
            dict(rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=16),
        ):
            other = Transformer(dataclasses.replace(args, **changed)).eval()
            other.load_state_dict(ours.state_dict())
            assert (other(x) - base).abs().max() > 1e-4, changed  # ten times the checks' tolerance
        for layer in moe_layers(ours):  # the bias only chooses experts: the logits move with it
            layer.expert_bias.add_(0.3 * torch.randn(layer.n_experts))
        assert (ours(x) - base).abs().max() > 1e-4


def test_phalanx_export_loads_into_transformers_with_our_logits(tmp_path):
    from safetensors.torch import save_file

    from phalanx.export.hf import hf_state_dict

    yarn = dict(
        rope_scaling_type="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=16, yarn_mscale_all_dim=0.5
    )
    args = dataclasses.replace(
        MODEL_PRESETS["deepseek-v3-tiny"], vocab_size=128, max_seq_len=64, yarn_mscale=1.0, **yarn
    )
    torch.manual_seed(3)
    ours = Transformer(args).eval()
    with torch.no_grad():
        for layer in moe_layers(ours):
            layer.expert_bias.normal_(0.0, 0.05)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args, 0, 1, torch.float32)))
    save_file(hf_state_dict(ours), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    x = torch.randint(0, 128, (1, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=0, atol=1e-5)
    back = read_hf_model(tmp_path)  # and phalanx reads its own export back: the same model
    assert back.args == args
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_multi_token_prediction_layers_are_left_unread_and_other_strays_refused(tmp_path):
    """DeepSeek-V3's checkpoint stores its MTP module as layer num_hidden_layers (`model.layers.61.*`)."""
    from safetensors.torch import load_file, save_file

    theirs = transformers_checkpoint(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    extra = {name.replace("layers.2.", "layers.3."): t.clone() for name, t in state.items() if ".layers.2." in name}
    extra["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**state, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = read_hf_model(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens(1, 20)), theirs(tokens(1, 20)).logits, rtol=0, atol=1e-5)
    save_file({**state, "model.stray.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PhalanxError, match="holds tensor model.stray.weight, which its config.json does not explain"):
        read_hf_model(tmp_path)


def test_the_router_chooses_transformers_experts_with_their_weights():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(**{**BASE, "n_routed_experts": 16, "n_group": 4, "topk_group": 2})
    theirs = DeepseekV3TopkRouter(config)
    ours = MoE(64, 32, 16, 3, True, scoring="sigmoid", n_groups=4, n_groups_per_token=2, routed_scaling_factor=2.5)
    torch.manual_seed(5)
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.3)
        theirs.e_score_correction_bias.normal_(0.0, 0.2)
        ours.router.weight.copy_(theirs.weight)
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(200, 64)
    _, their_weights, their_experts = theirs(x)
    weights, experts, counts = ours.route(x)
    # The same set of experts per token (each side lists a token's k in its own order), the same weights.
    mine, theirs_sorted = experts.sort(dim=-1), their_experts.sort(dim=-1)
    assert torch.equal(mine.values, theirs_sorted.values)
    torch.testing.assert_close(weights.gather(1, mine.indices), their_weights.gather(1, theirs_sorted.indices))
    assert int(counts.sum()) == 200 * 3
    # Group limiting: each token's experts lie in at most 2 of the 4 groups of 4.
    assert all(len(set((row // 4).tolist())) <= 2 for row in experts)


def test_the_balancing_bias_moves_towards_even_load():
    args = dataclasses.replace(MODEL_PRESETS["deepseek-v3-tiny"], n_layers=3, n_dense_layers=1)
    model = Transformer(args)
    layers = moe_layers(model)
    assert len(layers) == 2 and all(torch.equal(m.expert_bias, torch.zeros(8)) for m in layers)
    counts = torch.tensor([[10, 0, 4, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 3]])  # means 3 and 3
    for layer, counts_E in zip(layers, counts):
        layer.update_bias(counts_E, rate=0.001)
    expected = 0.001 * torch.tensor([-1.0, 1, -1, 1, 1, 1, 1, 1])
    assert torch.equal(layers[0].expert_bias, expected)  # busy experts down, idle ones up
    assert torch.equal(layers[1].expert_bias, torch.zeros(8))  # balanced: unchanged
    layers[0].update_bias(counts[0], rate=0.001)
    assert torch.equal(layers[0].expert_bias, 2 * expected)
    # The bias is no parameter: no optimizer ever sees it; but checkpoints keep it.
    assert not any("expert_bias" in name for name, _ in model.named_parameters())
    assert "layers.1.feed_forward.expert_bias" in model.state_dict()
    softmax = moe_layers(Transformer(MODEL_PRESETS["tiny-moe"]))[0]  # a softmax router has no bias: left alone
    softmax.update_bias(torch.ones(8), rate=0.001)
    assert softmax.expert_bias is None


def test_the_671b_preset_is_the_published_model():
    args = MODEL_PRESETS["deepseek-v3-671b"]
    assert count_params(args) == 671_026_404_352  # DeepSeek: 671B in total (685B with the MTP module)
    assert count_params(args, active=True) == 37_552_282_624  # and 37B activated per token
    with torch.device("meta"):
        assert Transformer(args).num_params() == count_params(args)
    ours = hf_config(args, 0, 1, torch.bfloat16)
    published = transformers.DeepseekV3Config().to_dict()  # transformers' defaults are this model's shape
    shape_keys = (
        "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers num_attention_heads "
        "num_key_value_heads n_shared_experts n_routed_experts routed_scaling_factor kv_lora_rank q_lora_rank "
        "qk_rope_head_dim v_head_dim qk_nope_head_dim n_group topk_group num_experts_per_tok "
        "first_k_dense_replace norm_topk_prob rms_norm_eps rope_interleave tie_word_embeddings"
    )
    for key in shape_keys.split():
        assert ours[key] == published[key], key
    # and its config.json's context: YaRN from 4K to 160K tokens, RoPE theta 10,000.
    assert ours["max_position_embeddings"] == 163840 and ours["rope_theta"] == 10000
    assert ours["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


# deepseek-ai/DeepSeek-V3's config.json (its auto_map left out).
PUBLISHED_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_the_published_config_reads_as_the_preset_once_its_weights_are_not_fp8():
    with pytest.raises(PhalanxError, match="cannot run: quantization_config"):
        args_from_hf_config(PUBLISHED_CONFIG, "/models/DeepSeek-V3")
    bf16 = {k: v for k, v in PUBLISHED_CONFIG.items() if k != "quantization_config"}  # a bf16 conversion's
    assert args_from_hf_config(bf16, "/models/DeepSeek-V3-bf16") == MODEL_PRESETS["deepseek-v3-671b"]


def test_yarn_tables_and_softmax_scale_are_transformers_for_the_671b_config():
    from transformers.modeling_rope_utils import yarn_apply_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    args = dataclasses.replace(MODEL_PRESETS["deepseek-v3-671b"], max_seq_len=8192)
    config = transformers.DeepseekV3Config(**json.loads(json.dumps(hf_config(args, 0, 1, torch.bfloat16))))
    positions = torch.tensor([[0, 1, 4095, 4096, 8191]])
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    our_cos, our_sin = model_rope_tables(args)
    assert torch.equal(our_cos[positions[0]], cos[0]) and torch.equal(our_sin[positions[0]], sin[0])
    scale = yarn_apply_mscale(config.rope_parameters, config.qk_head_dim**-0.5)
    assert yarn_softmax_factor(args) / math.sqrt(192) == pytest.approx(scale, rel=1e-12)
    assert yarn_softmax_factor(args) == pytest.approx((0.1 * math.log(40) + 1) ** 2)


def test_mla_and_shared_experts_are_counted_by_hand():
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=96,
        vocab_size=100,
        max_seq_len=64,
        family="deepseek_v3",
        attention="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_experts=8,
        n_experts_per_token=2,
        expert_ffn_dim=32,
        n_dense_layers=1,
        router_scoring="sigmoid",
        n_shared_experts=1,
    )
    # q: 64*24 + 24 (norm) + 24*4*24; kv: 64*(16+8) + 16 (norm) + 16*4*(16+12); o: 4*12*64.
    attention = 64 * 24 + 24 + 24 * 96 + 64 * 24 + 16 + 16 * 112 + 48 * 64
    dense, router, expert = 3 * 64 * 96, 8 * 64, 3 * 64 * 32
    blocks = 2 * (attention + 2 * 64) + dense + router + 9 * expert  # 8 routed + 1 shared
    assert count_params(args) == 100 * 64 + blocks + 64 + 100 * 64
    active = count_params(args) - 6 * expert  # 2 routed + 1 shared of the 9
    assert count_params(args, active=True) == active
    # Attention's products: QK^T over 24 dims a head and AV over 12.
    assert flops_per_token(args, 32) == 6 * (active - 100 * 64) + 6 * 2 * 4 * (24 + 12) * 32
    assert Transformer(args).num_params() == count_params(args)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"scoring_func": "softmax"}, "features phalanx cannot run: scoring_func=softmax"),
        ({"topk_method": "group_limited_greedy"}, "features phalanx cannot run: topk_method=group_limited_greedy"),
        ({"attention_bias": True}, "features phalanx cannot run: attention_bias=true"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 (MLA makes keys and values for every head)"),
        ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "a yarn attention_factor of its own"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "phalanx cannot run: rope_type=longrope"),
        ({"n_group": 3}, "n_experts 8 must split into n_expert_groups 3 of at least 2"),
        ({"kv_lora_rank": None}, "lacks 'kv_lora_rank'"),
    ],
)
def test_settings_phalanx_does_not_run_are_refused_in_one_line(changes, expected):
    config = json.loads(json.dumps(transformers.DeepseekV3Config(**BASE).to_dict())) | changes
    with pytest.raises(PhalanxError) as err:
        args_from_hf_config(config, "/models/ds")
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_what_other_families_and_gguf_cannot_write_is_refused_in_one_line():
    from phalanx.export.gguf_export import check_llama_cpp_computes

    tiny = MODEL_PRESETS["deepseek-v3-tiny"]
    with pytest.raises(PhalanxError, match="cannot be written as MixtralForCausalLM with .*DeepSeek-V3's routing"):
        hf_config(dataclasses.replace(tiny, family="mixtral"), 0, 1, torch.float32)
    check_llama_cpp_computes(tiny)  # exported as deepseek2 (tests/export/test_export_gguf_deepseek.py)
    with pytest.raises(PhalanxError, match="GGUF export of family deepseek_v3 with softmax routing is not built"):
        check_llama_cpp_computes(dataclasses.replace(tiny, router_scoring="softmax"))
    for changes, expected in (
        (dict(attention="gqa"), "rope_interleave need attention mla"),
        (dict(n_kv_heads=4), "n_kv_heads must equal n_heads"),
        (
            dict(
                attention="gqa",
                rope_interleave=False,
                q_lora_rank=0,
                kv_lora_rank=0,
                qk_nope_head_dim=0,
                qk_rope_head_dim=0,
                v_head_dim=0,
                rope_scaling_type="yarn",
            ),
            "yarn is built for attention mla",
        ),
        (dict(n_expert_groups_per_token=3), r"n_expert_groups_per_token must be between 1 and n_expert_groups \(2\)"),
    ):
        with pytest.raises(PhalanxError, match=expected):
            dataclasses.replace(tiny, **changes)


def test_the_tiny_preset_trains_serves_and_exports(tiny_args, tmp_path):
    from phalanx.run.model_loader import load_model

    run = [a for a in tiny_args if not a.startswith("model.")] + [
        "model.preset=deepseek-v3-tiny",
        "model.max_seq_len=64",
    ]
    summary = train_json(*run)
    assert summary["val_loss_final"] < summary["val_loss_start"] - 0.3
    # The serving engine decodes it: a prefill, then batched decode steps through MLA's cache.
    text = phalanx("generate", summary["run_dir"], "ROMEO:", "--max-new-tokens", "12", "--seed", "0").stdout
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    phalanx("export", summary["run_dir"], "--format", "hf", "--out", str(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ours = load_model(summary["run_dir"]).model.eval()
    x = torch.randint(0, ours.args.vocab_size, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, rtol=0, atol=1e-5)
    # Auxiliary-loss-free balancing (train.moe_bias_rate 0.001) moved each bias by 0.001 or 0 a step (0 at
    # the mean load), the checkpoint kept it, and transformers computes with it.
    steps = summary["steps"]
    for layer in moe_layers(ours):
        bias = layer.expert_bias
        assert bias.abs().max() > 0 and bias.abs().max() <= 0.001 * steps + 1e-6
        assert all(abs(float(b) / 0.001 - round(float(b) / 0.001)) < 1e-3 for b in bias)
