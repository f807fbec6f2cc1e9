"""The numerics guard: a NaN or Inf loss or gradient norm, or a loss spike, must not reach the weights."""

from __future__ import annotations

import math
import statistics
from collections import deque

MIN_HISTORY = 10  # losses needed before a z-score means anything


class NumericsGuard:
    def __init__(self, zscore: float, window: int):
        self.zscore = zscore
        self.recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float, grad_norm: float) -> str | None:
        """'nan', 'inf' or 'spike' for a step whose update should not be applied, else None."""
        if math.isnan(loss) or math.isnan(grad_norm):
            return "nan"
        if math.isinf(loss) or math.isinf(grad_norm):
            return "inf"
        if len(self.recent) >= MIN_HISTORY:
            mean, std = statistics.fmean(self.recent), statistics.pstdev(self.recent)
            if std > 0 and (loss - mean) / std > self.zscore:  # only upward: a falling loss is no fault
                return "spike"
        return None

    def accept(self, loss: float) -> None:
        self.recent.append(loss)

    def reset(self) -> None:
        self.recent.clear()
