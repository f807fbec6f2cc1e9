import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import Transformer
from phalanx.models.flops import count_params
from phalanx.models.presets import MODEL_PRESETS, get_preset

# Published sizes: Meta's for the Llama 3 family, Mistral's for 7B v0.3, Qwen's for Qwen3-8B.
KNOWN_PARAMS = {
    "1b": 1_235_814_400,
    "8b": 8_030_261_248,
    "70b": 70_553_706_496,
    "405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "mistral-7b": 7_248_023_552,
    "qwen3-8b": 8_190_735_360,
}
# The Qwen3 model cards' (total, non-embedding) billions, to their rounding.
QWEN3_CARDS = {
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2),
    "qwen3-32b": (32.8, 31.2),
}


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_preset_param_count_on_meta_matches_analytic_count(name):
    args = get_preset(name)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.num_params() == count_params(args)
    if name in KNOWN_PARAMS:
        assert count_params(args) == KNOWN_PARAMS[name]


def test_preset_shapes():
    tiny, small = get_preset("tiny"), get_preset("125m")
    assert (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.ffn_dim) == (256, 4, 8, 4, 768)
    assert (tiny.vocab_size, tiny.max_seq_len, tiny.rope_theta, tiny.tie_embeddings) == (4096, 256, 10000.0, True)
    assert (small.dim, small.n_layers, small.vocab_size, small.max_seq_len) == (768, 12, 50304, 2048)
    assert get_preset("8b").tie_embeddings is False and get_preset("1b").tie_embeddings is True
    eps_1e6 = ("qwen3", "qwen3_moe", "deepseek_v3")
    assert all(args.norm_eps == (1e-6 if args.family in eps_1e6 else 1e-5) for args in MODEL_PRESETS.values())
    assert get_preset("70b").rope_theta == 500000.0


def test_versioned_presets_are_the_published_configs():
    for name in ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b"):
        args = get_preset(name)
        assert (args.family, args.max_seq_len, args.vocab_size, args.rope_theta) == ("llama", 131072, 128256, 5e5)
        assert args.rope_scaling_factor == (32.0 if "3.2" in name else 8.0)
        assert (args.rope_low_freq_factor, args.rope_high_freq_factor, args.rope_original_max_seq_len) == (1, 4, 8192)
        assert args.tie_embeddings == ("3.2" in name) and args.head_size == (64 if name == "llama3.2-1b" else 128)
    mistral = get_preset("mistral-7b")
    assert (mistral.family, mistral.sliding_window, mistral.vocab_size, mistral.rope_theta) == (
        "mistral",
        None,
        32768,
        1e6,
    )
    for name, (total, non_embedding) in QWEN3_CARDS.items():
        args = get_preset(name)
        assert (args.family, args.head_size, args.qk_norm, args.qkv_bias) == ("qwen3", 128, True, False)
        assert (args.vocab_size, args.rope_theta, args.max_seq_len, args.n_kv_heads) == (151936, 1e6, 40960, 8)
        assert args.tie_embeddings == (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))
        n = count_params(args)
        assert round(n / 1e9, 1) == round(total, 1)
        embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
        assert round((n - embeddings) / 1e9, len(str(non_embedding).split(".")[1])) == non_embedding


@pytest.mark.parametrize("name, suggestion", [("tinny", "tiny"), ("8B", "8b"), ("70", "70b")])
def test_unknown_preset_names_the_valid_ones_and_the_closest(name, suggestion):
    with pytest.raises(PhalanxError) as err:
        get_preset(name)
    message = str(err.value)
    assert f"did you mean '{suggestion}'" in message
    assert all(valid in message for valid in MODEL_PRESETS)
