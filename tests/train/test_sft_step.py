"""Fine-tuning's training step on packed rows (data/sft_batches.py, models/token_pass.py's Packed,
train/step.py's masked loss): a packed row computes what each example computes alone, tokens outside the
trained replies put exactly nothing into the gradient, and packed and one-example-per-row batches give
the same loss and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phalanx.data.sft_batches import IGNORE, ExampleRows
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.token_pass import Causal, Packed
from phalanx.train.step import StepHooks, sft_loss_scale, train_step

SMALL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=32)


class Examples:
    """An in-memory stand-in for data/sft.py's SftExamples: its `lengths` and `example(i)`."""

    def __init__(self, examples: list[tuple[list[int], list[bool]]]):
        self.items = [(np.asarray(t, dtype=np.int64), np.asarray(f, dtype=bool)) for t, f in examples]
        self.lengths = np.array([len(t) for t, _ in self.items])

    def example(self, i: int):
        return self.items[i]


def chat_examples(seed: int, n: int) -> Examples:
    """`n` examples of 4-9 tokens: a prompt, then a trained reply of 2-4 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt, reply = rng.integers(1, 50, rng.integers(2, 6)), rng.integers(1, 50, rng.integers(2, 4))
        out.append(([*prompt, *reply], [False] * len(prompt) + [True] * len(reply)))
    return Examples(out)


class Captured(StepHooks):
    """The step's summed loss and gradients, taken where the optimizer would step (which it then skips)."""

    def __init__(self, model):
        self.model, self.grads, self.loss = model, None, None

    def apply_update(self, loss_sum, parts, grad_norm):
        self.loss = float(loss_sum) / parts
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        return False


def step(model, micro_batches):
    hooks = Captured(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_step(
        model,
        optimizer,
        list(model.parameters()),
        micro_batches,
        device=torch.device("cpu"),
        grad_clip=0.0,
        hooks=hooks,
        trained_share=sft_loss_scale(micro_batches, torch.device("cpu")),
    )
    return hooks


@pytest.mark.parametrize("window", [None, 3])
def test_a_packed_row_computes_each_example_alone(window):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SMALL, family="mistral" if window else "llama", sliding_window=window)).eval()
    lengths = [5, 7, 4]
    tokens = torch.randint(0, 50, (sum(lengths),))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        packed = model(tokens[None], Packed(positions[None]))[0]
        start = 0
        for n in lengths:
            alone = model(tokens[None, start : start + n], Causal())[0]
            torch.testing.assert_close(packed[start : start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_tokens_outside_the_replies_put_nothing_into_the_gradient():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SMALL))
    rows = ExampleRows(chat_examples(1, 12), seq_len=20, pack=True)
    batch = rows.micro_batch(np.arange(len(rows)))
    seen = []
    model.output.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0].clone()))
    step(model, [batch])
    grad_BTV = seen[0]
    trained = batch[1] != IGNORE
    assert bool(trained.any()) and bool((~trained).any())
    assert torch.count_nonzero(grad_BTV[~trained]) == 0  # exactly zero, not merely small
    assert bool((grad_BTV[trained].abs().sum(-1) > 0).all())


def test_packed_and_one_per_row_batches_give_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SMALL))
    examples = chat_examples(2, 10)
    packed = ExampleRows(examples, seq_len=24, pack=True)
    alone = ExampleRows(examples, seq_len=24, pack=False)
    assert len(packed) < len(alone) == 10
    # Packed: one micro batch; one per row: two micro batches of five (the loss is over trained tokens).
    a = step(model, [packed.micro_batch(np.arange(len(packed)))])
    b = step(model, [alone.micro_batch(np.arange(5)), alone.micro_batch(np.arange(5, 10))])
    assert a.loss == pytest.approx(b.loss, rel=1e-6)
    for name, grad in a.grads.items():
        torch.testing.assert_close(grad, b.grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_row_keeps_examples_whole_and_positions_restart():
    examples = Examples(
        [([1, 2, 3], [False, True, True]), ([4, 5], [False, True]), ([6, 7, 8, 9], [False] * 2 + [True] * 2)]
    )
    rows = ExampleRows(examples, seq_len=5, pack=True)  # 6 slots: [1 2 3 4 5 pad] [6 7 8 9 pad pad]
    inputs, targets, positions = rows.micro_batch(np.arange(len(rows)))
    assert inputs.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    # targets: 2 3 trained; 4 starts an example (never trained); 5 trained; padding never
    assert targets.tolist() == [[2, 3, IGNORE, 5, IGNORE], [IGNORE, 8, 9, IGNORE, IGNORE]]
