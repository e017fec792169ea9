"""Intervals for benchmark ratios. Pure Python (no torch, no extension), so that bench/compare_builds.py, which
runs the builds it compares in their own processes, can load it by path without loading any build."""

from __future__ import annotations

import math
import random
import statistics


def ratio_interval(
    numerators: list[float], denominators: list[float], confidence: float = 0.95, resamples: int = 4000
) -> tuple[float, float, float]:
    """(median, low, high): the median of the paired ratios numerators[i] / denominators[i] and its bootstrap
    interval (median_interval). A row meets a bar when `high` is under it: a median under the bar on a lucky run
    does not."""
    return median_interval([n / d for n, d in zip(numerators, denominators)], confidence, resamples)


def median_interval(values: list[float], confidence: float = 0.95, resamples: int = 4000) -> tuple[float, float, float]:
    """(median, low, high): the median of one value per run and its bootstrap interval at `confidence` (the runs
    resampled with replacement, the interval the middle `confidence` of the resamples' medians; the same resamples
    every call, so a table is reproducible from its runs)."""
    if len(values) < 2:
        only = values[0] if values else math.nan
        return only, only, only
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[round((1 - tail) * (resamples - 1))]
    return statistics.median(values), low, high
