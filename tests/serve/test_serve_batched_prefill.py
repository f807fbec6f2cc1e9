"""Batched prefill (serve/engines/prefill.py): the prompts joining at one step boundary go through the model in one
pass, and each still gets exactly the bits of its prefill alone: the same last-token logits and the same
cached keys and values as the model's own forward gives it, so the same greedy tokens (and the same
log-probabilities, compared exactly) alone and prefilled beside others of other lengths. Their first
tokens come out of that one pass; a burst beyond the token budget joins over several boundaries; where
tall products are not row-invariant, prompts are prefilled one at a time as before."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from phalanx.models.decoder import KVCache, ModelArgs, Transformer
from phalanx.models.token_pass import Cached
from phalanx.serve.core.options import SamplingOptions
from phalanx.serve.engines.prefill import prefill_rows_agree, prefill_together
from phalanx.serve.engines.row_invariant import RowInvariantLinear, make_rows_invariant
from phalanx.serve.engines.torch_engine import Engine

# ffn 1152: w2's reduction is cut in two chunks of at most 1024 (row_invariant.py), so the chunked path runs.
ARGS = ModelArgs(
    dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=1152, vocab_size=512, max_seq_len=320, rope_theta=10000.0
)


def requests(tokenizer, count: int) -> list[tuple[list[int], SamplingOptions]]:
    """Prompts of 2 to ~200 tokens (most longer than 16), greedy, greedy with a penalty, seeded samples."""
    out = []
    for i in range(count):
        ids = [0] + tokenizer.encode("ROMEO: " + "wherefore art thou Romeo? " * (i * 5 % 11) + f"speak {i}").ids
        ids = ids[:2] if i == 3 else ids  # one nearly empty prompt
        if i % 4 == 3:
            options = SamplingOptions(temperature=0.9, top_k=40, seed=i, max_tokens=10 + i)
        elif i % 4 == 2:
            options = SamplingOptions(temperature=0, repeat_penalty=1.3, max_tokens=12 + i)
        else:
            options = SamplingOptions(temperature=0, max_tokens=14 + 2 * i)
        out.append((ids, options))
    return out


def run_all(engine: Engine, reqs) -> list[tuple]:
    """Submit every request before the engine's thread starts, so all are waiting at its first boundary."""
    streams = [engine.submit(ids, options, top_logprobs=2) for ids, options in reqs]
    engine.start()
    try:
        texts = [stream.text() for stream in streams]
    finally:
        engine.stop()
    return [
        (text, s.finish.completion_tokens, s.finish.reason, s.logprobs, s.finish) for text, s in zip(texts, streams)
    ]


def alone(model, tokenizer, reqs) -> list[tuple]:
    out = []
    for ids, options in reqs:
        out.extend(run_all(Engine(model, tokenizer, slots=1, max_queue=0), [(ids, options)]))
    return out


def outputs(results) -> list[tuple]:
    return [r[:4] for r in results]


