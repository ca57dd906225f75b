"""The intervals of the job_slowdown figures: bench_slowdown.py's one bench, pool_slowdown.py's
several pooled."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def median_percent_interval(plain: list[float], prof: list[float]) -> list[float]:
    """The 95 % interval of median_percent, a percentile bootstrap over the pairs (each resample
    keeps a run's partner, as the alternation made them): how finely this machine's noise lets the
    median speak; a goal of 1 % inside an interval of ±10 % is neither met nor missed by it."""
    rng = np.random.default_rng(0)  # fixed: the same runs print the same interval
    a, b = np.asarray(plain), np.asarray(prof)
    picks = rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))
    ratios = (np.median(b[picks], axis=1) / np.median(a[picks], axis=1) - 1) * 100
    return [round(float(x), 2) for x in np.percentile(ratios, [2.5, 97.5])]


def pair_median_interval(per_pair: list[float]) -> list[float]:
    """The 95 % interval of the median of the pairs' own percentages (a percentile bootstrap, the
    seed fixed as above): the figure least moved by hours of different speeds, each pair's two
    runs having been interleaved in the same minutes."""
    rng = np.random.default_rng(0)
    a = np.asarray(per_pair)
    medians = np.median(a[rng.integers(0, len(a), (BOOTSTRAP_RESAMPLES, len(a)))], axis=1)
    return [round(float(x), 2) for x in np.percentile(medians, [2.5, 97.5])]
