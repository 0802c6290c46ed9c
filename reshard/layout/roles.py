"""What each checkpoint tensor is to the parallel dimensions beyond TP: its pipeline stage, its expert.

transformers decides both from the in-memory parameter a disk tensor becomes (its checkpoint
conversion mapping: per-expert disk tensors are stacked into fused expert parameters):

- pipeline stage (`transformers.distributed.pipeline_parallel`): the architecture's pipeline plan
  (`base_model_pp_plan`'s modules in forward order; transformers' own `embed_tokens`, `layers`, `norm`
  where it declares none) names the layer stack, the module whose names carry a layer index
  (`PREFIX.layers.i`, GPT-J's `PREFIX.h.i`): layer i on the stage whose `layer_range_for_rank` holds it,
  the modules before the stack (embeddings) on the first stage (and the last when embeddings are
  tied), those after it (the final norm) and `lm_head` on the last, everything else on every stage;
- experts: a parameter the architecture's `base_model_ep_plan` splits (`grouped_gemm`) is cut along
  its expert axis by expert parallelism; a per-expert disk tensor is one index of that axis. FSDP
  shards every parameter along dim 0, which for a fused expert parameter is the expert axis too.

`Roles.derive` reads all of this once per checkpoint; the per-name work is one regex substitution (the
name's pattern: names that differ only in their numbers share a template, computed once), the numbers
of the names of a pattern are read as one array.
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
from reshard.rules.quant.scheme import logical_name
from reshard.rules.tp_plans import entry_for
from reshard.rules.tp_plans.convert import Conversion
from reshard.rules.tp_plans.derive import wildcard
from reshard.rules.tp_plans.entry import PlanEntry

ALL, FIRST, LAST, ENDS, LAYER = "all", "first", "last", "ends", "layer"
_STAGES = (ALL, FIRST, LAST, ENDS, LAYER)
_CODES = {s: i for i, s in enumerate(_STAGES)}
EP_STYLES = frozenset({"grouped_gemm"})  # ep plan styles that cut a parameter along its expert axis
_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")
# the same numbers in names joined by newlines (without the lookbehind: a third of the time)
_NUM_SUB, _NUM_FIND = re.compile(r"\.\d+(?=\.|$)", re.MULTILINE), re.compile(r"\.(\d+)(?=\.|$)", re.MULTILINE)
# transformers' own stages when an architecture declares no pipeline plan (`apply_pipeline_parallelism`)
DEFAULT_PP_PLAN = ("embed_tokens", "layers", "norm")
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
    """How the names of one number pattern convert: which module of the pipeline plan they belong to and
    which of their numbers are the layer and the expert index."""

    pp_at: int | None  # the module of the pipeline plan the in-memory name is under
    head: bool  # `lm_head.`: on the last stage
    layer_at: int | None  # which number of the disk name is the layer index (LAYER)
    expert_at: int | None  # which number is the expert index (a per-expert tensor)
    ep: bool
    buffer: bool

    def stage(self, stack: list[int], tied: bool) -> str:
        """The stage of these names, given which modules of the pipeline plan are the layer stack: the
        modules before it on the first stage (and the last when embeddings are tied), those after it and
        `lm_head` on the last, its layers by index, anything else on every stage."""
        if self.head:
            return LAST
        if self.pp_at is None or not stack:
            return ALL
        if self.pp_at < stack[0]:
            return ENDS if tied else FIRST
        if self.pp_at > stack[-1]:
            return LAST
        return LAYER if self.layer_at is not None else ALL


class Roles:
    """Every tensor's role for one checkpoint, held as columns (one entry per tensor, in `names` order),
    and what makes them (`spec`, for the plan's identity). `roles[name]` is one tensor's `Role`."""

    def __init__(self, names: list[str], columns: dict[str, np.ndarray], spec: dict[str, Any]) -> None:
        self.names, self.spec = names, spec
        self.index = dict(zip(names, range(len(names))))
        self.stage, self.layer = columns["stage"], columns["layer"]
        self.experts, self.expert = columns["experts"], columns["expert"]
        self.ep, self.buffer = columns["ep"], columns["buffer"]
        # what a tensor's selection depends on, as bits: per-expert slice, fused experts, split by ep, buffer
        self.kinds = ((self.expert >= 0).astype(np.int8) | ((self.experts > 0) & (self.expert < 0)) << 1
                      | self.ep.astype(np.int8) << 2 | self.buffer.astype(np.int8) << 3)
        self._stages: dict[int, np.ndarray] = {}
        self._expert_kinds: list[tuple[int, bool, np.ndarray]] | None = None

    def __getitem__(self, name: str) -> Role:
        i = self.index.get(name)
        if i is None:
            return DENSE
        expert = int(self.expert[i])
        return Role(_STAGES[self.stage[i]], int(self.layer[i]), int(self.experts[i]), expert if expert >= 0 else None,
                    bool(self.ep[i]), bool(self.buffer[i]))

    @property
    def num_layers(self) -> int:
        return int(self.spec["layers"])

    @property
    def has_ep_plan(self) -> bool:
        return bool(self.spec["ep_plan"])

    @property
    def stack(self) -> list[str]:
        """The modules of the pipeline plan that hold the decoder layers (empty: none was found)."""
        return list(self.spec["stack"])

    def expert_kinds(self) -> list[tuple[int, bool, np.ndarray]]:
        """(experts, split by ep, mask) for each kind of per-expert disk tensor: which of them a rank holds
        is decided by one expert range per kind."""
        if self._expert_kinds is None:
            per = self.expert >= 0
            code = self.experts * 2 + self.ep
            self._expert_kinds = [(int(c) // 2, bool(c % 2), per & (code == c)) for c in np.unique(code[per])]
        return self._expert_kinds

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
        arch = _Arch.of(entry, dict(config or {}))
        names = list(shapes)
        n = len(names)
        cols = {"stage": np.zeros(n, np.int8), "layer": np.full(n, -1, np.int64), "experts": np.zeros(n, np.int64),
                "expert": np.full(n, -1, np.int64), "ep": np.zeros(n, bool), "buffer": np.zeros(n, bool)}
        by_key: dict[str, list[int]] = {}  # a name's pattern (its numbers left out) -> the names of it
        for i, key in enumerate(_patterns(names)):
            by_key.setdefault(key, []).append(i)
        templates = {key: _template(names[idx[0]], arch) for key, idx in by_key.items()}
        stack = sorted({t.pp_at for t in templates.values() if t.layer_at is not None})
        for key, idx in by_key.items():
            t = templates[key]
            cols["stage"][idx], cols["ep"][idx], cols["buffer"][idx] = _CODES[t.stage(stack, arch.tied)], t.ep, t.buffer
            if t.ep and t.expert_at is None:  # experts fused on disk: dim 0
                cols["experts"][idx] = [shapes[names[i]][0] if shapes[names[i]] else 0 for i in idx]
            if t.layer_at is None and t.expert_at is None:
                continue
            numbers = _numbers([names[i] for i in idx])
            if t.layer_at is not None:
                cols["layer"][idx] = numbers[:, t.layer_at]
            if t.expert_at is not None:
                _per_expert(names, idx, numbers, t.expert_at, cols)
        layers = arch.layers if arch.layers is not None else int(cols["layer"].max(initial=-1)) + 1
        spec = {"prefix": arch.prefix, "layers": layers, "tied": arch.tied, "ep_plan": sorted(arch.ep_plan.items()),
                "model_type": arch.model_type, "pp_plan": list(arch.modules), "stack": [arch.modules[i] for i in stack]}
        return cls(names, cols, spec)


def source_roles(config: Mapping[str, Any] | None, shapes: Mapping[str, tuple[int, ...]]) -> Roles:
    """The roles of a checkpoint's tensors (disk names -> shapes), for the architecture its config.json
    names (its TP plan entry: prefix, conversion mapping, pipeline and expert-parallel plans); transformers'
    default names when there is no config.json or its model_type has no entry."""
    model_type = (config or {}).get("model_type")
    entry = entry_for(model_type)[0] if isinstance(model_type, str) else None
    return Roles.derive(entry, config, shapes)


def layer_range(stage: int, num_layers: int, pp: int) -> tuple[int, int]:
    """transformers' `PipelineStage.layer_range_for_rank`: the remainder goes to the first stages."""
    per, rest = divmod(num_layers, pp)
    start = stage * per + min(stage, rest)
    return start, start + per + (stage < rest)


@dataclass(frozen=True)
class _Arch:
    """What the roles of one architecture's tensors depend on, read once from its plan entry and config."""

    model_type: str
    prefix: str
    convert: Conversion
    ep_plan: dict[str, str]
    tied: bool
    buffers: frozenset[str]
    modules: tuple[str, ...]  # the pipeline plan's modules, in forward order
    layers: int | None  # num_hidden_layers, when config.json or the class declares it

    @classmethod
    def of(cls, entry: PlanEntry | None, config: dict[str, Any]) -> _Arch:
        tied = _config_field(entry, config, "tie_word_embeddings", bool, "true or false")
        layers = _config_field(entry, config, "num_hidden_layers", int, "a positive integer")
        modules = tuple(entry.pp_plan) if entry is not None and entry.pp_plan else DEFAULT_PP_PLAN
        return cls(entry.model_type if entry is not None else str(config.get("model_type", "")),
                   entry.prefix if entry is not None else "model", Conversion(entry.conversion if entry else []),
                   dict(entry.ep_plan) if entry is not None else {}, bool(tied),
                   frozenset(entry.buffers) if entry is not None else frozenset(), modules, layers)


def _config_field(entry: PlanEntry | None, config: dict[str, Any], key: str, kind: type, valid: str) -> Any:
    """`key` of config.json (through the class's attribute_map, else its default), checked to be of `kind`
    (an int above 0, a real bool: `bool("false")` is True); None where neither says."""
    names = [key, *([entry.attribute_map[key]] if entry is not None and key in entry.attribute_map else [])]
    field_name = next((k for k in names if config.get(k) is not None), None)
    if field_name is None:
        return entry.defaults.get(key) if entry is not None else None
    value = config[field_name]
    if type(value) is not kind or (kind is int and value < 1):
        raise PlanError(f"config.json: {field_name}={value!r} must be {valid}; fix config.json")
    return value


def _patterns(names: list[str]) -> list[str]:
    """Each name's pattern (its numbers left out), in one pass over the names joined by newlines."""
    joined = "\n".join(names)
    if joined.count("\n") != max(len(names) - 1, 0):  # a name with a newline in it
        return [_NUM.sub("\0", n) for n in names]
    return _NUM_SUB.sub(".\0", joined).split("\n") if names else []


def _numbers(names: list[str]) -> np.ndarray:
    """The numbers of names of one pattern (as many in each), one row per name."""
    joined = "\n".join(names)
    if joined.count("\n") != len(names) - 1:
        found = [m for n in names for m in _NUM.findall(n)]
    else:
        found = _NUM_FIND.findall(joined)
    return np.array(found, dtype=np.int64).reshape(len(names), -1)


def _template(name: str, arch: _Arch) -> _Template:
    numbers = [int(m) for m in _NUM.findall(name)]
    marked = _NUM.sub(lambda m, it=iter(range(len(numbers))): str(_SENTINEL + next(it)), name)
    conv = arch.convert(marked)
    logical = logical_name(marked)
    if logical is not None and not conv.per_expert:
        # a tensor of a per-expert packed quantized module (GPTQ's `experts.3.gate_proj.qweight`) is
        # converted as its logical weight (`experts.3.gate_proj.weight`), which the conversion mapping names
        as_logical = arch.convert(logical)
        conv = as_logical if as_logical.per_expert else conv
    found = {int(m) - _SENTINEL: j for j, m in enumerate(_NUM.findall(conv.name)) if int(m) >= _SENTINEL}
    dropped = [i for i in range(len(numbers)) if i not in found]
    expert_at = dropped[-1] if conv.per_expert and dropped else None
    pre = f"{arch.prefix}." if arch.prefix else ""
    pp_at, layer_at = None, None
    for k, module in enumerate(arch.modules):
        if conv.name.startswith(f"{pre}{module}."):
            pp_at = k
            m = re.match(r"(\d+)\.", conv.name[len(pre) + len(module) + 1:])
            if m is not None and int(m.group(1)) >= _SENTINEL:
                layer_at = int(m.group(1)) - _SENTINEL
            break
    generic = wildcard(_NUM.sub("0", conv.name))
    local = generic[len(pre):] if generic.startswith(pre) else generic
    ep = any(arch.ep_plan.get(k) in EP_STYLES for k in _ep_keys(generic, pre))
    return _Template(pp_at, conv.name.startswith("lm_head."), layer_at, expert_at, ep,
                     generic in arch.buffers or local in arch.buffers)


def _ep_keys(generic: str, pre: str) -> list[str]:
    """The names the expert-parallel plan may list a parameter under: with and without the model prefix,
    and for a tensor of a packed quantized module its logical weight's (`experts.gate_up_proj` for
    MXFP4's `experts.gate_up_proj_blocks`), which expert parallelism cuts the same way."""
    names = [generic]
    logical = logical_name(generic)
    if logical is not None and logical != generic:
        names.append(logical)
    return [k for n in names for k in ((n[len(pre):], n) if pre and n.startswith(pre) else (n,))]


def _per_expert(names: list[str], idx: list[int], numbers: np.ndarray, expert_at: int,
                cols: dict[str, np.ndarray]) -> None:
    """The expert index and count of per-expert disk tensors of one pattern (`idx`, their `numbers`): the
    tensors whose other numbers (the layer) agree make one fused parameter, of experts 0..count-1."""
    expert = numbers[:, expert_at]
    others = np.delete(numbers, expert_at, axis=1)
    group = np.unique(others, axis=0, return_inverse=True)[1].reshape(-1) if others.shape[1] else np.zeros(len(idx), np.int64)
    count = np.full(int(group.max(initial=-1)) + 1, -1, np.int64)
    np.maximum.at(count, group, expert)
    count += 1
    bad = np.flatnonzero(np.bincount(group, minlength=len(count)) != count)
    if len(bad):
        first = int(np.flatnonzero(group == bad[0])[0])
        indices = sorted(int(e) for e in expert[group == bad[0]])
        raise PlanError(f"{names[idx[first]]}: per-expert tensors of this kind have expert numbers "
                        f"{_runs(indices)}, not 0..{indices[-1]}; the checkpoint is missing experts")
    cols["expert"][idx] = expert
    cols["experts"][idx] = count[group]


def _runs(indices: Iterable[int]) -> str:
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] + 1 == i:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out[:8])
