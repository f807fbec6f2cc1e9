"""RMSNorm's hand-written CPU backward (models/rms_norm.py): the composite's forward bit for bit, and
gradients that agree with float64 autograd of the same formula."""

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import rms_norm as norm_module
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rms_norm import rms_norm
from tests.model_steps import loss_and_grads

EPS = 1e-5


def composite(x, weight):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=EPS).to(x.dtype)


def grads(fn, x, weight, grad_out):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = fn(x, weight)
    out.backward(grad_out)
    return out.detach(), x.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_composites_bits_and_gradients_match_float64(dtype):
    torch.manual_seed(0)
    x, weight = (3 * torch.randn(4, 9, 96)).to(dtype), torch.randn(96).to(dtype)
    grad_out = torch.randn(4, 9, 96).to(dtype)
    out, grad_x, grad_w = grads(lambda a, b: rms_norm(a, b, EPS), x, weight, grad_out)
    assert out.dtype == dtype
    expected, composite_x, composite_w = grads(composite, x, weight, grad_out)
    assert torch.equal(out, expected)
    # The reference: the same formula in float64, differentiated by autograd.
    _, exact_x, exact_w = grads(
        lambda a, b: b * a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + EPS),
        x.double(),
        weight.double(),
        grad_out.double(),
    )
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for ours, theirs, exact in ((grad_x, composite_x, exact_x), (grad_w, composite_w, exact_w)):
        assert ours.dtype == dtype
        scale = exact.abs().max()
        assert (ours.double() - exact).abs().max() <= tolerance * scale
        # at least as close to the exact gradient as autograd's composite, within rounding
        assert (ours.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-7 * scale


def test_training_on_cpu_takes_the_hand_written_backward_and_inference_the_composite():
    x, weight = torch.randn(2, 3, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    assert type(rms_norm(x, weight, EPS).grad_fn).__name__ == "_RMSNormFunctionBackward"
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, EPS), composite(x, weight))
    frozen = rms_norm(x.detach(), weight.detach(), EPS)
    assert frozen.grad_fn is None


def test_only_the_needed_gradient_is_computed():
    x, weight = torch.randn(2, 3, 8, requires_grad=True), torch.ones(8)
    rms_norm(x, weight, EPS).sum().backward()
    assert x.grad is not None and weight.grad is None
    x, weight = torch.randn(2, 3, 8), torch.ones(8, requires_grad=True)
    rms_norm(x, weight, EPS).sum().backward()
    assert weight.grad is not None


@pytest.mark.parametrize("autocast", [False, True])
def test_the_model_keeps_its_loss_bits_with_the_hand_written_backward(autocast, monkeypatch):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=384, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 48))

    ours = loss_and_grads(model, tokens, autocast)
    monkeypatch.setattr(norm_module, "rms_norm", lambda x, w, eps: composite(x, w))  # what RMSNorm calls
    plain = loss_and_grads(model, tokens, autocast)
    assert torch.equal(ours[0], plain[0])
    tolerance = 1e-2 if autocast else 1e-5
    for name, grad in plain[1].items():
        assert (ours[1][name] - grad).abs().max() <= tolerance * grad.abs().max(), name