def prefill_alone(net: Transformer, ids: list[int], cache: KVCache, row: int) -> torch.Tensor:
    """The model's own forward over one prompt into one cache row (the engine's prefill before batching)."""
    view = type(
        "Row",
        (),
        {"max_len": cache.max_len, "layer": lambda self, i: (cache.k[i][row : row + 1], cache.v[i][row : row + 1])},
    )()
    return net(torch.tensor([ids]), Cached(view))[0, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_prefilled_together_get_the_bits_of_their_prefill_alone(dtype):
    torch.manual_seed(0)
    net = Transformer(ARGS).eval().to(dtype)
    if not make_rows_invariant(net):
        pytest.skip(f"this CPU's {dtype} products are not row-invariant at decode widths (no bf16 units)")
    if not prefill_rows_agree(net):
        pytest.skip(f"this CPU's tall {dtype} products are not row-invariant: the engine prefills one at a time")
    lengths = [1, 17, 2, 250, 40, 5]  # a lone token, odd lengths, one far beyond decode's 16 rows
    prompts = [torch.randint(0, ARGS.vocab_size, (n,)).tolist() for n in lengths]
    rows = [4, 0, 5, 2, 1, 3]  # not in order: each prompt must land in its own row only
    expected_cache = KVCache(ARGS, len(prompts), ARGS.max_seq_len, dtype=dtype)
    together_cache = KVCache(ARGS, len(prompts), ARGS.max_seq_len, dtype=dtype)
    with torch.no_grad():
        expected = [prefill_alone(net, p, expected_cache, row) for p, row in zip(prompts, rows)]
        together = prefill_together(net, prompts, together_cache, rows)
    for i, n in enumerate(lengths):
        assert torch.equal(together[i], expected[i]), f"prompt {i} ({n} tokens): other logits"
    for a, b in zip(together_cache.k + together_cache.v, expected_cache.k + expected_cache.v):
        assert torch.equal(a, b)  # the same keys and values, and nothing written beyond each prompt's length


def test_simultaneous_requests_are_prefilled_in_one_pass_and_get_their_tokens_alone(model, tokenizer):
    reqs = requests(tokenizer, 8)
    expected = alone(model, tokenizer, reqs)
    assert len({text for text, *_ in expected}) == len(reqs)
    engine = Engine(model, tokenizer, slots=8, max_queue=8)
    assert engine.batched_prefill
    engine.prefill_budget = sum(len(ids) for ids, _ in reqs)  # all in one pass (a server's takes 256 tokens)
    got = run_all(engine, reqs)
    assert outputs(got) == outputs(expected)
    finishes = [r[4] for r in got]
    # One pass: every prefill started at the same moment, and every first token came after all had started
    # (one at a time, request 2's prefill starts only after request 1's first token).
    assert len({f.prefill_started_at for f in finishes}) == 1
    assert max(f.prefill_started_at for f in finishes) < min(f.first_token_at for f in finishes)


def test_a_burst_beyond_the_token_budget_joins_over_several_boundaries_unchanged(model, tokenizer):
    reqs = requests(tokenizer, 8)
    expected = alone(model, tokenizer, reqs)
    engine = Engine(model, tokenizer, slots=8, max_queue=8)
    engine.prefill_budget = 200  # tokens per boundary: a few of these prompts each
    got = run_all(engine, reqs)
    assert outputs(got) == outputs(expected)
    groups: dict[float, list[int]] = {}
    for (ids, _), result in zip(reqs, got):
        groups.setdefault(result[4].prefill_started_at, []).append(len(ids))
    assert len(groups) > 2
    for lengths in groups.values():
        assert len(lengths) == 1 or sum(lengths) <= 200, groups
    # In order, and each later group joined after the earlier ones had decoded: their first tokens were out.
    starts = sorted(groups)
    firsts = {f.prefill_started_at: f.first_token_at for f in (r[4] for r in got)}
    assert all(firsts[a] < b for a, b in pairwise(starts))


def test_where_tall_products_are_not_row_invariant_prompts_are_prefilled_one_at_a_time(model, tokenizer):
    class PlainMatmul(RowInvariantLinear):  # torch's default CPU matmul (MKL): rows differ by product height
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias)

    torch.manual_seed(0)
    mkl = Transformer(ARGS).eval()
    assert not prefill_rows_agree(mkl)  # torch's own layers: nothing proves their rows
    assert make_rows_invariant(mkl) and prefill_rows_agree(mkl)
    block = mkl.layers["0"]
    block.feed_forward.w1 = PlainMatmul(torch.nn.Linear(ARGS.dim, ARGS.ffn_dim, bias=False))
    assert not prefill_rows_agree(mkl)  # what the engine checks before it prefills together

    reqs = requests(tokenizer, 6)
    expected = alone(model, tokenizer, reqs)
    engine = Engine(model, tokenizer, slots=8, max_queue=8)
    engine.batched_prefill = False  # what it chooses where that check fails
    engine.prefill_budget = float("inf")
    got = run_all(engine, reqs)
    assert outputs(got) == outputs(expected)
    finishes = sorted((r[4] for r in got), key=lambda f: f.prefill_started_at)
    assert all(a.first_token_at <= b.prefill_started_at for a, b in pairwise(finishes))
