import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.llama import ModelArgs, Transformer
from phalanx.models.sampling import generate

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=40)
PROMPT = [5, 17, 3, 88, 42]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ARGS)


def test_seeded_sampling_is_reproducible(model):
    a = generate(model, PROMPT, 20, temperature=1.5, top_k=50, seed=11)
    assert a == generate(model, PROMPT, 20, temperature=1.5, top_k=50, seed=11)
    assert a != generate(model, PROMPT, 20, temperature=1.5, top_k=50, seed=12)
    assert len(a) == 20 and all(0 <= t < ARGS.vocab_size for t in a)


def test_greedy_equals_argmax_of_full_forward(model):
    out = generate(model, PROMPT, 12, temperature=0)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(PROMPT):]
    assert generate(model, PROMPT, 12, temperature=1.0, top_k=1, seed=3) == out


def test_stops_at_eos_without_including_it(model):
    out = generate(model, PROMPT, 12, temperature=1.0, seed=5)
    eos = out[4]
    assert generate(model, PROMPT, 12, temperature=1.0, seed=5, eos_id=eos) == out[: out.index(eos)]


def test_length_limits(model):
    assert generate(model, PROMPT, 0) == []
    assert len(generate(model, PROMPT, ARGS.max_seq_len - len(PROMPT), temperature=0)) == 35
    with pytest.raises(PhalanxError, match="--max-new-tokens 35"):
        generate(model, PROMPT, 36)
    with pytest.raises(PhalanxError, match="prompt of 41 tokens exceeds"):
        generate(model, [1] * 41, 1)
    with pytest.raises(PhalanxError):
        generate(model, [], 5)
