"""On-disk tensor names -> the in-memory parameters transformers builds from them on load.

A plain-data mirror of `transformers.core_model_loading.rename_source_key`: every renaming in order,
then at most one converter (`WeightConverter`), with the patterns compiled as transformers compiles
them. A converter that stacks per-expert tensors (`MergeModulelist`) marks the disk tensor as one
slice of the fused parameter's expert axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FOLLOWED_OPS = ("MergeModulelist", "Concatenate")


@dataclass(frozen=True)
class Converted:
    """Where one disk tensor goes: `name` in memory; `per_expert` when it is one slice of axis 0 of it."""

    name: str
    per_expert: bool = False
    other_ops: tuple[str, ...] = ()  # conversion ops besides stacking and concatenating (reshard cannot follow)
    sources: int = 1  # how many disk tensors per expert the converter concatenates
    concat: int | None = None  # along which dim of one expert's block (None: stacked only)


class _Transform:
    """One serialized transform (see `reshard.rules.tp_plans.live.serialize_conversion`)."""

    def __init__(self, item: dict[str, Any]) -> None:
        self.kind = item["type"]
        self.target = item["target"][0] if item["target"] else ""
        self.ops = tuple((op[0], op[1]) for op in item.get("ops", ()))
        self.sources = len(item["source"])
        branches = []
        for i, src in sorted(enumerate(item["source"]), key=lambda x: -len(x[1])):
            pattern = src.replace("*.", r".*\.")
            if re.search(r"[a-zA-Z0-9]$", pattern):
                pattern += r"(?!\w)"
            branches.append(f"(?P<g{i}>{pattern})")
        self.regex = re.compile("|".join(branches)) if branches else None

    def apply(self, key: str) -> str | None:
        if self.regex is None or self.kind not in ("rename", "convert"):
            return None
        m = self.regex.search(key)
        if m is None:
            return None
        replacement = self.target
        if r"\1" in replacement:
            group = next(g for g, v in m.groupdict().items() if v is not None)
            replacement = replacement.replace(r"\1", m.group(self.regex.groupindex[group] + 1) or "")
        return key.replace(m.group(0), replacement, 1)


class Conversion:
    """The conversion mapping of one architecture, applied to disk names."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        transforms = [_Transform(i) for i in items]
        self.renamings = [t for t in transforms if t.kind != "convert"]
        self.converters = [t for t in transforms if t.kind == "convert"]

    def __call__(self, key: str) -> Converted:
        for t in self.renamings:
            key = t.apply(key) or key
        for t in self.converters:
            new = t.apply(key)
            if new is not None:
                other = tuple(op for op, _ in t.ops if op not in FOLLOWED_OPS)
                concat = next((d - 1 for op, d in t.ops if op == "Concatenate" and isinstance(d, int) and d >= 1), None)
                return Converted(new, "MergeModulelist" in (op for op, _ in t.ops), other, t.sources, concat)
        return Converted(key)
