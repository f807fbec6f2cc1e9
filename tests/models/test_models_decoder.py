import math

import pytest
import torch

from phalanx.errors import PhalanxError
from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.rope import apply_rope, rope_rotation, rope_tables
from phalanx.models.token_pass import Cached, Causal, DecodeRows

ARGS = ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, max_seq_len=32, rope_theta=10000.0
)
TIED = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})


def build(args=ARGS, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args)


def tokens(B, T, seed=1):
    return torch.randint(0, ARGS.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def test_forward_shape_and_dtype():
    model = build()
    assert model(tokens(3, 10)).shape == (3, 10, ARGS.vocab_size)
    logits = model.to(torch.bfloat16)(tokens(2, 5))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_causal_future_tokens_do_not_change_past_logits():
    model = build()
    x = tokens(2, 12)
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % ARGS.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_kv_cache_prefill_then_single_steps_matches_full_forward():
    model = build()
    x = tokens(2, 12)
    with torch.no_grad():
        full = model(x)
        cache = KVCache(ARGS, batch_size=2, max_len=12)
        steps = [model(x[:, :5], Cached(cache, 0))]
        for pos in range(5, 12):
            steps.append(model(x[:, pos : pos + 1], Cached(cache, pos)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_kv_cache_chunked_prefill_matches_full_forward():
    model = build()
    x = tokens(2, 12)
    with torch.no_grad():
        full = model(x)
        cache = KVCache(ARGS, batch_size=2, max_len=16)
        chunks = [model(x[:, a:b], Cached(cache, a)) for a, b in ((0, 4), (4, 9), (9, 12))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


def test_too_long_sequences_raise_phalanx_error():
    model = build()
    with pytest.raises(PhalanxError, match="max_seq_len"):
        model(tokens(1, ARGS.max_seq_len + 1))
    with pytest.raises(PhalanxError, match="KV cache"):
        model(tokens(1, 9), Cached(KVCache(ARGS, 1, max_len=8)))
    with pytest.raises(PhalanxError, match="max_seq_len"):
        KVCache(ARGS, 1, max_len=ARGS.max_seq_len + 1)


def reference_attention(attn, x_BTD, cos_TE, sin_TE):
    """Written independently: k/v heads copied per query group, softmax with an explicit causal mask."""
    B, T, _ = x_BTD.shape
    E, H, K = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = (x_BTD @ attn.wq.weight.T).view(B, T, H, E).transpose(1, 2)
    k = (x_BTD @ attn.wk.weight.T).view(B, T, K, E).transpose(1, 2)
    v = (x_BTD @ attn.wv.weight.T).view(B, T, K, E).transpose(1, 2)
    q, k = apply_rope(q, cos_TE, sin_TE), apply_rope(k, cos_TE, sin_TE)
    k = torch.stack([k[:, h // (H // K)] for h in range(H)], dim=1)
    v = torch.stack([v[:, h // (H // K)] for h in range(H)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(B, T, H * E) @ attn.wo.weight.T


def test_grouped_query_attention_matches_repeated_kv_reference():
    model = build()
    attn = model.layers["0"].attention
    x = torch.randn(2, 9, ARGS.dim)
    cos, sin = model.rope_cos[:9], model.rope_sin[:9]
    with torch.no_grad():
        out = attn(x, rope_rotation(cos, sin, x.dtype), Causal())  # the layers take the tables once made for all
        torch.testing.assert_close(out, reference_attention(attn, x, cos, sin), rtol=0, atol=1e-5)


def test_rope_rotates_first_half_against_second_half():
    # HF's rotate_half layout: dims i and i + E/2 form one pair, turned by pos * theta^(-2i/E).
    E, theta, pos = 8, 10000.0, 5
    cos, sin = rope_tables(E, 16, theta)
    x = torch.randn(E)
    out = apply_rope(x, cos[pos], sin[pos])
    for i in range(E // 2):
        angle = pos * theta ** (-2 * i / E)
        z = complex(x[i], x[i + E // 2]) * complex(math.cos(angle), math.sin(angle))
        assert out[i].item() == pytest.approx(z.real, abs=1e-5)
        assert out[i + E // 2].item() == pytest.approx(z.imag, abs=1e-5)


def test_tied_output_is_the_embedding_parameter():
    model = build(TIED)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.num_params() == build(ARGS).num_params() - ARGS.vocab_size * ARGS.dim


def test_init_is_deterministic_and_scaled():
    a, b, c = build(seed=3), build(seed=3), build(seed=4)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert torch.equal(a.norm.weight, torch.ones(ARGS.dim))
    wq_std, wo_std = a.layers["0"].attention.wq.weight.std(), a.layers["0"].attention.wo.weight.std()
    assert wq_std.item() == pytest.approx(0.02, rel=0.1)
    assert wo_std.item() == pytest.approx(0.02 / math.sqrt(2 * ARGS.n_layers), rel=0.1)


def test_meta_build_then_to_empty_and_init_weights_fully_initialises():
    with torch.device("meta"):
        model = Transformer(TIED)
    model.to_empty(device="cpu")
    torch.manual_seed(7)
    model.init_weights()
    eager = build(TIED)
    torch.manual_seed(7)
    eager.init_weights()
    assert model.output.weight is model.tok_embeddings.weight  # to_empty unties; init_weights re-ties
    for name, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model.rope_cos, eager.rope_cos) and torch.equal(model.rope_sin, eager.rope_sin)
    assert "rope_cos" not in model.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(1, 8)), eager(tokens(1, 8)), rtol=0, atol=0)


@pytest.mark.parametrize(
    "change",
    [
        {"dim": 65},  # not divisible by n_heads
        {"n_kv_heads": 3},  # n_heads not divisible by n_kv_heads
        {"dim": 60, "n_heads": 4, "n_kv_heads": 4},  # head_dim 15 is odd
        {"n_layers": 0},
        {"vocab_size": -1},
    ],
)
def test_bad_model_args_raise_phalanx_error(change):
    with pytest.raises(PhalanxError):
        ModelArgs(**{**ARGS.__dict__, **change})


def test_matches_hugging_face_llama_when_available():
    transformers = pytest.importorskip("transformers")
    model = build(ARGS).double()
    config = transformers.LlamaConfig(
        vocab_size=ARGS.vocab_size,
        hidden_size=ARGS.dim,
        intermediate_size=ARGS.ffn_dim,
        num_hidden_layers=ARGS.n_layers,
        num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.n_kv_heads,
        max_position_embeddings=ARGS.max_seq_len,
        rope_theta=ARGS.rope_theta,
        rms_norm_eps=ARGS.norm_eps,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(config).double().eval()
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj"}
    names |= {"wo": "self_attn.o_proj", "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    state["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers.values()):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = layer.attention_norm.weight
        state[p + "post_attention_layernorm.weight"] = layer.ffn_norm.weight
        for ours, theirs in names.items():
            module = layer.attention if ours in ("wq", "wk", "wv", "wo") else layer.feed_forward
            state[p + theirs + ".weight"] = getattr(module, ours).weight
    hf.load_state_dict({k: v.detach() for k, v in state.items()})
    x = tokens(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-8)


FAMILY_ARGS = {
    "mistral-window": ModelArgs(**{**ARGS.__dict__, "family": "mistral", "sliding_window": 5}),
    "qwen2-bias": ModelArgs(**{**ARGS.__dict__, "family": "qwen2", "qkv_bias": True}),
    "qwen3-qk-norm": ModelArgs(**{**ARGS.__dict__, "family": "qwen3", "qk_norm": True, "head_dim": 24}),
}


@pytest.mark.parametrize("name", sorted(FAMILY_ARGS))
def test_every_token_pass_computes_the_whole_forward_for_each_family(name):
    """Prefill then one-token steps (Cached), and batched per-row decoding (DecodeRows), give what the
    whole-sequence forward gives, with each family's additions (a window shorter than the sequence, biases,
    per-head norms and a head_dim of its own)."""
    args = FAMILY_ARGS[name]
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms start at 0 and 1: give every parameter a value
            p.add_(torch.randn_like(p) * 0.1)
        x = tokens(2, 12)
        full = model(x)
        cache = KVCache(args, batch_size=2, max_len=16)
        steps = [model(x[:, :4], Cached(cache))] + [model(x[:, t : t + 1], Cached(cache, t)) for t in range(4, 12)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
        # Two rows at different lengths in one step: row 0 at position 11, row 1 at position 7.
        rows = KVCache(args, batch_size=2, max_len=16)
        model(x[:1, :11], Cached(_Row(rows, 0)))
        model(x[1:, :7], Cached(_Row(rows, 1)))
        step = model(torch.stack([x[0, 11:12], x[1, 7:8]]), DecodeRows(rows, torch.tensor([11, 7])))[:, 0]
        torch.testing.assert_close(step, torch.stack([full[0, 11], full[1, 7]]), rtol=0, atol=1e-5)
    if args.sliding_window:  # and the window matters at this length
        unwindowed = Transformer(ModelArgs(**{**args.__dict__, "sliding_window": None}))
        unwindowed.load_state_dict(model.state_dict())
        assert not torch.allclose(unwindowed(x)[:, 6:], full[:, 6:], atol=1e-3)


class _Row:
    """One row of a KVCache, shaped like a batch-of-one cache (views: writes land in it)."""

    def __init__(self, cache: KVCache, row: int):
        self.max_len, self.row, self.cache = cache.max_len, row, cache

    def layer(self, i):
        return self.cache.k[i][self.row : self.row + 1], self.cache.v[i][self.row : self.row + 1]
