"""A checkpoint's quantization scheme, read from config.json's `quantization_config`.

A scheme says how coarse a weight's scale is along each dim (`block`: an int is a block of that many
indices, None one scale for the whole dim) and which companion tensors a quantized weight `X.weight`
has (its `QuantScheme`, the packed format: FP8 for every method here). Each `quant_method` is one
decorated function `(quantization_config) -> Scheme`:

    @register_quant_method("fp8")                 # DeepSeek-V3, Qwen3-*-FP8, Kimi-K2
    def _fp8(qc): return Scheme(block=tuple(qc["weight_block_size"]), ...)

A method that is not registered (bitsandbytes, ...) is an error naming the known ones, never a silent
split of packed data.

A packed format (`QuantScheme`) describes each tensor of a quantized module as a `Part`: its suffix
(replacing the module's stem) and, per stored dim, an `Axis` saying which dim of the module's logical
(dequantized) weight it indexes and in what unit (2 FP4 values per byte, a group of 16, a block of 32,
a stored dim that is not a logical one, one entry for the whole dim). `reshard.rules.quant.parts`
turns that into loaders: every part of a module is split where the module's logical weight is split
by its base kind, on the edges of every part's units.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.errors import ManifestError
from reshard.registry import registrar

Block = tuple[int | None, ...]
Unit = int | str | None


@dataclass(frozen=True)
class Axis:
    """One stored dim of a part, against the module's logical (dequantized) weight.

    `dim`: the logical dim it indexes, counted from the end (-1 the input dim K, -2 the output dim N,
    -3 the experts of a fused `[E, N, K]`); None for a stored dim that is no logical one (the 16 bytes
    of an MXFP4 block): always taken whole. `unit`: logical indices per stored index (2 for FP4 values
    packed two per byte along K, 16 for a group of 16, 8 for int4 nibbles in an int32); a str names
    the rule option holding it (`"group_size"`); None for one entry covering the whole dim (a
    per-channel scale's `[N, 1]`): taken whole. `what` names one stored index in errors ("byte of 2
    FP4 values"); empty: "unit of N"."""

    dim: int | None
    unit: Unit = 1
    what: str = ""


@dataclass(frozen=True)
class Part:
    """One tensor of a quantized module: `stem + suffix` (`X.weight_scale`, `X_blocks`, `X.qzeros`).

    `axes` describe the stored dims, right-aligned: a stored tensor with more dims than `axes` has
    leading dims indexing the logical dims before the first axis' (a fused experts' `[E, ...]`), one
    stored index per logical index. `axes=None`: every rank gets the whole tensor (a global or input
    scale, scalars of each fused sub-matrix). A part whose stored shape is all ones is a scalar and
    replicated too, unless it is the scheme's weight."""

    suffix: str
    axes: tuple[Axis, ...] | None


@dataclass(frozen=True)
class QuantScheme:
    """A packed weight format as a value: the kinds it adds (each base kind's quantized twin, named
    `base + suffix`), the companion tensors a quantized weight `X.weight` has (by the suffix replacing
    `.weight`) and the dtypes its weights are stored in. Code asks the scheme, never a literal suffix;
    a second packed format is one more `register_scheme(QuantScheme(...))`.

    A packed format also says (the defaults are FP8's) what its weight tensor is called
    (`weight_suffix`: `.weight`, `_blocks`, `.qweight`, `.weight_packed`), what the module's logical
    weight, the name rules are written for, is called (`logical_suffix`: `.weight`, or `""` when the
    stem is the parameter itself, gpt-oss' `experts.gate_up_proj`), and how each of its tensors is laid
    out (`parts`, with the weight among them; `reshard.rules.quant.parts` registers their kinds). A
    module is quantized when its weight has one of `scale_suffixes` beside it."""

    name: str
    suffix: str  # of its kinds: `column` -> `column_fp8`
    bases: tuple[str, ...]  # the base kinds its own module registers twins of
    scale_suffixes: tuple[str, ...]  # split with the weight, in block units
    replicated_suffixes: tuple[str, ...]  # one activation scale: every rank gets it
    torch_dtypes: tuple[str, ...]  # names in `torch` of the dtypes its weights are stored in
    weight_suffix: str = ".weight"
    logical_suffix: str = ".weight"
    parts: tuple[Part, ...] = ()
    description: str = ""  # one line for errors and docs ("MXFP4: FP4 E2M1 in blocks of 32, E8M0 scales")

    def __post_init__(self) -> None:
        suffixes = [p.suffix for p in self.parts]
        if len(set(suffixes)) != len(suffixes):
            raise ManifestError(f"quantization scheme {self.name!r}: parts {suffixes} repeat a suffix")
        if self.parts and self.weight_suffix not in suffixes:
            raise ManifestError(f"quantization scheme {self.name!r}: its weight {self.weight_suffix!r} is not one of "
                                f"its parts {suffixes}")

    @property
    def companions(self) -> tuple[str, ...]:
        """The suffixes of a quantized weight's other tensors (its parts but the weight, else FP8's scales)."""
        if self.parts:
            return tuple(p.suffix for p in self.parts if p.suffix != self.weight_suffix)
        return self.scale_suffixes + self.replicated_suffixes

    def part(self, name: str) -> Part | None:
        """The part a tensor name ends in (the longest suffix first); None if it is none of them."""
        best = None
        for p in self.parts:
            if name.endswith(p.suffix) and (best is None or len(p.suffix) > len(best.suffix)):
                best = p
        return best

    def stem(self, name: str) -> str | None:
        """`X` for the weight or a companion of module `X`; None for another name."""
        for suffix in sorted({self.weight_suffix, *self.companions}, key=len, reverse=True):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return None

    def logical_name(self, name: str) -> str | None:
        """The module's logical weight for one of its tensors (`X.weight` for `X.qweight`, `X` for
        `X_blocks`); None for a name that is none of the scheme's."""
        stem = self.stem(name)
        return None if stem is None else stem + self.logical_suffix

    def kind(self, base: str) -> str:
        """The quantized twin of kind `base` (its name; whether it is registered is the kinds' business)."""
        return base + self.suffix

    def base_of(self, kind: str) -> str | None:
        """`column` for `column_fp8`; None for a kind that is not one of this scheme's."""
        return kind[: -len(self.suffix)] if kind.endswith(self.suffix) else None

    def weight_of(self, name: str) -> str | None:
        """`X.weight` for a companion `X.weight_scale_inv`/`X.weight_scale`/`X.input_scale` (the scheme's
        weight for one of its companions: `X_blocks` for `X_scales`), else None."""
        for suffix in sorted(self.companions, key=len, reverse=True):
            if name.endswith(suffix):
                return name[: -len(suffix)] + self.weight_suffix
        return None


_SCHEMES: dict[str, QuantScheme] = {}


def register_scheme(scheme: QuantScheme) -> QuantScheme:
    """Add a packed format; registering its name twice is an error."""
    registrar(_SCHEMES, (scheme.name,), lambda n: f"quantization scheme {n!r}")(scheme)
    return scheme


def schemes() -> tuple[QuantScheme, ...]:
    return tuple(_SCHEMES.values())


def scheme_of_kind(kind: str) -> QuantScheme | None:
    """The scheme whose kind `kind` is (`column_fp8`: FP8); None for a kind no scheme quantizes."""
    return next((s for s in _SCHEMES.values() if s.base_of(kind) is not None), None)


def logical_name(name: str) -> str | None:
    """The logical weight a tensor of a packed module stands for, as the formats with `parts` name it
    (`m.experts.gate_up_proj` for `m.experts.gate_up_proj_scales`): what an architecture's plans name;
    None where no such format claims the name."""
    return next((n for s in _SCHEMES.values() if s.parts for n in [s.logical_name(name)] if n is not None), None)


FP8 = register_scheme(QuantScheme(
    "fp8", "_fp8", bases=("column", "row", "packed_column", "vocab_embed", "replicate"),
    scale_suffixes=(".weight_scale_inv", ".weight_scale"), replicated_suffixes=(".input_scale",),
    torch_dtypes=("float8_e4m3fn", "float8_e5m2")))


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's weights are quantized: the scale granularity of its trailing dims (FP8's
    `block`; None for a format whose parts say it), the packed format (`QuantScheme`) they are stored
    in, and the rule options its parts' units read (`{"group_size": 16}`)."""

    method: str
    block: Block | None
    packed: QuantScheme = FP8
    params: tuple[tuple[str, Any], ...] = ()

    def options(self) -> dict[str, Any]:
        """The rule options a quantized kind records (and a rules file may write by hand)."""
        out = dict(self.params)
        if self.block is not None:
            out["block"] = list(self.block)
        return out


