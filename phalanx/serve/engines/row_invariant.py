"""Linear layers whose every output row is the same bits however many rows the batch holds (CPU).

The engine decodes only as many rows as there are requests (torch_engine.py: bucketed widths), so a request's
row passes through matmuls of 1, 2, 4, ... rows in its life. Torch's default fp32 CPU matmul (MKL) is not
row-invariant: measured on this machine (torch 2.13), row 0 of an (M, K) x (K, N) product differs in its
last bits between M = 1 and M = 2..16 for every shape tried, so greedy tokens could change with the
number of neighbours. oneDNN's matmul on a weight packed once (the path torch.compile's CPU backend takes)
gives every row identical bits for any M, fp32 and bf16, as long as the reduction K is at most 1024 (above
that it blocks K differently per M); so K is cut into equal chunks of at most 1024, each a packed
product, summed in a fixed order (element-wise, so row-invariant). At M = 16 it also ran 1.2-1.6x faster
than MKL here, and as fast at M = 1.

The packed copy is taken once, when the engine starts: serving never changes weights. It doubles the
memory of the linear weights (the plain ones stay: other readers of the model use them). Products of up
to 16 rows, decode steps, go through a hand-written kernel instead (decode_kernel.py) for each weight
shape where it is proven to give oneDNN's very bits, since oneDNN reads the weights slowly at those widths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.serve.engines.decode_kernel import (
    BLOCK,
    KERNEL_ROWS,
    decode_kernel_available,
    pack_panels,
    panel_bytes,
    panel_linear,
)
from phalanx.serve.engines.huge_pages import HugePageArena

log = logging.getLogger("phalanx.serve")

MAX_CHUNK = 1024  # the longest reduction oneDNN kept row-invariant (1152 and above were not)
_packed_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # None on a build without oneDNN


def row_invariant_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and _packed_linear is not None
        and torch.backends.mkldnn.is_available()
    )


class RowInvariantLinear(nn.Module):
    """y = x W^T (+ b) with each row of y independent of the other rows of x, bit for bit. Holds the
    original Parameter (the same object: tied weights stay tied, state_dict keys stay the same)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            chunks = -(-self.in_features // MAX_CHUNK)
            size = -(-self.in_features // chunks)
            self._sizes = [p.shape[1] for p in self.weight.detach().split(size, dim=1)]
            # Packed for up to 16 rows; any row count reads the same layout (a hint of 1 gave other bits
            # to rows 2..16 than to a lone row, so that hint is not used).
            self._packed = [
                torch.ops.mkldnn._reorder_linear_weight(p.contiguous(), 16)
                for p in self.weight.detach().split(size, dim=1)
            ]
        self._dtype = self.weight.dtype
        self._panels: list[torch.Tensor] | None = None  # the decode kernel's weights, where it is used
        self._block = BLOCK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not self._dtype or x.device.type != "cpu":  # cast or moved since: the plain path
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if self._panels is not None and rows <= KERNEL_ROWS:  # a decode step: the faster kernel, same bits
            out = self._kernel(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)
        else:
            out = self._onednn(x)
        return out if self.bias is None else out + self.bias

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return self._by_chunk(x, lambda part, i: _packed_linear(part, self._packed[i], None, "none", [], ""))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self._by_chunk(x, lambda part, i: panel_linear(part, self._panels[i], self.out_features, self._block))

    def _by_chunk(self, x: torch.Tensor, product: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        if len(self._sizes) == 1:  # the common case, kept to one call: at one row the overhead shows
            return product(x.contiguous(), 0)
        out = None
        for i, part in enumerate(x.split(self._sizes, dim=-1)):
            y = product(part.contiguous(), i)
            out = y if out is None else out + y
        return out

    def pack_panels(self, block: int = BLOCK, arena: HugePageArena | None = None) -> None:
        """Take the decode kernel's panels of each chunk, into `arena` if given (it must have
        `panel_bytes()` free); a `block` other than oneDNN's is for tests."""
        with torch.no_grad():
            self._panels = [pack_panels(p) for p in self.weight.detach().split(self._sizes[0], dim=1)]
        if arena is not None:
            self._panels = [arena.put(p) for p in self._panels]
        self._block = block

    def panel_bytes(self) -> list[int]:
        """The bytes of each chunk's panels."""
        return [panel_bytes(self.out_features, size, self._dtype) for size in self._sizes]

    def drop_panels(self) -> None:
        self._panels = None


def make_rows_invariant(model: nn.Module) -> bool:
    """Swap every nn.Linear in `model` for a RowInvariantLinear, in place (again on the same model: a
    no-op). False, changing nothing, where oneDNN cannot (not a CPU, or another dtype)."""
    weight = next(model.parameters())
    if not row_invariant_available(weight.device, weight.dtype):
        return False
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    try:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, RowInvariantLinear(child))
                    swapped.append((parent, name, child))
        invariant = all(rows_agree(linear) for linear in _one_per_shape([getattr(p, n) for p, n, _ in swapped]))
    except RuntimeError:  # a shape or build oneDNN refuses
        invariant = False
    if not invariant:  # measured, not promised by oneDNN: on a CPU where it does not hold, the old layers
        for parent, name, child in swapped:
            setattr(parent, name, child)
        return False
    _choose_decode_kernel([m for m in model.modules() if isinstance(m, RowInvariantLinear)], weight.dtype)
    return True


def _choose_decode_kernel(linears: list[RowInvariantLinear], dtype: torch.dtype) -> None:
    """The decode kernel for every layer of each weight shape where it gives oneDNN's bits; oneDNN elsewhere.
    Chosen afresh each time an engine starts on the model (PHALANX_DECODE_KERNEL may have changed since)."""
    for linear in linears:
        linear.drop_panels()
    if not linears or not decode_kernel_available(dtype):
        return
    agreeing: set[torch.Size] = set()
    for linear in _one_per_shape(linears):
        linear.pack_panels()
        if panels_agree(linear):
            agreeing.add(linear.weight.shape)
        else:
            shape = list(linear.weight.shape)
            log.info("decode kernel: oneDNN sums a %s weight otherwise on this CPU; it stays on oneDNN", shape)
        linear.drop_panels()
    kept = [linear for linear in linears if linear.weight.shape in agreeing]
    # One block for all the panels, in the order of the model's modules (about the order a step reads them).
    arena = HugePageArena(HugePageArena.room_for([size for linear in kept for size in linear.panel_bytes()]))
    for linear in kept:
        linear.pack_panels(arena=arena)
    log.info("decode kernel: %d of %d linear layers", len(kept), len(linears))


def _one_per_shape(linears: list[RowInvariantLinear]) -> list[RowInvariantLinear]:
    seen, out = set(), []
    for linear in linears:
        if linear.weight.shape not in seen:
            seen.add(linear.weight.shape)
            out.append(linear)
    return out


def rows_agree(linear: RowInvariantLinear, rows: int = 16) -> bool:
    """Whether this CPU gives each row the same bits at every batch width the engine uses (1, 2, 4 ... 16)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, linear.in_features, generator=generator).to(linear._dtype)
    with torch.no_grad():
        full = linear(x)
        return all(torch.equal(linear(x[:width]), full[:width]) for width in (1, 2, 4, 8))


def panels_agree(linear: RowInvariantLinear, rows: int = 64) -> bool:
    """Whether the decode kernel gives each of `rows` random rows, alone, three at a time and sixteen at a time,
    the bits oneDNN gives it among sixteen (a wrong summation order changes a bf16 output only about once in
    10^4, hence the many rows)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, linear.in_features, generator=generator).to(linear._dtype)
    with torch.no_grad():
        expected = torch.cat([linear._onednn(x[i : i + 16]) for i in range(0, rows, 16)])
        return all(
            torch.equal(torch.cat([linear._kernel(x[i : i + width]) for i in range(0, rows, width)]), expected)
            for width in (1, 3, 16)
        )
