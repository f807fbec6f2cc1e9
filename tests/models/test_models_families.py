"""The families' config and tensor-name mapping (models/families/): every preset survives the trip through
its HF config; transformers builds from phalanx's config a model with exactly phalanx's tensors under the
mapped names; configs phalanx's model cannot run, and models a family cannot express, are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.families import SUPPORTED_ARCHITECTURES, args_from_hf_config, hf_config, hf_names
from phalanx.models.presets import MODEL_PRESETS

WHERE = Path("/models/x")
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)
# One small model per family, each with what its family adds (and Llama 3.1 scaling on a Qwen: it is
# transformers' shared rope_type, so every family carries it).
FAMILY_ARGS = {
    "llama": ModelArgs(**SMALL, tie_embeddings=True, rope_scaling_factor=8.0, rope_original_max_seq_len=16),
    "mistral": ModelArgs(**SMALL, family="mistral", sliding_window=8),
    "qwen2": ModelArgs(**SMALL, family="qwen2", qkv_bias=True, tie_embeddings=True),
    "qwen3": ModelArgs(**SMALL, family="qwen3", qk_norm=True, head_dim=32, rope_scaling_factor=4.0),
}


def config_of(family: str, **changes) -> dict:
    """phalanx's config.json for the family's small model, as JSON gives it back, with `changes`."""
    config = json.loads(json.dumps(hf_config(FAMILY_ARGS[family], 0, 1, torch.bfloat16)))
    return config | changes


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_every_preset_round_trips_through_its_hf_config(name):
    args = MODEL_PRESETS[name]
    config = json.loads(json.dumps(hf_config(args, 0, 1, torch.bfloat16)))
    assert config["model_type"] == args.family and config["architectures"][0] in SUPPORTED_ARCHITECTURES
    assert args_from_hf_config(config, WHERE) == args


@pytest.mark.parametrize("family", list(FAMILY_ARGS))
def test_transformers_builds_phalanx_tensors_under_the_mapped_names(family):
    transformers = pytest.importorskip("transformers")
    args = FAMILY_ARGS[family]
    config = config_of(family)
    hf_cfg = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        ours = Transformer(args)
    assert type(theirs).__name__ == config["architectures"][0]
    their_shapes = {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    if args.tie_embeddings:  # transformers lists the tied head; an HF file leaves it out
        assert their_shapes.pop("lm_head.weight") == their_shapes["model.embed_tokens.weight"]
    our_state = ours.state_dict()
    names = hf_names(args)
    assert {names[n]: tuple(our_state[n].shape) for n in names} == their_shapes
    # Every parameter is in the file but a tied output projection.
    assert set(names) == set(our_state) - ({"output.weight"} if args.tie_embeddings else set())


@pytest.mark.parametrize("family", list(FAMILY_ARGS))
def test_transformers_reads_phalanx_config_as_phalanx_means_it(family):
    transformers = pytest.importorskip("transformers")
    args = FAMILY_ARGS[family]
    hf = transformers.AutoConfig.for_model(**config_of(family))
    assert (hf.hidden_size, hf.num_hidden_layers, hf.head_dim) == (args.dim, args.n_layers, args.head_size)
    assert hf.rope_parameters["rope_theta"] == args.rope_theta
    assert hf.rope_parameters["rope_type"] == ("llama3" if args.rope_scaling_factor > 1 else "default")
    assert hf.tie_word_embeddings == args.tie_embeddings
    assert getattr(hf, "sliding_window", None) == args.sliding_window
    # and transformers' own config, saved, reads back as the same model
    assert args_from_hf_config(json.loads(hf.to_json_string()), WHERE) == args


def test_transformers_defaults_read_as_published():
    """Configs as transformers writes them by default: Qwen3's head_dim of 128, Mistral's null window."""
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, vocab_size=128)
    shape |= dict(num_key_value_heads=2)
    qwen3 = json.loads(transformers.Qwen3Config(**shape).to_json_string())
    assert args_from_hf_config(qwen3, WHERE).head_size == 128
    mistral = json.loads(transformers.MistralConfig(**shape, sliding_window=None).to_json_string())
    assert args_from_hf_config(mistral, WHERE).sliding_window is None
    # transformers 4's spelling: rope_theta and rope_scaling ("type") at the top level
    old = {
        **{k: v for k, v in config_of("llama").items() if k != "rope_parameters"},
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    args = args_from_hf_config(old, WHERE)
    assert (args.rope_theta, args.rope_scaling_factor, args.rope_original_max_seq_len) == (5e5, 8.0, 16)


@pytest.mark.parametrize(
    "family, changes, expected",
    [
        ("llama", {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "is a 'gemma2' model"),
        ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
        ("llama", {"model_type": None, "architectures": None}, "without a model_type (no architectures)"),
        ("llama", {"attention_bias": True}, "features phalanx cannot run: attention_bias=true"),
        ("llama", {"mlp_bias": True}, "mlp_bias=true"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act=gelu"),
        ("qwen2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type=yarn"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "without all of factor"),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types ['sliding_attention']"),
        ("qwen3", {"attention_bias": True}, "attention_bias=true"),
        ("llama", {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ("llama", {"hidden_size": None}, "lacks 'hidden_size'"),
        ("qwen2", {"max_position_embeddings": None}, "lacks 'max_position_embeddings'"),
        ("mistral", {"sliding_window": "_absent"}, "lacks 'sliding_window'"),
        ("qwen3", {"head_dim": None}, "lacks 'head_dim'"),
        ("qwen2", {"num_key_value_heads": "_absent"}, "lacks 'num_key_value_heads'"),
        ("llama", {"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
        ("llama", {"num_key_value_heads": 3}, "n_heads 4 is not divisible by n_kv_heads 3"),
    ],
)
def test_refused_configs_get_one_line_naming_why(family, changes, expected):
    config = config_of(family, **changes)
    config = {k: v for k, v in config.items() if v != "_absent"}
    with pytest.raises(PhalanxError) as err:
        args_from_hf_config(config, WHERE)
    message = str(err.value)
    assert expected in message and message.startswith(f"{WHERE}/config.json") and "\n" not in message


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(PhalanxError) as err:
        args_from_hf_config(config_of("llama", model_type="phi3", architectures=["Phi3ForCausalLM"]), WHERE)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert SUPPORTED_ARCHITECTURES == (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "DeepseekV3ForCausalLM",
    )


@pytest.mark.parametrize(
    "family, changes, expected",
    [
        ("llama", {"qk_norm": True}, "q/k norms"),
        ("llama", {"sliding_window": 8}, "a sliding window"),
        ("mistral", {"qkv_bias": True}, "q/k/v biases"),
        ("qwen2", {"qkv_bias": False}, "no q/k/v biases"),
        ("qwen2", {"sliding_window": 8}, "one sliding window"),
        ("qwen3", {"qk_norm": False}, "no q/k norms"),
        ("qwen3", {"qkv_bias": True}, "q/k/v biases without one on o"),
    ],
)
def test_a_model_its_family_cannot_express_is_refused(family, changes, expected):
    args = dataclasses.replace(FAMILY_ARGS[family], **changes)
    for write in (lambda: hf_config(args, 0, 1, torch.float32), lambda: hf_names(args)):
        with pytest.raises(PhalanxError) as err:
            write()
        assert expected in str(err.value) and f"family {family!r}" in str(err.value)
