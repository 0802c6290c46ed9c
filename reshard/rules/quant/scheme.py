"""A checkpoint's quantization scheme, read from config.json's `quantization_config`.

A scheme says how coarse a weight's scale is along each dim (`block`: an int is a block of that many
indices, None one scale for the whole dim) and which companion tensors a quantized weight `X.weight`
has (its `QuantScheme`, the packed format: FP8 for every method here). Each `quant_method` is one
decorated function `(quantization_config) -> Scheme`:

    @register_quant_method("fp8")                 # DeepSeek-V3, Qwen3-*-FP8, Kimi-K2
    def _fp8(qc): return Scheme(block=tuple(qc["weight_block_size"]), ...)

A method that is not registered (GPTQ, AWQ, MXFP4, bitsandbytes, ...) is an error naming the known
ones, never a silent split of packed data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.errors import ManifestError
from reshard.registry import registrar

Block = tuple[int | None, ...]


@dataclass(frozen=True)
class QuantScheme:
    """A packed weight format as a value: the kinds it adds (each base kind's quantized twin, named
    `base + suffix`), the companion tensors a quantized weight `X.weight` has (by the suffix replacing
    `.weight`) and the dtypes its weights are stored in. Code asks the scheme, never a literal suffix;
    a second packed format is one more `register_scheme(QuantScheme(...))`."""

    name: str
    suffix: str  # of its kinds: `column` -> `column_fp8`
    bases: tuple[str, ...]  # the base kinds its own module registers twins of
    scale_suffixes: tuple[str, ...]  # split with the weight, in block units
    replicated_suffixes: tuple[str, ...]  # one activation scale: every rank gets it
    torch_dtypes: tuple[str, ...]  # names in `torch` of the dtypes its weights are stored in

    @property
    def companions(self) -> tuple[str, ...]:
        return self.scale_suffixes + self.replicated_suffixes

    def kind(self, base: str) -> str:
        """The quantized twin of kind `base` (its name; whether it is registered is the kinds' business)."""
        return base + self.suffix

    def base_of(self, kind: str) -> str | None:
        """`column` for `column_fp8`; None for a kind that is not one of this scheme's."""
        return kind[: -len(self.suffix)] if kind.endswith(self.suffix) else None

    def weight_of(self, name: str) -> str | None:
        """`X.weight` for a companion `X.weight_scale_inv`/`X.weight_scale`/`X.input_scale`, else None."""
        for suffix in self.companions:
            if name.endswith(suffix):
                return name[: -len(suffix)] + ".weight"
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


FP8 = register_scheme(QuantScheme(
    "fp8", "_fp8", bases=("column", "row", "packed_column", "vocab_embed", "replicate"),
    scale_suffixes=(".weight_scale_inv", ".weight_scale"), replicated_suffixes=(".input_scale",),
    torch_dtypes=("float8_e4m3fn", "float8_e5m2")))


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's weights are quantized: the scale granularity of its trailing dims, and the
    packed format (`QuantScheme`) they are stored in."""

    method: str
    block: Block
    packed: QuantScheme = FP8

    def options(self) -> dict[str, Any]:
        """The rule options a quantized kind records (and a rules file may write by hand)."""
        return {"block": list(self.block)}


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


@register_quant_method("compressed-tensors")
def _compressed_tensors(qc: dict[str, Any]) -> Scheme:
    """compressed-tensors FP8 (`float-quantized`): per-tensor, per-channel ([out, 1]), block or group
    `weight_scale`, optional `input_scale`. Every config group must use the same weight strategy."""
    where = "config.json quantization_config (compressed-tensors)"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ManifestError(f"{where}: no config_groups")
    blocks = set()
    for gname, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ManifestError(
                f"{where}: group {gname!r} has {w.get('num_bits')}-bit {w.get('type')} weights; only 8-bit "
                "float (FP8) is supported (packed int formats: see docs/quantization.md)"
            )
        strategy = w.get("strategy")
        if strategy not in _CT_STRATEGIES:
            raise ManifestError(f"{where}: group {gname!r}: weight strategy {strategy!r}; known: {sorted(_CT_STRATEGIES)}")
        blocks.add(check_block(list(_CT_STRATEGIES[strategy](w)), f"{where}: group {gname!r}"))
    if len(blocks) > 1:
        raise ManifestError(f"{where}: config groups use different weight granularities {sorted(map(str, blocks))}; "
                            "write a rules file with one `block` per pattern")
    return Scheme("compressed-tensors", blocks.pop())