def check_block(block: Any, where: str) -> Block:
    """A `block` option: a list of positive ints or nulls (null: one scale for the whole dim)."""
    if not isinstance(block, list | tuple) or not block or not all(
        b is None or (type(b) is int and b > 0) for b in block
    ):
        raise ManifestError(f"{where}: `block` must be a list of positive integers or nulls, got {block!r}")
    return tuple(block)


MethodFactory = Callable[[dict[str, Any]], Scheme]
_METHODS: dict[str, MethodFactory] = {}


def register_quant_method(method: str) -> Callable[[MethodFactory], MethodFactory]:
    """Bind a `quant_method` to a function `(quantization_config) -> Scheme`; twice is an error."""
    return registrar(_METHODS, (method,), lambda m: f"quant_method {m!r}")


def scheme_from_config(config: dict[str, Any] | None) -> Scheme | None:
    """The scheme config.json's `quantization_config` describes; None for an unquantized checkpoint."""
    qc = (config or {}).get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in _METHODS:
        raise ManifestError(
            f"config.json quantization_config: quant_method {method!r} is not supported (supported: "
            f"{', '.join(sorted(_METHODS))}); its packed tensors would be split wrongly. See docs/quantization.md "
            "for what each packed format needs"
        )
    return _METHODS[method](qc)


