"""The CPU training attention (models/cpu_attention.py): SDPA's causal result and gradients, no less
accurate than torch's flash kernel against a float64 reference in bf16 and float32, the same bits at any
thread count, used by training's Causal pass only where it applies, and clear refusals."""

import math

import pytest
import torch
import torch.nn.functional as F

from phalanx.models import cpu_attention
from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.models.rope import rope_rotation, rope_tables, rotate
from tests.model_steps import loss_and_grads

pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()),
    reason="the kernel needs avx512_bf16",
)


def kernel_or_skip():
    if not cpu_attention.ready():
        pytest.skip("no C++ compiler: SDPA serves")


def heads(B, H, T, E, seed, dtype=torch.bfloat16):
    """(B, H, T, E) over a (B, T, H, E) tensor, as the model's q, k, v are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, E, generator=g).to(dtype).transpose(1, 2)


def attend(attention, q, k, v, grad):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v)
    out.backward(grad.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "B, H, KV, T, E",
    [(2, 4, 2, 100, 64), (1, 2, 2, 256, 32), (2, 2, 1, 70, 128), (1, 3, 3, 1, 64), (3, 6, 6, 130, 64)],
)
def test_output_and_gradients_are_sdpa_within_what_flash_itself_misses(B, H, KV, T, E, dtype):
    """Against float64 SDPA, the kernel's error on the output and on every gradient is at most 2x torch's
    own flash kernel's in the same dtype, or within that dtype's rounding of the largest value. Covers
    grouped kv heads, T not a multiple of a block, head dims 32-128 and a single token."""
    kernel_or_skip()
    q, k, v = heads(B, H, T, E, 0, dtype), heads(B, KV, T, E, 1, dtype), heads(B, KV, T, E, 2, dtype)
    grad = heads(B, H, T, E, 3, dtype)
    exact = attend(sdpa, *(x.double() for x in (q, k, v)), grad.double())
    flash = attend(sdpa, q, k, v, grad)
    ours = attend(cpu_attention.causal_attention, q, k, v, grad)
    assert ours[0].dtype == dtype and ours[0].shape == (B, H, T, E)
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-23
    for name, got, theirs, want in zip(("out", "dq", "dk", "dv"), ours, flash, exact):
        err, flash_err = ((x.double() - want).abs().max().item() for x in (got, theirs))
        scale = want.abs().max().item()
        assert err <= max(2 * flash_err, rounding * scale, 1e-6), (name, err, flash_err)  # 1e-6: one token's dq is 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotating_inside_the_kernel_is_rope_then_sdpa(dtype):
    """Unrotated q and k with RoPE's tables: the output and the gradients of the unrotated q, k, v are
    those of rotate() then SDPA, in float64, within what flash itself misses there."""
    kernel_or_skip()
    B, H, KV, T, E = 2, 4, 2, 90, 64
    cos, sin = rope_tables(E, T, 10000.0)
    q, k, v = heads(B, H, T, E, 0, dtype), heads(B, KV, T, E, 1, dtype), heads(B, KV, T, E, 2, dtype)
    grad = heads(B, H, T, E, 3, dtype)

    def rotated(attention, table_dtype):
        tables = rope_rotation(cos, sin, table_dtype)
        return lambda q, k, v: attention(rotate(q, *tables), rotate(k, *tables), v)

    exact = attend(rotated(sdpa, torch.float64), *(x.double() for x in (q, k, v)), grad.double())
    flash = attend(rotated(sdpa, dtype), q, k, v, grad)
    ours = attend(
        lambda q, k, v: cpu_attention.causal_attention(q, k, v, rope_rotation(cos, sin, dtype)), q, k, v, grad
    )
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-23
    for name, got, theirs, want in zip(("out", "dq", "dk", "dv"), ours, flash, exact):
        err, flash_err = ((x.double() - want).abs().max().item() for x in (got, theirs))
        assert err <= max(2 * flash_err, rounding * want.abs().max().item()), (name, err, flash_err)


def test_the_output_is_laid_out_as_the_output_projection_reads_it():
    kernel_or_skip()
    q, k, v = heads(2, 4, 64, 32, 0), heads(2, 4, 64, 32, 1), heads(2, 4, 64, 32, 2)
    out = cpu_attention.causal_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bits_do_not_depend_on_the_thread_count(dtype):
    kernel_or_skip()
    q, k, v = heads(2, 4, 200, 64, 0, dtype), heads(2, 2, 200, 64, 1, dtype), heads(2, 2, 200, 64, 2, dtype)
    grad = heads(2, 4, 200, 64, 3, dtype)
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
        assert cpu_attention.applies(q, k, v, None)
        out = cpu_attention.causal_attention(q, k, v)
        expected = sdpa(q, k, v)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max() <= 2**-7 * expected.abs().max()
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "case",
    [
        "float64",
        "head dim 48",
        "window shorter than T",
        "one token",
        "switched off",
        "meta device",
        "narrower value heads (MLA)",
    ],
)
def test_where_it_does_not_apply_sdpa_serves(case, monkeypatch):
    q, window = heads(1, 2, 16, 32, 0), None
    k = v = heads(1, 2, 16, 32, 1)
    if case == "float64":
        q = q.double()
    elif case == "head dim 48":
        q = heads(1, 2, 16, 48, 0)
    elif case == "window shorter than T":
        window = 8
    elif case == "one token":
        q = heads(1, 2, 1, 32, 0)
    elif case == "switched off":
        monkeypatch.setenv("PHALANX_CPU_ATTENTION", "0")
    elif case == "meta device":
        q = q.to("meta")
    else:
        q, k, v = heads(1, 2, 16, 64, 0), heads(1, 2, 16, 64, 1), heads(1, 2, 16, 32, 2)
    assert not cpu_attention.applies(q, k, v, window)


@pytest.mark.parametrize("autocast", [True, False])
def test_a_training_step_takes_it_and_matches_sdpa(autocast, monkeypatch):
    """The model's Causal pass, under bf16 autocast and in float32: the kernel runs once per layer (RoPE
    inside it), and the loss and every gradient are those of rotate() and SDPA within the dtype's
    rounding."""
    kernel_or_skip()
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256, max_seq_len=96)
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 80))

    calls = []
    forward = cpu_attention._CausalAttention.forward
    monkeypatch.setattr(
        cpu_attention._CausalAttention, "forward", lambda *a: calls.append(a[4] is not None) or forward(*a)
    )
    loss, grads = loss_and_grads(model, tokens, autocast)
    assert calls == [True] * args.n_layers  # each layer once, with RoPE's tables
    monkeypatch.setenv("PHALANX_CPU_ATTENTION", "0")
    sdpa_loss, sdpa_grads = loss_and_grads(model, tokens, autocast)
    assert len(calls) == args.n_layers
    tolerance = 2e-2 if autocast else 1e-5
    assert loss.item() == pytest.approx(sdpa_loss.item(), rel=tolerance / 10)
    for name, grad in sdpa_grads.items():
        assert (grads[name] - grad).abs().max() <= tolerance * grad.abs().max(), name


@pytest.mark.parametrize(
    "bad, message",
    [
        ("float64 q", "bf16 or float32"),
        ("bf16 q, float32 k", "q's dtype"),
        ("kv heads not dividing", "mismatched"),
        ("head dim 48", "multiple of 32"),
        ("k shorter than q", "mismatched"),
    ],
)
def test_the_op_refuses_what_it_cannot_compute(bad, message):
    kernel_or_skip()
    q, k = heads(1, 4, 16, 32, 0), heads(1, 4, 16, 32, 1)
    if bad == "float64 q":
        q, k = q.double(), k.double()
    elif bad == "bf16 q, float32 k":
        k = k.float()
    elif bad == "kv heads not dividing":
        k = heads(1, 3, 16, 32, 1)
    elif bad == "head dim 48":
        q, k = heads(1, 4, 16, 48, 0), heads(1, 4, 16, 48, 1)
    else:
        k = heads(1, 4, 8, 32, 1)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.phalanx_attention.causal_forward(q, k, k, 1 / math.sqrt(q.shape[-1]))
