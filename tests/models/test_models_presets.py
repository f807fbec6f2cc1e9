import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import Transformer
from phalanx.models.flops import count_params
from phalanx.models.presets import MODEL_PRESETS, get_preset

# Meta's published sizes for the Llama 3 family.
KNOWN_PARAMS = {"1b": 1_235_814_400, "8b": 8_030_261_248, "70b": 70_553_706_496, "405b": 405_853_388_800}


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
    assert all(args.norm_eps == 1e-5 for args in MODEL_PRESETS.values())
    assert get_preset("70b").rope_theta == 500000.0


@pytest.mark.parametrize("name, suggestion", [("tinny", "tiny"), ("8B", "8b"), ("70", "70b")])
def test_unknown_preset_names_the_valid_ones_and_the_closest(name, suggestion):
    with pytest.raises(PhalanxError) as err:
        get_preset(name)
    message = str(err.value)
    assert f"did you mean '{suggestion}'" in message
    assert all(valid in message for valid in MODEL_PRESETS)
