"""ShardLoader protocol, the built-in loaders and the kind registry.

A loader answers one question for one tensor: which part of the global tensor does rank r of tp get?
The answer is a `Selection`: for every dimension, the list of half-open index intervals taken, in
order; the rank's tensor is their cartesian product, concatenated. Indices at or past the dimension's
size are padding and read as zeros. From a selection, the plan derives shapes and byte ranges without
reading data, `load` reads a `safe_open` slice handle, and a merge puts the pieces back.

Kinds are looked up by name: `@register_loader("column")` binds a factory `(rule, suffix) -> ShardLoader`.
A new kind is one decorated function in any imported module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard.errors import PlanError, RegistryError, TpMismatchError
from reshard.format.rank_file import parse_optimizer_tensor_name
from reshard.format.selection import Interval, Selection, full_selection, selection_shape
from reshard.registry import registrar

if TYPE_CHECKING:
    import torch

    from reshard.rules.manifest import Rule

def split_interval(size: int, rank: int, tp: int, *, pad: bool = False, align: int | None = None,
                   what: str = "dim") -> Interval:
    """Rank's contiguous share of `size` indices; with `pad`, size is rounded up to a multiple of tp.

    With `align` (vLLM's vocabularies: 64), size is first rounded up to a multiple of `align`, then split
    evenly (it must divide by tp, as vLLM requires): rank r holds [r*chunk, (r+1)*chunk), zeros past `size`."""
    if align:
        padded = -(-size // align) * align
        if padded % tp:
            raise TpMismatchError(f"{what} has size {size}, padded to {padded} (a multiple of align={align}), not "
                                  f"divisible by tp={tp}", f"pick tp dividing {padded}")
        chunk = padded // tp
        return (rank * chunk, (rank + 1) * chunk)
    if size % tp:
        if not pad:
            good = [d for d in (1, 2, 4, 8, 16, 32, 64) if size % d == 0]
            raise TpMismatchError(f"{what} has size {size}, not divisible by tp={tp}",
                                  f"set `pad: true` on the rule or pick tp in {{{','.join(map(str, good))}}}", pad=True)
        chunk = -(-size // tp)
    else:
        chunk = size // tp
    return (rank * chunk, (rank + 1) * chunk)


def split_heads(size: int, heads: int, rank: int, tp: int, *, replicate: bool = False, what: str = "dim") -> Interval:
    """Rank's share of `heads` equal head blocks, split on head boundaries.

    With `replicate` (GQA kv heads) and heads < tp, each head goes to tp/heads consecutive ranks.
    """
    if heads <= 0 or size % heads:
        raise PlanError(f"{what} has size {size}, not a multiple of heads={heads}")
    if heads % tp == 0:
        return split_interval(size, rank, tp, what=what)
    if not replicate:
        raise TpMismatchError(f"{what}: {heads} heads are not divisible by tp={tp}", f"pick tp dividing {heads}")
    if tp % heads == 0:
        head_dim = size // heads
        h = rank // (tp // heads)
        return (h * head_dim, (h + 1) * head_dim)
    raise TpMismatchError(f"{what}: {heads} heads cannot be shared by tp={tp} (neither divides the other)",
                          f"pick tp dividing {heads} or a multiple of it")


@runtime_checkable
class ShardLoader(Protocol):
    """How one tensor is split. `select` is all a new loader must define (see `SliceLoader`)."""

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection: ...

    def shard_shape(self, shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]: ...

    def load(self, handle: Any, rank: int, world_size: int) -> torch.Tensor: ...


class SliceLoader:
    """Base class: `shard_shape` and `load` derived from `select`."""

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        raise NotImplementedError

    def shard_shape(self, shape: tuple[int, ...], rank: int, world_size: int) -> tuple[int, ...]:
        return selection_shape(self.select(tuple(shape), rank, world_size))

    def load(self, handle: Any, rank: int, world_size: int) -> torch.Tensor:
        """Read this rank's piece from a `safe_open(...).get_slice(name)` handle."""
        from reshard.format.torch_side import TORCH_DTYPES, read_selection  # torch only when loading

        shape = tuple(handle.get_shape())
        sel = self.select(shape, rank, world_size)
        return read_selection(lambda idx: handle[idx], sel, shape, TORCH_DTYPES[handle.get_dtype()])

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class ReplicateLoader(SliceLoader):
    """Every rank gets the whole tensor."""

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        return full_selection(shape)


class DimShardLoader(SliceLoader):
    """Contiguous split along `dim`; optional zero padding to a multiple of tp; optional head blocks."""

    def __init__(self, dim: int, *, pad: bool = False, heads: int | None = None, replicate_heads: bool = False,
                 align: int | None = None) -> None:
        self.dim, self.pad, self.heads, self.replicate_heads, self.align = dim, pad, heads, replicate_heads, align

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        if self.dim >= len(shape):
            raise PlanError(f"shape {list(shape)} has no dim {self.dim} to split")
        what = f"dim {self.dim}"
        size = shape[self.dim]
        if self.heads:
            iv = split_heads(size, self.heads, rank, world_size, replicate=self.replicate_heads, what=what)
        else:
            iv = split_interval(size, rank, world_size, pad=self.pad, align=self.align, what=what)
        sel = list(full_selection(shape))
        sel[self.dim] = (iv,)
        return tuple(sel)


class PackedLoader(SliceLoader):
    """A fused tensor of blocks along `dim` (q|k|v, gate|up): each block split on its own, pieces in order."""

    def __init__(
        self, blocks: Sequence[int], *, dim: int = 0, heads: Sequence[int] | None = None,
        replicate_heads: Sequence[bool] | None = None,
    ) -> None:
        self.blocks, self.dim = tuple(blocks), dim
        self.heads = tuple(heads) if heads else None
        self.replicate_heads = tuple(replicate_heads) if replicate_heads else (False,) * len(self.blocks)
        for what, seq in (("heads", self.heads), ("replicate_heads", self.replicate_heads)):
            if seq is not None and len(seq) != len(self.blocks):
                raise PlanError(f"packed_column: {len(seq)} {what} entries for {len(self.blocks)} blocks")

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        if self.dim >= len(shape):
            raise PlanError(f"shape {list(shape)} has no dim {self.dim} to split")
        size = shape[self.dim]
        if sum(self.blocks) != size:
            raise PlanError(
                f"packed_column blocks {list(self.blocks)} sum to {sum(self.blocks)}, not dim {self.dim} size {size}"
            )
        return _packed_selection(shape, self.dim, self.blocks, rank, world_size, self.heads, self.replicate_heads)


def _packed_selection(
    shape: tuple[int, ...], dim: int, blocks: Sequence[int], rank: int, world_size: int,
    heads: Sequence[int] | None = None, replicate_heads: Sequence[bool] | None = None,
) -> Selection:
    """Each block of `dim` split on its own (on head boundaries when `heads`), the pieces in block order."""
    pieces, offset = [], 0
    for i, block in enumerate(blocks):
        what = f"packed block {i} (size {block})"
        if heads:
            rep = bool(replicate_heads and replicate_heads[i])
            a, b = split_heads(block, heads[i], rank, world_size, replicate=rep, what=what)
        else:
            a, b = split_interval(block, rank, world_size, what=what)
        pieces.append((offset + a, offset + b))
        offset += block
    sel = list(full_selection(shape))
    sel[dim] = tuple(pieces)
    return tuple(sel)


class EqualBlocksLoader(SliceLoader):
    """`parts` equal blocks along `dim` (a fused gate|up of unknown size), each split on its own.

    This is torch's `_StridedShard(dim, split_factor=parts)`, what transformers' `packed_*` styles hold.
    """

    def __init__(self, dim: int, parts: int) -> None:
        self.dim, self.parts = dim, parts

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        if self.dim >= len(shape):
            raise PlanError(f"shape {list(shape)} has no dim {self.dim} to split")
        size = shape[self.dim]
        if size % self.parts:
            raise PlanError(f"dim {self.dim} has size {size}, not {self.parts} equal packed blocks")
        return _packed_selection(shape, self.dim, [size // self.parts] * self.parts, rank, world_size)


LoaderFactory = Callable[["Rule", str], ShardLoader]
_REGISTRY: dict[str, LoaderFactory] = {}


def register_loader(kind: str) -> Callable[[LoaderFactory], LoaderFactory]:
    """Bind `kind` to a factory `(rule, suffix) -> ShardLoader`; registering a kind twice is an error."""
    return registrar(_REGISTRY, (kind,), lambda k: f"kind {k!r}", known="known kinds")


def known_kinds() -> list[str]:
    return sorted(_REGISTRY)


def check_kind(kind: str) -> None:
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown kind {kind!r}; known kinds: {', '.join(known_kinds())}")


def loader_for(rule: Rule, suffix: str) -> ShardLoader:
    """The loader the rule's kind makes for a tensor whose name ends in `suffix` ('.weight', '.bias')."""
    check_kind(rule.kind)
    return _REGISTRY[rule.kind](rule, suffix)


def _check_selection(name: str, shape: tuple[int, ...], sel: Selection) -> None:
    if len(sel) != len(shape) or any(a < 0 or b < a for dim in sel for a, b in dim):
        raise PlanError(f"{name}: loader returned an invalid selection {sel} for shape {list(shape)}")


def tensor_selection(name: str, shape: tuple[int, ...], rule: Rule, rank: int, tp: int) -> Selection:
    """The selection `rule` gives rank `rank` of `tp` for tensor `name`; errors name the tensor. An optimizer
    moment (`NAME.exp_avg`) is cut as its parameter `NAME` is: a row rule's bias moment is replicated too."""
    param = (parse_optimizer_tensor_name(name) or (name, ""))[0]
    suffix = "." + param.rsplit(".", 1)[-1] if "." in param else ""
    try:
        sel = loader_for(rule, suffix).select(shape, rank, tp)
    except TpMismatchError as e:
        raise TpMismatchError(f"{name}: {e.fact}", e.fix, pad=e.pad, where=f" (rule {rule.pattern!r}, kind {rule.kind})") from None
    except PlanError as e:
        raise PlanError(f"{name}: {e} (rule {rule.pattern!r}, kind {rule.kind})") from None
    _check_selection(name, shape, sel)
    return sel


def _int_option(rule: Rule, key: str) -> int | None:
    value = rule.options.get(key)
    if value is not None and (type(value) is not int or value <= 0):
        raise PlanError(f"rule {rule.pattern!r}: option {key}={value!r} must be a positive integer")
    return value


def _bool_option(rule: Rule, key: str) -> bool:
    value = rule.options.get(key, False)
    if type(value) is not bool:
        raise PlanError(f"rule {rule.pattern!r}: option {key}={value!r} must be true or false")
    return value


@register_loader("replicate")
def _replicate(rule: Rule, suffix: str) -> ShardLoader:
    return ReplicateLoader()


@register_loader("column")
def _column(rule: Rule, suffix: str) -> ShardLoader:
    _bool_option(rule, "gather_output")  # a trainer-side option; checked here so typos fail early
    return DimShardLoader(0, pad=_bool_option(rule, "pad"), heads=_int_option(rule, "heads"),
                          replicate_heads=_bool_option(rule, "replicate_heads"), align=_align(rule))


@register_loader("row")
def _row(rule: Rule, suffix: str) -> ShardLoader:
    # The bias is added once after the all-reduce, so every rank keeps all of it.
    if suffix == ".bias":
        return ReplicateLoader()
    return DimShardLoader(1, pad=_bool_option(rule, "pad"))


def _align(rule: Rule) -> int | None:
    """`align`: a vocabulary padded to a multiple of it, then split evenly (how vLLM holds it, `reshard.rules.engines`)."""
    align = _int_option(rule, "align")
    if align and _int_option(rule, "heads"):
        raise PlanError(f"rule {rule.pattern!r}: `align` and `heads` exclude each other")
    return align


@register_loader("vocab_embed")
def _vocab_embed(rule: Rule, suffix: str) -> ShardLoader:
    return DimShardLoader(0, pad=_bool_option(rule, "pad"), align=_align(rule))


@register_loader("packed_column")
def _packed_column(rule: Rule, suffix: str) -> ShardLoader:
    if "parts" in rule.options and "blocks" not in rule.options:
        return EqualBlocksLoader(0, _int_option(rule, "parts"))
    blocks = rule.options.get("blocks")
    if not isinstance(blocks, list) or not blocks or not all(type(b) is int and b > 0 for b in blocks):
        raise PlanError(f"rule {rule.pattern!r}: packed_column needs `blocks`, a list of positive block sizes")
    heads = rule.options.get("heads")
    if heads is not None and not (isinstance(heads, list) and all(type(h) is int and h > 0 for h in heads)):
        raise PlanError(f"rule {rule.pattern!r}: packed_column `heads` must be a list of positive integers")
    rep = rule.options.get("replicate_heads")
    if rep is not None and not (isinstance(rep, list) and all(isinstance(x, bool) for x in rep)):
        raise PlanError(f"rule {rule.pattern!r}: packed_column `replicate_heads` must be a list of booleans")
    return PackedLoader(blocks, heads=heads, replicate_heads=rep)


class LastDimsLoader(SliceLoader):
    """Split the dim `back` places from the last (transformers' colwise: `ndim-2`, rowwise: `ndim-1`),
    for tensors of any rank (fused MoE experts `[E, out, in]`); `parts` equal blocks split on their own."""

    def __init__(self, back: int, *, parts: int | None = None) -> None:
        self.back, self.parts = back, parts

    def select(self, shape: tuple[int, ...], rank: int, world_size: int) -> Selection:
        dim = max(len(shape) - self.back, 0)
        if self.parts:
            return EqualBlocksLoader(dim, self.parts).select(shape, rank, world_size)
        return DimShardLoader(dim).select(shape, rank, world_size)


@register_loader("embed_hidden")
def _embed_hidden(rule: Rule, suffix: str) -> ShardLoader:
    """An embedding split along its hidden dim (transformers' `embedding_colwise`): every token, part of its vector."""
    return DimShardLoader(1)


@register_loader("packed_row")
def _packed_row(rule: Rule, suffix: str) -> ShardLoader:
    """A weight whose input dim holds `parts` (default 2) fused blocks, each split on its own; a bias is replicated."""
    if suffix == ".bias":
        return ReplicateLoader()
    return LastDimsLoader(1, parts=_int_option(rule, "parts") or 2)


@register_loader("expert_column")
def _expert_column(rule: Rule, suffix: str) -> ShardLoader:
    """Fused experts `[E, out, in]` split along `out` (dim ndim-2), per block when `parts` is set."""
    return LastDimsLoader(2, parts=_int_option(rule, "parts"))


@register_loader("expert_row")
def _expert_row(rule: Rule, suffix: str) -> ShardLoader:
    """Fused experts `[E, out, in]` split along `in` (the last dim), per block when `parts` is set."""
    return LastDimsLoader(1, parts=_int_option(rule, "parts"))


# --- parallel layers: the same kinds, on the trainer side ------------------------------------------
# A layer factory `(module, spec, group) -> nn.Module` replaces a module (built on the meta device)
# whose weight has this kind; `spec` is the rank file's self-description of that weight (kind,
# options, global shape, selection). Registering a kind may add a loader, a layer, or both.
LayerFactory = Callable[..., Any]
_LAYERS: dict[str, LayerFactory] = {}


def register_layer(kind: str) -> Callable[[LayerFactory], LayerFactory]:
    """Bind `kind` to a parallel-layer factory; registering one twice is an error."""
    return registrar(_LAYERS, (kind,), lambda k: f"layer for kind {k!r}")


def layer_factory(kind: str) -> LayerFactory | None:
    """The layer factory for `kind`; None for `replicate` (the module stays as it is)."""
    if kind == "replicate":
        return None
    check_kind(kind)
    if kind not in _LAYERS:
        raise RegistryError(f"kind {kind!r} has a loader but no parallel layer; layers exist for: {', '.join(sorted(_LAYERS))}")
    return _LAYERS[kind]
