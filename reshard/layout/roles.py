"""What each checkpoint tensor is to the parallel dimensions beyond TP: its pipeline stage, its expert.

transformers decides both from the in-memory parameter a disk tensor becomes (its checkpoint
conversion mapping: per-expert disk tensors are stacked into fused expert parameters):

- pipeline stage (`transformers.distributed.pipeline_parallel`): `PREFIX.embed_tokens` on the first
  stage (and on the last when embeddings are tied), `PREFIX.norm` and `lm_head` on the last,
  `PREFIX.layers.i` on the stage whose `layer_range_for_rank` holds i, everything else on every stage;
- experts: a parameter the architecture's `base_model_ep_plan` splits (`grouped_gemm`) is cut along
  its expert axis by expert parallelism; a per-expert disk tensor is one index of that axis. FSDP
  shards every parameter along dim 0, which for a fused expert parameter is the expert axis too.

`Roles.derive` reads all of this once per checkpoint; the per-name work is a regex match against a
template computed once per name pattern (names that differ only in their numbers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from reshard.errors import PlanError
from reshard.rules.tp_plans import entry_for
from reshard.rules.tp_plans.convert import Conversion
from reshard.rules.tp_plans.derive import wildcard
from reshard.rules.tp_plans.entry import PlanEntry

ALL, FIRST, LAST, ENDS, LAYER = "all", "first", "last", "ends", "layer"
EP_STYLES = frozenset({"grouped_gemm"})  # ep plan styles that cut a parameter along its expert axis
_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")
_SENTINEL = 987650


@dataclass(frozen=True)
class Role:
    """One tensor's role: `stage` (ALL, FIRST, LAST, ENDS or LAYER with `layer`), and for a tensor of a
    fused expert parameter the size of its expert axis (`experts`), the tensor's own index on it when
    it is one per-expert slice (`expert`), and whether expert parallelism splits it (`ep`); `buffer`
    for a persistent buffer (not a parameter: FSDP leaves it whole)."""

    stage: str = ALL
    layer: int = -1
    experts: int = 0
    expert: int | None = None
    ep: bool = False
    buffer: bool = False

    @property
    def kind(self) -> tuple[bool, bool, bool, bool]:
        """What the selection depends on: (per-expert slice, fused experts on disk, split by ep, buffer)."""
        return self.expert is not None, self.experts > 0 and self.expert is None, self.ep, self.buffer


DENSE = Role()


@dataclass
class _Template:
    """How the names of one number pattern convert: the role with its numbers to fill in."""

    regex: re.Pattern[str]
    stage: str
    layer_at: int | None  # which number of the disk name is the layer index (LAYER)
    expert_at: int | None  # which number is the expert index (a per-expert tensor)
    ep: bool
    buffer: bool


class Roles:
    """Every tensor's `Role` for one checkpoint, and what makes them (for the plan's identity)."""

    def __init__(self, roles: dict[str, Role], spec: dict[str, Any]) -> None:
        self.roles, self.spec = roles, spec

    def __getitem__(self, name: str) -> Role:
        return self.roles.get(name, DENSE)

    @property
    def num_layers(self) -> int:
        return int(self.spec["layers"])

    @property
    def has_experts(self) -> bool:
        return any(r.experts for r in self.roles.values())

    @property
    def has_ep_plan(self) -> bool:
        return bool(self.spec["ep_plan"])

    def digest(self) -> str:
        blob = json.dumps([self.spec, sorted((n, *vars(r).values()) for n, r in self.roles.items())],
                          separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def derive(cls, entry: PlanEntry | None, config: Mapping[str, Any] | None,
               shapes: Mapping[str, tuple[int, ...]]) -> Roles:
        """The roles of the tensors `shapes` names (disk names -> shapes) for the architecture `entry`
        (None: transformers' default names, `model.layers.i`, no expert plan) and `config`."""
        prefix = entry.prefix if entry is not None else "model"
        convert = Conversion(entry.conversion if entry is not None else [])
        ep_plan = dict(entry.ep_plan) if entry is not None else {}
        config = config or {}
        tied = bool(entry.config_value(dict(config), "tie_word_embeddings") if entry is not None
                    else config.get("tie_word_embeddings", False))
        buffers = frozenset(entry.buffers) if entry is not None else frozenset()
        templates: dict[str, _Template] = {}
        found: dict[str, tuple[Role, tuple[int, ...]]] = {}
        for name in shapes:
            key = _NUM.sub("N", name)
            t = templates.get(key)
            if t is None:
                t = templates[key] = _template(name, key, prefix, convert, ep_plan, tied, buffers)
            found[name] = _fill(t, name)
        layers = _num_layers(entry, config, found)
        roles = _finish(found, shapes)
        spec = {"prefix": prefix, "layers": layers, "tied": tied, "ep_plan": sorted(ep_plan.items())}
        return cls(roles, spec)

    def stages(self, name: str, pp: int) -> range:
        """The pipeline stages (of `pp`) holding tensor `name`."""
        role = self[name]
        if role.stage == ALL or pp == 1:
            return range(pp)
        if role.stage == FIRST:
            return range(1)
        if role.stage == LAST:
            return range(pp - 1, pp)
        if role.stage == ENDS:
            return range(pp) if pp <= 2 else range(0, pp, pp - 1)
        return range(stage_of_layer(role.layer, self.num_layers, pp), stage_of_layer(role.layer, self.num_layers, pp) + 1)


def source_roles(config: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> Roles:
    """The roles of a checkpoint's tensors (disk names -> shapes), for the architecture its config.json
    names (its TP plan entry: prefix, conversion mapping, expert-parallel plan); transformers' default
    names when there is no config.json or its model_type has no entry."""
    model_type = (config or {}).get("model_type")
    entry = entry_for(model_type)[0] if isinstance(model_type, str) else None
    return Roles.derive(entry, config, shapes)


def layer_range(stage: int, num_layers: int, pp: int) -> tuple[int, int]:
    """transformers' `PipelineStage.layer_range_for_rank`: the remainder goes to the first stages."""
    per, rest = divmod(num_layers, pp)
    start = stage * per + min(stage, rest)
    return start, start + per + (stage < rest)


def stage_of_layer(layer: int, num_layers: int, pp: int) -> int:
    for s in range(pp):
        a, b = layer_range(s, num_layers, pp)
        if a <= layer < b:
            return s
    raise PlanError(f"layer {layer} is past the {num_layers} layers config.json declares (num_hidden_layers); "
                    "fix config.json")


def _template(name: str, key: str, prefix: str, convert: Conversion, ep_plan: dict[str, str], tied: bool,
              buffers: frozenset[str]) -> _Template:
    numbers = [int(m) for m in _NUM.findall(name)]
    marked = _NUM.sub(lambda m, it=iter(range(len(numbers))): str(_SENTINEL + next(it)), name)
    conv = convert(marked)
    found = {int(m) - _SENTINEL: j for j, m in enumerate(_NUM.findall(conv.name)) if int(m) >= _SENTINEL}
    dropped = [i for i in range(len(numbers)) if i not in found]
    expert_at = dropped[-1] if conv.per_expert and dropped else None
    pre = f"{prefix}." if prefix else ""
    stage, layer_at = ALL, None
    if conv.name.startswith(f"{pre}embed_tokens."):
        stage = ENDS if tied else FIRST
    elif conv.name.startswith((f"{pre}norm.", "lm_head.")):
        stage = LAST
    elif conv.name.startswith(f"{pre}layers."):
        m = re.match(rf"{re.escape(pre)}layers\.(\d+)\.", conv.name)
        if m is not None and int(m.group(1)) >= _SENTINEL:
            stage, layer_at = LAYER, int(m.group(1)) - _SENTINEL
    generic = wildcard(_NUM.sub("0", conv.name))
    local = generic[len(pre):] if generic.startswith(pre) else generic
    ep = ep_plan.get(local) in EP_STYLES or ep_plan.get(generic) in EP_STYLES
    regex = re.compile(re.escape(key).replace("N", r"(\d+)"))
    return _Template(regex, stage, layer_at, expert_at, ep, generic in buffers or local in buffers)


def _fill(t: _Template, name: str) -> tuple[Role, tuple[int, ...]]:
    m = t.regex.fullmatch(name)
    numbers = tuple(int(g) for g in m.groups()) if m is not None else ()
    layer = numbers[t.layer_at] if t.layer_at is not None else -1
    if t.expert_at is None:
        return Role(t.stage, layer, 0, None, t.ep, t.buffer), ()
    # the fused parameter it is a slice of: the template and every number but the expert's
    fused = (id(t), *numbers[: t.expert_at], *numbers[t.expert_at + 1 :])
    return Role(t.stage, layer, 0, numbers[t.expert_at], t.ep, t.buffer), fused


def _finish(found: dict[str, tuple[Role, tuple[int, ...]]], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Role]:
    """Roles with their expert-axis sizes: a fused parameter's per-expert slices counted (their indices
    must be 0..E-1), a fused expert tensor on disk sized by its dim 0."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, (role, fused) in found.items():
        if role.expert is not None:
            groups.setdefault(fused, []).append(name)
    out: dict[str, Role] = {}
    for names in groups.values():
        indices = sorted(found[n][0].expert for n in names)  # type: ignore[type-var]
        count = indices[-1] + 1
        if indices != list(range(count)):
            raise PlanError(f"{names[0]}: per-expert tensors of this kind have expert numbers {_runs(indices)}, "
                            f"not 0..{count - 1}; the checkpoint is missing experts")
        for n in names:
            out[n] = dataclasses.replace(found[n][0], experts=count)
    for name, (role, _) in found.items():
        if name in out:
            continue
        if role.ep and shapes[name]:
            out[name] = dataclasses.replace(role, experts=shapes[name][0])
        elif role != DENSE:
            out[name] = role
    return out


def _num_layers(entry: PlanEntry | None, config: Mapping[str, Any], found: dict[str, tuple[Role, Any]]) -> int:
    declared = entry.config_value(dict(config), "num_hidden_layers") if entry is not None else config.get("num_hidden_layers")
    seen = max((r.layer + 1 for r, _ in found.values() if r.stage == LAYER), default=0)
    return declared if type(declared) is int and declared > 0 else seen


def _runs(indices: Iterable[int]) -> str:
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] + 1 == i:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out[:8])
