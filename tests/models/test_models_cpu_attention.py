"""The CPU bf16 training attention (models/cpu_attention.py): SDPA's causal result and gradients within
bf16 rounding, no less accurate than torch's flash kernel against a float64 reference, the same bits at
any thread count, used by training's Causal pass only where it applies, and clear refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import cpu_attention
from phalanx.models.decoder import ModelArgs, Transformer

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()),
    reason="the kernel needs avx512_bf16",
)


def kernel_or_skip():
    if not cpu_attention._built():
        pytest.skip("no C++ compiler: SDPA serves")


def heads(B, H, T, E, seed):
    """(B, H, T, E) bf16 over a (B, T, H, E) tensor, as the model's q, k, v are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, E, generator=g).to(torch.bfloat16).transpose(1, 2)


def attend(attention, q, k, v, grad):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v)
    out.backward(grad.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize(
    "B, H, KV, T, E",
    [(2, 4, 2, 100, 64), (1, 2, 2, 256, 32), (2, 2, 1, 70, 128), (1, 3, 3, 1, 64), (3, 6, 6, 130, 64)],
)
def test_output_and_gradients_are_sdpa_within_what_flash_itself_misses(B, H, KV, T, E):
    """Against float64 SDPA, the kernel's error on the output and on every gradient is at most 2x torch's
    own bf16 flash kernel's, or within bf16's rounding of the largest value. Covers grouped kv heads, T
    not a multiple of a block, head dims 32-128 and a single token."""
    kernel_or_skip()
    q, k, v, grad = heads(B, H, T, E, 0), heads(B, KV, T, E, 1), heads(B, KV, T, E, 2), heads(B, H, T, E, 3)
    exact = attend(sdpa, *(x.double() for x in (q, k, v)), grad.double())
    flash = attend(sdpa, q, k, v, grad)
    ours = attend(cpu_attention.causal_attention, q, k, v, grad)
    assert ours[0].dtype == torch.bfloat16 and ours[0].shape == (B, H, T, E)
    for name, got, theirs, want in zip(("out", "dq", "dk", "dv"), ours, flash, exact):
        err, flash_err = ((x.double() - want).abs().max().item() for x in (got, theirs))
        scale = want.abs().max().item()
        assert err <= max(2 * flash_err, 2**-8 * scale, 1e-6), (name, err, flash_err)  # 1e-6: one token's dq is 0


def test_the_output_is_laid_out_as_the_output_projection_reads_it():
    kernel_or_skip()
    q, k, v = heads(2, 4, 64, 32, 0), heads(2, 4, 64, 32, 1), heads(2, 4, 64, 32, 2)
    out = cpu_attention.causal_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()


def test_bits_do_not_depend_on_the_thread_count():
    kernel_or_skip()
    q, k, v, grad = heads(2, 4, 200, 64, 0), heads(2, 2, 200, 64, 1), heads(2, 2, 200, 64, 2), heads(2, 4, 200, 64, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = attend(cpu_attention.causal_attention, q, k, v, grad)
        torch.set_num_threads(max(2, threads))
        shared = attend(cpu_attention.causal_attention, q, k, v, grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def test_autocast_inputs_are_cast_and_their_gradients_come_back_in_float32():
    kernel_or_skip()
    q, k, v = (heads(1, 2, 48, 32, s).float().requires_grad_() for s in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_attention.applies(q, None)
        out = cpu_attention.causal_attention(q, k, v)
        expected = sdpa(q, k, v)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max() <= 2**-7 * expected.abs().max()
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "case",
    ["float32", "head dim 48", "window shorter than T", "one token", "switched off", "meta device"],
)
def test_where_it_does_not_apply_sdpa_serves(case, monkeypatch):
    q, window = heads(1, 2, 16, 32, 0), None
    if case == "float32":
        q = q.float()
    elif case == "head dim 48":
        q = heads(1, 2, 16, 48, 0)
    elif case == "window shorter than T":
        window = 8
    elif case == "one token":
        q = heads(1, 2, 1, 32, 0)
    elif case == "switched off":
        monkeypatch.setenv("PHALANX_CPU_ATTENTION", "0")
    else:
        q = q.to("meta")
    assert not cpu_attention.applies(q, window)


def test_a_bf16_training_step_takes_it_and_matches_sdpa(monkeypatch):
    """The model's Causal pass under autocast: the kernel runs once per layer, and the loss and every
    gradient are SDPA's within bf16 rounding."""
    kernel_or_skip()
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256, max_seq_len=96)
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 80))

    def step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    forward = cpu_attention._CausalAttention.forward
    monkeypatch.setattr(cpu_attention._CausalAttention, "forward", lambda *a: calls.append(1) or forward(*a))
    loss, grads = step()
    assert len(calls) == args.n_layers
    monkeypatch.setenv("PHALANX_CPU_ATTENTION", "0")
    sdpa_loss, sdpa_grads = step()
    assert len(calls) == args.n_layers
    assert loss.item() == pytest.approx(sdpa_loss.item(), rel=1e-3)
    for name, grad in sdpa_grads.items():
        assert (grads[name] - grad).abs().max() <= 2e-2 * grad.abs().max(), name


@pytest.mark.parametrize(
    "bad, message",
    [
        ("float32 q", "bf16"),
        ("kv heads not dividing", "mismatched"),
        ("head dim 48", "multiple of 32"),
        ("k shorter than q", "mismatched"),
    ],
)
def test_the_op_refuses_what_it_cannot_compute(bad, message):
    kernel_or_skip()
    q, k = heads(1, 4, 16, 32, 0), heads(1, 4, 16, 32, 1)
    if bad == "float32 q":
        q = q.float()
    elif bad == "kv heads not dividing":
        k = heads(1, 3, 16, 32, 1)
    elif bad == "head dim 48":
        q, k = heads(1, 4, 16, 48, 0), heads(1, 4, 16, 48, 1)
    else:
        k = heads(1, 4, 8, 32, 1)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.phalanx_attention.causal_forward(q, k, k, 1 / math.sqrt(q.shape[-1]))
