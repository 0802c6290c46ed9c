"""Selections: which part of a global tensor a rank holds.

For every dimension, the list of half-open index intervals taken, in order; the rank's tensor is their
cartesian product, concatenated. Indices at or past the dimension's size are padding (zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

Interval = tuple[int, int]
Selection = tuple[tuple[Interval, ...], ...]


def full_selection(shape: Sequence[int]) -> Selection:
    return tuple(((0, n),) for n in shape)


def selection_shape(sel: Selection) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in dim) for dim in sel)
