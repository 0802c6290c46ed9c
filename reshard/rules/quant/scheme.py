"""A checkpoint's quantization scheme, read from config.json's `quantization_config`.

A scheme says how coarse a weight's scale is along each dim (`block`: an int is a block of that many
indices, None one scale for the whole dim) and which companion tensors a quantized weight `X.weight`
has. Each `quant_method` is one decorated function `(quantization_config) -> Scheme`:

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

# companion tensors of a quantized `X.weight`, by the suffix replacing `.weight`
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # split with the weight, in block units
REPLICATED_SUFFIXES = (".input_scale",)  # one activation scale: every rank gets it
COMPANION_SUFFIXES = SCALE_SUFFIXES + REPLICATED_SUFFIXES


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's weights are quantized: the scale granularity of its trailing dims."""

    method: str
    block: Block

    def options(self) -> dict[str, Any]:
        """The rule options a quantized kind records (and a rules file may write by hand)."""
        return {"block": list(self.block)}


def weight_of(name: str) -> str | None:
    """`X.weight` for a companion `X.weight_scale_inv`/`X.weight_scale`/`X.input_scale`, else None."""
    for suffix in COMPANION_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


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
