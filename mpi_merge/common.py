"""Small helpers shared by the analyses."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_nan() -> Iterator[None]:
    """Silence numpy's all-NaN warnings: a node absent from an instance is NaN there by design."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
