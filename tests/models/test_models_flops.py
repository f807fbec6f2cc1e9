import pytest

from phalanx.models.decoder import ModelArgs
from phalanx.models.flops import achieved_tflops, count_params, flops_per_token, mfu, peak_tflops

SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100, max_seq_len=64)


def test_flops_per_token_hand_computed():
    tied, untied = ModelArgs(**SMALL, tie_embeddings=True), ModelArgs(**SMALL)
    # Per block: wq + wo 2*64*64, wk + wv 2*64*32, SwiGLU 3*64*128, two norms 2*64 = 36992.
    # Tied: 100*64 embedding + 2 blocks + final norm 64 = 80448; untied adds the 6400 output.
    assert count_params(tied) == 6400 + 2 * 36992 + 64 == 80448
    assert count_params(untied) == 80448 + 6400
    # N leaves out the embedding lookup but keeps the output matmul, tied or not: 80448 either way.
    attention = 12 * 2 * 4 * 16 * 32
    assert flops_per_token(tied, 32) == flops_per_token(untied, 32) == 6 * 80448 + attention == 531840


def test_family_extras_are_counted_by_hand():
    """Qwen3's head_dim beyond dim / heads and its q/k norms, Qwen2's q/k/v biases, Mistral's window."""
    import torch

    from phalanx.models.decoder import Transformer

    qwen3 = ModelArgs(**SMALL, tie_embeddings=True, family="qwen3", head_dim=32, qk_norm=True)
    # Per block: wq + wo 2*64*(4*32), wk + wv 2*64*(2*32), q/k norms 2*32, SwiGLU 3*64*128, norms 2*64.
    block = 2 * 64 * 128 + 2 * 64 * 64 + 2 * 32 + 3 * 64 * 128 + 2 * 64
    assert block == 49344 and count_params(qwen3) == 6400 + 2 * block + 64
    assert flops_per_token(qwen3, 32) == 6 * count_params(qwen3) + 12 * 2 * 4 * 32 * 32

    qwen2 = ModelArgs(**SMALL, tie_embeddings=True, family="qwen2", qkv_bias=True)
    assert count_params(qwen2) == 80448 + 2 * (64 + 2 * 32)  # biases of q (4 heads x 16), k and v (2 x 16)

    mistral = ModelArgs(**SMALL, tie_embeddings=True, family="mistral", sliding_window=8)
    # Each query has at most 8 keys: attention's term is that of 8 tokens, past the window.
    assert flops_per_token(mistral, 32) == 6 * 80448 + 12 * 2 * 4 * 16 * 8
    assert flops_per_token(mistral, 4) == flops_per_token(ModelArgs(**SMALL, tie_embeddings=True), 4)

    for args in (qwen3, qwen2, mistral):
        with torch.device("meta"):
            assert Transformer(args).num_params() == count_params(args)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI300X VF", 1307.4),
        ("AMD Instinct MI300A", 980.6),
        ("AMD Instinct MI325X", 1307.4),
        ("AMD Instinct MI355X", 2516.6),
        ("AMD Instinct MI250X/MI250", 191.5),
        ("AMD Instinct MI250X", 191.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.4),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA L40S", 362.05),
        ("nvidia h100 pcie", 756.0),
    ],
)
def test_peak_lookup(name, tflops):
    assert peak_tflops(name) == tflops


@pytest.mark.parametrize("name", ["cpu", "", "NVIDIA GeForce RTX 4090", "Intel(R) Data Center GPU Max 1550"])
def test_peak_lookup_unknown_is_none(name):
    assert peak_tflops(name) is None


def test_mfu_and_achieved():
    assert achieved_tflops(1000, 2e9) == pytest.approx(2.0)
    assert mfu(1000, 2e9, 8 * 2.5) == pytest.approx(0.1)
    assert mfu(1000, 2e9, None) is None


def test_every_preset_is_in_the_readme_table_and_the_help(tmp_path):
    """One list of presets: the README's table (with each preset's parameter count), `bench --help` and
    `plan --help` name them all, as the config comment and the unknown-preset error do."""
    import re
    from pathlib import Path

    from phalanx.models.presets import MODEL_PRESETS
    from tests.helpers import phalanx

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([0-9a-z.-]+)`[^|]*\|(?:[^|]*\|){5} ([0-9,]+) \|$", readme, re.M))
    assert rows == {name: f"{count_params(args):,}" for name, args in MODEL_PRESETS.items()}
    for command in ("bench", "plan"):
        help_text = re.sub(r"[│\s]+", " ", phalanx(command, "--help").stdout)  # rich's box, lines joined
        assert ", ".join(MODEL_PRESETS) in help_text, command
