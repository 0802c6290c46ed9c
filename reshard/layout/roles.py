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

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard.errors import PlanError
from reshard.rules.tp_plans import entry_for
from reshard.rules.tp_plans.convert import Conversion
from reshard.rules.tp_plans.derive import wildcard
from reshard.rules.tp_plans.entry import PlanEntry

ALL, FIRST, LAST, ENDS, LAYER = "all", "first", "last", "ends", "layer"
_STAGES = (ALL, FIRST, LAST, ENDS, LAYER)
_CODES = {s: i for i, s in enumerate(_STAGES)}
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
    """Every tensor's role for one checkpoint, held as columns (one entry per tensor, in `names` order),
    and what makes them (`spec`, for the plan's identity). `roles[name]` is one tensor's `Role`."""

    def __init__(self, names: list[str], columns: dict[str, np.ndarray], spec: dict[str, Any]) -> None:
        self.names, self.spec = names, spec
        self.index = {n: i for i, n in enumerate(names)}
        self.stage, self.layer = columns["stage"], columns["layer"]
        self.experts, self.expert = columns["experts"], columns["expert"]
        self.ep, self.buffer = columns["ep"], columns["buffer"]
        # what a tensor's selection depends on, as bits: per-expert slice, fused experts, split by ep, buffer
        self.kinds = ((self.expert >= 0).astype(np.int8) | ((self.experts > 0) & (self.expert < 0)) << 1
                      | self.ep.astype(np.int8) << 2 | self.buffer.astype(np.int8) << 3)
        self._stages: dict[int, np.ndarray] = {}

    def __getitem__(self, name: str) -> Role:
        i = self.index.get(name)
        if i is None:
            return DENSE
        expert = int(self.expert[i])
        return Role(_STAGES[self.stage[i]], int(self.layer[i]), int(self.experts[i]), expert if expert >= 0 else None,
                    bool(self.ep[i]), bool(self.buffer[i]))

    def kind(self, name: str) -> int:
        i = self.index.get(name)
        return 0 if i is None else int(self.kinds[i])

    @property
    def num_layers(self) -> int:
        return int(self.spec["layers"])

    @property
    def has_experts(self) -> bool:
        return bool((self.experts > 0).any())

    @property
    def has_ep_plan(self) -> bool:
        return bool(self.spec["ep_plan"])

    def ep_expert_counts(self) -> list[int]:
        return sorted({int(n) for n in self.experts[self.ep & (self.experts > 0)]})

    def digest(self) -> str:
        sha = hashlib.sha256(json.dumps(self.spec, separators=(",", ":")).encode())
        sha.update("\0".join(self.names).encode())
        for col in (self.stage, self.layer, self.experts, self.expert, self.ep, self.buffer):
            sha.update(np.ascontiguousarray(col).tobytes())
        return sha.hexdigest()

    def on_stage(self, stage: int, pp: int) -> np.ndarray:
        """Which tensors pipeline stage `stage` of `pp` holds (a mask in `names` order)."""
        if pp == 1:
            return np.ones(len(self.names), dtype=bool)
        of_layer = self._stages.get(pp)
        if of_layer is None:
            if self.num_layers < pp:
                raise PlanError(f"pp={pp} is more pipeline stages than the {self.num_layers} layers of this model")
            starts = np.array([layer_range(s, self.num_layers, pp)[0] for s in range(pp)])
            of_layer = self._stages[pp] = np.searchsorted(starts, self.layer, side="right") - 1
            layered = self.stage == _CODES[LAYER]
            if layered.any() and int(self.layer[layered].max()) >= self.num_layers:
                raise PlanError(f"{self.names[int(np.argmax(layered & (self.layer >= self.num_layers)))]}: layer "
                                f"{int(self.layer[layered].max())} is past the {self.num_layers} layers config.json "
                                "declares (num_hidden_layers); fix config.json")
        first, last = stage == 0, stage == pp - 1
        code = self.stage
        return ((code == _CODES[ALL]) | ((code == _CODES[FIRST]) & first) | ((code == _CODES[LAST]) & last)
                | ((code == _CODES[ENDS]) & (first or last)) | ((code == _CODES[LAYER]) & (of_layer == stage)))

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
        names = list(shapes)
        n = len(names)
        cols = {"stage": np.zeros(n, np.int8), "layer": np.full(n, -1, np.int64), "experts": np.zeros(n, np.int64),
                "expert": np.full(n, -1, np.int64), "ep": np.zeros(n, bool), "buffer": np.zeros(n, bool)}
        templates: dict[str, _Template] = {}
        fused: dict[tuple[Any, ...], list[int]] = {}  # a fused expert parameter -> its per-expert tensors
        for i, name in enumerate(names):
            key = _NUM.sub("\0", name)  # the name's pattern: its numbers left out
            t = templates.get(key)
            if t is None:
                t = templates[key] = _template(name, key, prefix, convert, ep_plan, tied, buffers)
            numbers = [int(g) for g in t.regex.fullmatch(name).groups()]  # type: ignore[union-attr]
            cols["stage"][i], cols["ep"][i], cols["buffer"][i] = _CODES[t.stage], t.ep, t.buffer
            if t.layer_at is not None:
                cols["layer"][i] = numbers[t.layer_at]
            if t.expert_at is not None:
                cols["expert"][i] = numbers.pop(t.expert_at)
                fused.setdefault((key, *numbers), []).append(i)  # the template and every other number
            elif t.ep and shapes[name]:
                cols["experts"][i] = shapes[name][0]  # experts fused on disk: dim 0
        for members in fused.values():
            indices = sorted(int(cols["expert"][i]) for i in members)
            count = indices[-1] + 1
            if indices != list(range(count)):
                raise PlanError(f"{names[members[0]]}: per-expert tensors of this kind have expert numbers "
                                f"{_runs(indices)}, not 0..{count - 1}; the checkpoint is missing experts")
            cols["experts"][members] = count
        declared = entry.config_value(dict(config), "num_hidden_layers") if entry is not None else config.get("num_hidden_layers")
        layers = declared if type(declared) is int and declared > 0 else int(cols["layer"].max(initial=-1)) + 1
        spec = {"prefix": prefix, "layers": layers, "tied": tied, "ep_plan": sorted(ep_plan.items())}
        return cls(names, cols, spec)


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
    regex = re.compile(r"(\d+)".join(map(re.escape, key.split("\0"))))
    return _Template(regex, stage, layer_at, expert_at, ep, generic in buffers or local in buffers)


def _runs(indices: Iterable[int]) -> str:
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] + 1 == i:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out[:8])
