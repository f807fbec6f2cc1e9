"""Fine-tuning examples (data/sft.py) as training rows: packed several to a row, or one to a row.

A row holds seq_len + 1 token slots, as a text window does: inputs are slots 0..seq_len-1 and targets
slots 1..seq_len. Packing lays examples end to end in record order and starts a new row when the next
one does not fit (an example is never split: data/sft.py refused or truncated longer ones). What is
left of a row is padding. Each row also carries every slot's position inside its example, from 0 where
an example (or the padding) starts: models/token_pass.py's Packed restarts RoPE there and keeps
attention inside each example, so a packed row computes what its examples compute one to a row.

Targets are -100 (cross-entropy's ignore_index) wherever the token is not trained: prompts, padding,
and every example's first token (nothing before it in its example predicts it). The loss is averaged
over trained tokens (train/step.py), so packing changes neither the loss nor the gradients.

The loader (data/loader.py's BatchLoader) indexes rows as it indexes text windows, so batches are the
same for any number of data-parallel ranks and resume exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from phalanx.errors import PhalanxError

if TYPE_CHECKING:
    from phalanx.data.sft import SftExamples

IGNORE = -100  # F.cross_entropy's default ignore_index


class ExampleRows:
    """Rows of `seq_len + 1` slots over `examples`: packed, or one example per row."""

    def __init__(self, examples: SftExamples, seq_len: int, pack: bool, name: str = "fine-tuning data"):
        self.examples, self.seq_len = examples, seq_len
        lengths = np.asarray(examples.lengths, dtype=np.int64)
        if len(lengths) == 0:
            raise PhalanxError(f"{name} holds no examples")
        if lengths.max() > seq_len + 1:
            raise PhalanxError(
                f"{name} holds an example of {int(lengths.max())} tokens, more than train.seq_len + 1 = "
                f"{seq_len + 1}: it was prepared for a longer seq_len"
            )
        self._starts = _row_starts(lengths, seq_len + 1) if pack else np.arange(len(lengths) + 1)

    def __len__(self) -> int:
        return len(self._starts) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row i's tokens, trained flags and positions, each seq_len + 1 long."""
        width = self.seq_len + 1
        tokens = np.zeros(width, dtype=np.int64)  # padding: token 0, never trained, attended only by padding
        trained = np.zeros(width, dtype=bool)
        positions = np.empty(width, dtype=np.int64)
        at = 0
        for k in range(self._starts[i], self._starts[i + 1]):
            ids, flags = self.examples.example(int(k))
            n = len(ids)
            tokens[at : at + n], trained[at : at + n], positions[at : at + n] = ids, flags, np.arange(n)
            trained[at] = False  # nothing in its example predicts an example's first token
            at += n
        positions[at:] = np.arange(width - at)
        return tokens, trained, positions

    def micro_batch(self, indices: np.ndarray, pin_memory: bool = False) -> tuple[torch.Tensor, ...]:
        """Rows `indices` as (inputs, targets, positions), each (len(indices), seq_len)."""
        rows = [self.row(int(i)) for i in indices]
        tokens = torch.from_numpy(np.stack([r[0] for r in rows]))
        trained = torch.from_numpy(np.stack([r[1] for r in rows]))
        positions = torch.from_numpy(np.stack([r[2] for r in rows]))
        inputs = tokens[:, :-1].contiguous()
        targets = torch.where(trained[:, 1:], tokens[:, 1:], IGNORE).contiguous()
        positions = positions[:, :-1].contiguous()
        batch = (inputs, targets, positions)
        return tuple(t.pin_memory() for t in batch) if pin_memory else batch


def _row_starts(lengths: np.ndarray, width: int) -> np.ndarray:
    """The first example of every row (and the end), packing in order: a row takes examples while they
    fit in `width` slots."""
    starts, used = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if used + n > width:
            starts.append(k)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)
