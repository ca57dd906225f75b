"""The profiling modes a job asks for with --profile-gpu, and their parser. The standard library
only: the TaskProlog parses them for every task (fastpath_env.py says why that matters)."""

from __future__ import annotations

VALID_MODES = ("metrics", "stacks", "collectives", "kernels")
DEFAULT_MODES = ("metrics", "stacks", "collectives")


def parse_modes(value: str | None) -> tuple[str, ...]:
    """The SPANK option's value -> canonical modes. Empty, None or Slurm's "(null)" (the option
    given without a value) mean the default set."""
    if value is None or value.strip() in ("", "(null)"):
        return DEFAULT_MODES
    items = value.split(",")
    bad = [m for m in items if m not in VALID_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad!r}; valid modes: {', '.join(VALID_MODES)}")
    return tuple(m for m in VALID_MODES if m in items)
