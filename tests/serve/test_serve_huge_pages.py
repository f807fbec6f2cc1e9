"""The decode kernel's weights in one block of huge pages (serve/engines/huge_pages.py): copied bit for bit,
laid end to end in the order of the model's layers, in memory Linux is advised to back with 2 MiB pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from phalanx.models.decoder import ModelArgs, Transformer
from phalanx.serve.engines.decode_kernel import decode_kernel_available
from phalanx.serve.engines.huge_pages import HUGE_PAGE, HugePageArena
from phalanx.serve.engines.row_invariant import RowInvariantLinear, make_rows_invariant

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_the_arena_copies_tensors_end_to_end_and_refuses_more_than_it_holds():
    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.randn(64, 64)]
    arena = HugePageArena(HugePageArena.room_for([t.numel() * t.element_size() for t in tensors]))
    placed = [arena.put(t) for t in tensors]
    assert all(torch.equal(p, t) and p.dtype == t.dtype and p.shape == t.shape for p, t in zip(placed, tensors))
    assert placed[0].data_ptr() % HUGE_PAGE == 0
    assert all(p.data_ptr() % 64 == 0 for p in placed)
    assert placed[0].data_ptr() < placed[1].data_ptr() < placed[2].data_ptr()
    with pytest.raises(ValueError, match="no room"):
        arena.put(torch.zeros(1))


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` may take transparent huge pages (its smaps' THPeligible)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(bound, 16) for bound in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="no transparent huge pages here",
)
def test_the_arena_is_memory_linux_may_back_with_huge_pages():
    arena = HugePageArena(3 * HUGE_PAGE)
    placed = arena.put(torch.ones(HUGE_PAGE // 4))
    assert advised_huge(placed.data_ptr())
    assert not advised_huge(torch.ones(HUGE_PAGE).data_ptr()) or "[always]" in THP.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_lays_every_kernel_weight_in_one_arena_in_layer_order(dtype):
    if not decode_kernel_available(dtype):
        pytest.skip(f"no decode kernel for {dtype} here")
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=1152, vocab_size=256, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(args).to(dtype).eval()
    assert make_rows_invariant(model)
    linears = [m for m in model.modules() if isinstance(m, RowInvariantLinear)]
    panels = [p for linear in linears for p in linear._panels]
    assert len(panels) == len(linears) + args.n_layers  # w2's 1152 inputs: two chunks, two panels
    starts = [p.data_ptr() for p in panels]
    assert starts == sorted(starts)
    assert all(a.data_ptr() + a.numel() * a.element_size() <= b.data_ptr() for a, b in zip(panels, panels[1:]))
    span = starts[-1] + panels[-1].numel() * panels[-1].element_size() - starts[0]
    assert span <= sum(p.numel() * p.element_size() + 64 for p in panels)  # end to end, no gaps but alignment
    assert starts[0] % HUGE_PAGE == 0
