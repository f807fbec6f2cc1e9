"""The numerics guard: a NaN or Inf loss or gradient norm, or a loss spike, must not reach the weights."""

from __future__ import annotations

import math
from collections import deque

MIN_HISTORY = 10  # losses needed before a z-score means anything


class NumericsGuard:
    """Checks each step's loss against the mean and spread of the last `window` accepted losses.

    The sums are kept as the window slides, so a check costs a few float operations, not a pass over
    the window (this runs every step).
    """

    def __init__(self, zscore: float, window: int):
        self.zscore = zscore
        self.recent: deque[float] = deque(maxlen=window)
        self._sum = self._sum_sq = 0.0

    def check(self, loss: float, grad_norm: float) -> str | None:
        """'nan', 'inf' or 'spike' for a step whose update should not be applied, else None."""
        if math.isnan(loss) or math.isnan(grad_norm):
            return "nan"
        if math.isinf(loss) or math.isinf(grad_norm):
            return "inf"
        n = len(self.recent)
        if n >= MIN_HISTORY:
            mean = self._sum / n
            std = math.sqrt(max(0.0, self._sum_sq / n - mean * mean))
            if std > 0 and (loss - mean) / std > self.zscore:  # only upward: a falling loss is no fault
                return "spike"
        return None

    def accept(self, loss: float) -> None:
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0]
            self._sum -= old
            self._sum_sq -= old * old
        self.recent.append(loss)
        self._sum += loss
        self._sum_sq += loss * loss

    def reset(self, history: list[float] = ()) -> None:
        """Start again from `history` (the losses a checkpoint saved), so a resume judges as before."""
        self.recent.clear()
        self._sum = self._sum_sq = 0.0
        for loss in history:
            self.accept(loss)