@register_quant_method("fp8")
def _fp8(qc: dict[str, Any]) -> Scheme:
    """Block-wise FP8: `weight_block_size` [B0, B1] (transformers' default [128, 128] when absent),
    scale `weight_scale_inv` [ceil(out/B0), ceil(in/B1)]."""
    block = qc.get("weight_block_size") or [128, 128]
    return Scheme("fp8", check_block(block, "config.json quantization_config.weight_block_size"))


@register_quant_method("fbgemm_fp8")
def _fbgemm_fp8(qc: dict[str, Any]) -> Scheme:
    """Per-channel FP8: `weight_scale` [out, 1]."""
    return Scheme("fbgemm_fp8", (1, None))


_CT_STRATEGIES = {"tensor": lambda w: (None, None), "channel": lambda w: (1, None),
                  "block": lambda w: tuple(w.get("block_structure") or ()),
                  "group": lambda w: (1, w.get("group_size"))}


_CT_FORMATS: dict[str, MethodFactory] = {}


def register_ct_format(fmt: str) -> Callable[[MethodFactory], MethodFactory]:
    """Bind a compressed-tensors `format` (`nvfp4-pack-quantized`, `pack-quantized`) to a function
    `(quantization_config) -> Scheme`; twice is an error. Formats not bound here are read as FP8."""
    return registrar(_CT_FORMATS, (fmt,), lambda f: f"compressed-tensors format {f!r}")


def _ct_format(qc: dict[str, Any], groups: dict[str, Any], where: str) -> str | None:
    """The one packed format a compressed-tensors config names (top level or per group) that has its own
    function; None when it names none (FP8 `float-quantized`, `naive-quantized`)."""
    named = {qc.get("format")} | {(g or {}).get("format") for g in groups.values() if isinstance(g, dict)}
    named.discard(None)
    packed = sorted(f for f in named if f in _CT_FORMATS)
    if packed and len(named - {"mixed-precision"}) > 1:
        raise ManifestError(f"{where}: config groups use different formats {sorted(named)}; reshard reads one "
                            "packed format per checkpoint; write a rules file with the kinds of each")
    return packed[0] if packed else None


@register_quant_method("compressed-tensors")
def _compressed_tensors(qc: dict[str, Any]) -> Scheme:
    """compressed-tensors FP8 (`float-quantized`): per-tensor, per-channel ([out, 1]), block or group
    `weight_scale`, optional `input_scale`. Every config group must use the same weight strategy. A packed
    format (`format` bound by `register_ct_format`) is its own function's."""
    where = "config.json quantization_config (compressed-tensors)"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ManifestError(f"{where}: no config_groups")
    fmt = _ct_format(qc, groups, where)
    if fmt is not None:
        return _CT_FORMATS[fmt](qc)
    blocks = set()
    for gname, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ManifestError(
                f"{where}: group {gname!r} has {w.get('num_bits')}-bit {w.get('type')} weights; only 8-bit "
                f"float (FP8) is supported, or a packed `format` among {sorted(_CT_FORMATS)} (see docs/quantization.md)"
            )
        strategy = w.get("strategy")
        if strategy not in _CT_STRATEGIES:
            raise ManifestError(f"{where}: group {gname!r}: weight strategy {strategy!r}; known: {sorted(_CT_STRATEGIES)}")
        blocks.add(check_block(list(_CT_STRATEGIES[strategy](w)), f"{where}: group {gname!r}"))
    if len(blocks) > 1:
        raise ManifestError(f"{where}: config groups use different weight granularities {sorted(map(str, blocks))}; "
                            "write a rules file with one `block` per pattern")
    return Scheme("compressed-tensors", blocks.pop())
