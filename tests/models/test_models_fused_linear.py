"""The shared-input projections' one backward (models/fused_linear.py) and the sign-moved RoPE give the
model's forward bit for bit and its gradients within float rounding."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import decoder, feed_forward, rope
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import apply_rope, rope_tables, rotate_half

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=384, max_seq_len=64)


def loss_and_grads(model, tokens, autocast):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_backward_keeps_the_forward_and_the_gradients(autocast, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48))
    fused = loss_and_grads(model, tokens, autocast)
    for module in (decoder, feed_forward):  # attention's q/k/v, the feed-forward's gate/up
        monkeypatch.setattr(module, "shared_input_linears", lambda x, linears: tuple(m(x) for m in linears))
    plain = loss_and_grads(model, tokens, autocast)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    tolerance = 1e-2 if autocast else 1e-5  # bf16's rounding, float32's
    for name, grad in plain[2].items():
        assert (fused[2][name] - grad).abs().max() <= tolerance * grad.abs().max(), name


def test_inference_takes_the_plain_modules(monkeypatch):
    calls = []
    monkeypatch.setattr(decoder.nn.Linear, "forward", lambda self, x: calls.append(1) or F.linear(x, self.weight))
    model = Transformer(ARGS)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert len(calls) == ARGS.n_layers * 7 + 1  # every projection and the output, as nn.Linear calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_rotate_half_bit_for_bit(dtype):
    cos, sin = rope_tables(16, 64, 10000.0)
    x = torch.randn(2, 4, 64, 16).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin), rotate_half_rope(x, cos.to(dtype), sin.to(dtype)))


def rotate_half_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roped_q_and_its_gradient_are_the_composites_bits(dtype):
    """RoPE's written-out backward (rope._Rotation) and its cat-free forward, on the strided q the
    attention hands it, against autograd of the plain formula."""
    cos, sin = rope_tables(16, 64, 10000.0)
    signed = rope.rope_rotation(cos[:24], sin[:24], dtype)
    q = torch.randn(2, 24, 4, 16).to(dtype).transpose(1, 2)  # (B, H, T, E) as a view, like Attention's
    grad = torch.randn(2, 4, 24, 16).to(dtype)
    ours, plain = q.detach().requires_grad_(), q.detach().requires_grad_()
    out = rope.rotate(ours, *signed)
    out.backward(grad)
    assert type(out.grad_fn).__name__ == "_RotationBackward"
    expected = rotate_half_rope(plain, cos[:24].to(dtype), sin[:24].to(dtype))
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(ours.grad, plain.grad)
    # decoding: per-row tables (B, 1, 1, E), no autograd
    positions = torch.tensor([3, 40])
    row_cos, row_sin = cos[positions][:, None, None], sin[positions][:, None, None]
    x = torch.randn(2, 4, 1, 16).to(dtype)
    assert torch.equal(
        rope.rotate(x, *rope.rope_rotation(row_cos, row_sin, dtype)),
        rotate_half_rope(x, row_cos.to(dtype), row_sin.to(dtype)),
    )
