"""Small helpers shared by the analyses."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


@contextmanager
def quiet_nan() -> Iterator[None]:
    """Silence numpy's all-NaN warnings: a node absent from an instance is NaN there by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _lerp(a: np.ndarray, b: np.ndarray, g: np.ndarray) -> np.ndarray:
    """numpy's own interpolation between order statistics (exact at both ends)."""
    d = b - a
    return np.where(g >= 0.5, b - d * (1 - g), a + d * g)


def nanquantile_cols(blk: np.ndarray, q: float) -> np.ndarray:
    """np.nanquantile(blk, q, axis=0) (linear method), vectorized over the columns: one sort of the
    block instead of numpy's per-column loop. All-NaN columns give NaN."""
    if blk.ndim != 2 or not blk.shape[0]:
        return np.full(blk.shape[1:], np.nan)
    s = np.sort(blk, axis=0)  # NaN sort last
    n = np.isfinite(blk).sum(axis=0)
    vi = q * (n - 1).astype(np.float64)
    lo = np.floor(vi).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    g = vi - lo
    cols = np.arange(blk.shape[1])
    lo_c, hi_c = np.clip(lo, 0, None), np.clip(hi, 0, None)
    out = _lerp(s[lo_c, cols], s[hi_c, cols], g)
    return np.where(n > 0, out, np.nan)


def nanmedian_rows(m: np.ndarray) -> np.ndarray:
    """np.nanmedian(m, axis=1), vectorized (mean of the two middle values for an even count)."""
    if m.ndim != 2 or not m.shape[1]:
        return np.full(m.shape[0], np.nan)
    s = np.sort(m, axis=1)
    n = np.isfinite(m).sum(axis=1)
    rows = np.arange(m.shape[0])
    lo = np.clip((n - 1) // 2, 0, None)
    hi = np.clip(n // 2, 0, None)
    out = (s[rows, lo] + s[rows, hi]) / 2
    return np.where(n > 0, out, np.nan)
