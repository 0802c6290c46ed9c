"""What to say when a tp does not fit a checkpoint: the tp values that do, for this checkpoint's tensors
and rules, and a rule's `pad: true` only where a rules file (or stored manifest) is there to edit.

A kind's own error knows one tensor (`TpMismatchError`: "dim 1 has size 128, not divisible by tp=3");
a tp that fits that tensor may still not fit another (the 4 heads of an attention projection refuse
tp=8, which 128 divides). So the planner asks here, once, which tp from 1 to `MAX_ADVISED` give every
tensor a selection on every rank, with the same loaders as planning (no tensor data is read).
"""

from __future__ import annotations

from collections.abc import Mapping

from reshard.errors import PlanError, TpMismatchError
from reshard.format.checkpoint import GlobalTensor
from reshard.rules.kinds import tensor_selection
from reshard.rules.manifest import Rule

MAX_ADVISED = 64  # tp values tried
MAX_LISTED = 10  # tp values named, the smallest first
EDITABLE_SOURCES = ("rules file", "stored manifest")  # manifests a user wrote, where `pad: true` can be set


def tps_that_plan(tensors: Mapping[str, GlobalTensor], rules: Mapping[str, Rule], *, first: str | None = None,
                  limit: int = MAX_ADVISED) -> list[int]:
    """The tp values up to `limit` at which every tensor's rule gives every rank a selection; `first`, a
    tensor known to fail some tp, is tried first (most tp values fail on it at once)."""
    shapes: dict[tuple[int, str, tuple[int, ...]], str] = {}
    for name, gt in tensors.items():
        shapes.setdefault((id(rules[name]), name[name.rfind("."):] if "." in name else "", gt.shape), name)
    names = list(shapes.values())
    if first in tensors:
        names = [first, *(n for n in names if n != first)]
    return [tp for tp in range(1, limit + 1) if _fits(tensors, rules, names, tp)]


def _fits(tensors: Mapping[str, GlobalTensor], rules: Mapping[str, Rule], names: list[str], tp: int) -> bool:
    try:
        for name in names:
            for rank in range(tp):
                tensor_selection(name, tensors[name].shape, rules[name], rank, tp)
    except PlanError:
        return False
    return True


def advised(error: TpMismatchError, tensors: Mapping[str, GlobalTensor], rules: Mapping[str, Rule], *,
            manifest_source: str) -> PlanError:
    """`error` with its fix replaced by the tp values that plan this checkpoint, and `pad: true` offered
    only where the manifest is a rules file (or a stored manifest) and padding would fit the tensor."""
    good = tps_that_plan(tensors, rules, first=error.fact.split(":", 1)[0])
    listed = ", ".join(map(str, good[:MAX_LISTED])) + (", ..." if len(good) > MAX_LISTED else "")
    fix = f"pick a tp that plans this checkpoint: {listed}" if good else \
        f"no tp from 1 to {MAX_ADVISED} plans this checkpoint with these rules"
    if error.pad and manifest_source.startswith(EDITABLE_SOURCES):
        fix = f"set `pad: true` on the rule in the {manifest_source} or {fix}"
    return PlanError(f"{error.fact}; {fix}{error.where}")


__all__ = ["advised", "tps_that_plan"]
