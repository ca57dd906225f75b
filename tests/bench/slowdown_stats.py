"""The intervals of the job_slowdown figures: bench_slowdown.py's one bench, pool_slowdown.py's
several pooled."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def median_percent_interval(plain: list[float], prof: list[float]) -> list[float]:
    """The 95 % interval of median_percent, a percentile bootstrap over the pairs (each resample
    keeps a run's partner, as the alternation made them): how finely this machine's noise lets the
    median speak; a goal of 1 % inside an interval of ±10 % is neither met nor missed by it."""
    a, b = np.asarray(plain), np.asarray(prof)
    picks = _resamples(len(a))
    return _interval((np.median(b[picks], axis=1) / np.median(a[picks], axis=1) - 1) * 100)


def pair_median_interval(per_pair: list[float]) -> list[float]:
    """The 95 % interval of the median of the pairs' own percentages (a percentile bootstrap, the
    seed fixed): the figure least moved by hours of different speeds, each pair's two
    runs having been interleaved in the same minutes."""
    a = np.asarray(per_pair)
    return _interval(np.median(a[_resamples(len(a))], axis=1))


def _resamples(n: int) -> np.ndarray:
    """BOOTSTRAP_RESAMPLES draws of n pair indices; the seed fixed: the same runs print the same
    interval."""
    return np.random.default_rng(0).integers(0, n, (BOOTSTRAP_RESAMPLES, n))


def _interval(estimates: np.ndarray) -> list[float]:
    """The 2.5th and 97.5th percentiles of the resampled estimates."""
    return [round(float(x), 2) for x in np.percentile(estimates, [2.5, 97.5])]
