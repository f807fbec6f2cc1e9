"""The ETTR model behind BENCHMARKS.md's job-size table: its limits and its optimum."""

from __future__ import annotations

import pytest

from phalanx.safe.ettr_model import (
    RecoveryCosts,
    best_interval,
    interruptions_per_second,
    projected_ettr,
)

COSTS = RecoveryCosts(detection=0.2, restart=10.0, load=1.0, save_stall=3.0)


def test_llama3_reference_rate_is_one_interruption_per_about_three_hours():
    hours = 1 / interruptions_per_second(16_384) / 3600
    assert 3.0 < hours < 3.2
    assert interruptions_per_second(32_768) == pytest.approx(2 * interruptions_per_second(16_384))


def test_a_small_job_loses_only_its_checkpoint_stall():
    assert projected_ettr(COSTS, 600.0, gpus=1) == pytest.approx(600 / 603, rel=1e-4)


def test_ettr_falls_with_job_size_and_reaches_zero():
    sizes = [8, 512, 16_384, 131_072]
    values = [projected_ettr(COSTS, 1800.0, gpus) for gpus in sizes]
    assert values == sorted(values, reverse=True) and values[0] > values[-1]
    assert projected_ettr(COSTS, 1800.0, gpus=10_000_000) == 0.0


def test_the_young_daly_interval_beats_its_neighbours():
    gpus = 16_384
    best = best_interval(COSTS, gpus)
    at_best = projected_ettr(COSTS, best, gpus)
    assert at_best > projected_ettr(COSTS, best / 2, gpus)
    assert at_best > projected_ettr(COSTS, best * 2, gpus)


def test_nonsense_is_refused():
    with pytest.raises(ValueError):
        projected_ettr(COSTS, 0.0, gpus=8)
    with pytest.raises(ValueError):
        interruptions_per_second(0)
