"""`fill_model`: fill any TP model (plain tensors or DTensors) with what this rank holds, as it streams.

    model = ...                    # built on meta, parallelized (transformers tp_plan or parallelize_module),
    model.to_empty(device="cpu")   # then materialized without reading any weights
    report = fill_model(model, "http://HOST:PORT/v1/checkpoints/NAME")   # or a shard dir, or a rank file
    print(report)                  # tensors filled, bytes pulled, seconds, dtype casts

The source's rank and tp come from `group` (default: the DTensors' 1-D mesh, else the world). Before
any byte is copied, every shard tensor is matched to a parameter or persistent buffer by name (through
transformers' checkpoint renamings, and for per-expert MoE tensors to a view into the fused expert
parameter, see `reshard.fill.experts`), its local
shape is compared, and for a DTensor the global indices it holds (as DTensor chunks it: `Shard(d)`,
`_StridedShard`, uneven last ranks) are compared with the selection the shard's self-description
records. Any disagreement is one `PlanError` naming each parameter, both shapes and both layouts,
with missing and unexpected names listed; nothing is filled then. The bytes then go straight into the
parameters (`reshard.fill.into_params.fill_parameters`), cast where the dtypes differ, sha256 checked.

By default (`follow="auto"`) the model decides: a model with DTensor parameters whose shard disagrees
with it (a shard planned from another transformers release's TP plan, another layout, or a source with
no rank files: an HF checkpoint) is filled instead with the blocks its own tensors hold, read as boxes
(`reshard.fill.follow_model`); the disagreement is then no error. `follow="shard"` keeps the refusal.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from reshard.errors import CheckpointError, PlanError, ReshardError
from reshard.fill.experts import Held, expert_views, partly_covered, shard_layout, uncovered
from reshard.fill.follow_model import fill_by_boxes
from reshard.fill.held_boxes import held_indices, local_tensor
from reshard.fill.into_params import RankHeader, fill_parameters, read_header_from
from reshard.fill.open import open_rank_stream
from reshard.fill.report import FillReport
from reshard.format.torch_side import TORCH_DTYPES
from reshard.layout.mesh import DIMS, Layout
from reshard.tp.comm import tp_rank, tp_world_size

_LIST = 6  # names shown per list in an error


FOLLOW = ("auto", "shard", "model")


def fill_model(model: nn.Module, source: str | Path, *, group: ProcessGroup | None = None,
               token: str | None = None, layout: Layout | None = None, mapped: bool = True,
               verify: str = "auto", follow: str = "auto") -> FillReport:
    """Fill every parameter and persistent buffer of `model` with what it holds of `source`: a rank-shard
    directory, the service's checkpoint URL, one rank file, or (following the model) any checkpoint reshard
    reads. See the module docstring.

    `follow` says who decides what this rank holds:
    - "auto" (the default), decided per model: a model with DTensor parameters (transformers' TP plan of
      whichever release is installed, FSDP2, `parallelize_module`) holds what its placements say. Its
      rank's shard is used when it holds exactly those blocks (checked before any byte moves: rank files
      mapped, a prefetched shard taken), else those blocks are read as boxes of `source`
      (`reshard.fill.follow_model`), so a shard planned for another plan, layout or release, or an HF
      checkpoint directory, still fills it. A model of plain tensors (reshard's own TP layers keep plain
      local shards) says nothing of what it holds: it takes its rank's shard;
    - "shard": the rank's shard alone; a shard that disagrees with the model is refused;
    - "model": the blocks the model's DTensors hold, as boxes; then `group`, `layout`, `mapped` and
      `verify` do not apply.

    The shard's layout is `layout`, else the `DistributedConfig` transformers loaded the model with (n-D:
    pipeline, FSDP, expert parallel), else tensor parallelism over `group` (default: the DTensors'
    1-D mesh, else the world); the rank is this process's global rank (the group's, for TP).

    From a local rank file, `mapped` makes the parameters that hold its bytes as they are views of a
    private mapping of it (`reshard.fill.mapped_params`: no copy; False copies every byte), and `verify="auto"`
    trusts its recorded sha256 while the file is unchanged since it was verified or written
    (`reshard.io.verified`; "always" hashes it every time). The service's bytes are always hashed."""
    if follow not in FOLLOW:
        raise ValueError(f"follow={follow!r}: expected 'auto' (decided per model), 'shard' (the rank's shard) or "
                         "'model' (what its tensors hold)")
    if follow == "model":
        return replace(fill_by_boxes(model, source, token=token), follow="model")
    fallback = follow == "auto" and _has_dtensors(model) and not _is_rank_file(source)
    shard = _from_shard(model, source, group, token, layout, mapped, verify, fallback=fallback)
    if isinstance(shard, FillReport):
        return shard
    try:  # the shard holds other blocks than the model (`shard`, the reason): read those the model holds
        return replace(fill_by_boxes(model, source, token=token), follow="model")
    except ReshardError as e:
        raise e from shard


def _from_shard(model: nn.Module, source: str | Path, group: ProcessGroup | None, token: str | None,
                layout: Layout | None, mapped: bool, verify: str, *, fallback: bool) -> FillReport | ReshardError:
    """Fill from the rank's shard. Where the shard does not hold what the model holds (another layout or plan,
    no rank files) nothing is filled: with `fallback` the reason is returned (nothing left open), else raised."""
    t0 = time.perf_counter()
    chunks = None
    try:
        try:
            layout, rank = _layout_and_rank(model, group, layout)
            _config, chunks, sha, name = open_rank_stream(source, rank, layout, token=token, need_config=False)
            header, leftover = read_header_from(chunks, name)
            header.check(rank, layout, fix=f"give it rank {rank}'s shard of {layout.describe()}; nothing was filled")
            targets, fused = match_targets(model, header)
        except (CheckpointError, PlanError) as e:
            if fallback:
                return e
            raise
        casts = {n: (_dtype_name(TORCH_DTYPES[header.entries[n]["dtype"]]), _dtype_name(t.dtype))
                 for n, t in targets.items() if TORCH_DTYPES[header.entries[n]["dtype"]] != t.dtype}
        filled = fill_parameters(header, chunks, targets, sha256=sha, leftover=leftover, mapped=mapped, verify=verify)
    finally:
        _close(chunks)
    return FillReport(name, rank, layout.tp, len(targets), header.total, time.perf_counter() - t0, casts, fused,
                      layout, filled.mapped, filled.verified)


def _close(chunks: object) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        close()


def _has_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in model.state_dict(keep_vars=True).values())


def _is_rank_file(source: str | Path) -> bool:
    """One rank file named as the source: the caller chose that shard (nothing else to follow)."""
    return str(source).endswith(".safetensors")


def _layout_and_rank(model: nn.Module, group: ProcessGroup | None, layout: Layout | None) -> tuple[Layout, int]:
    import torch.distributed as dist

    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if layout is None and config is not None and group is None:
        layout = Layout.from_sizes({d: getattr(config, f"{d}_size") for d in DIMS})  # DistributedConfig's `tp_size`, ...
    if layout is not None and not layout.tp_only:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size(group) != layout.world:
            raise CheckpointError(f"{layout.describe()} is a world of {layout.world} ranks, but this process group has "
                                  f"{dist.get_world_size(group)}; launch {layout.world} processes")
        return layout, rank
    group = group if group is not None else _mesh_group(model)
    tp = tp_world_size(group)
    if layout is not None and layout.tp != tp:
        raise CheckpointError(f"layout tp={layout.tp}, but the tensor-parallel group has {tp} ranks")
    return Layout(tp=tp), tp_rank(group)


def match_targets(model: nn.Module, header: RankHeader) -> tuple[dict[str, torch.Tensor], int]:
    """Shard tensor name -> the tensor its bytes go into (a DTensor's local tensor, or a view into a
    fused expert parameter), after every check; raises one `PlanError` listing every disagreement."""
    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers, tied aliases included
    layout = shard_layout(model, list(header.entries))  # shard (checkpoint) name -> the model's name or ExpertPiece
    shapes = {n: tuple(e["shape"]) for n, e in header.entries.items()}
    described = {n: header.tensors.get(n, {}) for n in shapes}
    targets: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    with torch.no_grad():
        for n in sorted(n for n, m in layout.renamed.items() if m in state):
            p = state[layout.renamed[n]]
            targets[n] = local_tensor(p)
            problems += _check(n, targets[n], held_indices(p), described[n], shapes[n], lambda p=p: _describe_param(p))
        views = expert_views(state, layout.pieces, shapes, local=local_tensor, held=held_indices,
                             global_shapes={n: described[n].get("shape", shapes[n]) for n in layout.pieces})
        for n, v in views.items():
            targets[n] = v.view
            problems += _check(n, v.view, v.held, described[n], shapes[n], lambda v=v: (
                f"expert {v.expert} of {v.param}, a view of {_describe_param(state[v.param])}"))
    missing, unexpected = uncovered(state, layout, views, shapes)
    missing = [n for n in missing if local_tensor(state[n]).numel()]  # an empty FSDP chunk (no expert of it here) needs nothing
    missing += partly_covered(views)
    if missing or unexpected:
        problems.insert(0, f"missing from the shard: {_names(missing)}; in the shard but not in the model: "
                           f"{_names(unexpected)}")
    if problems:
        more = f" (and {len(problems) - _LIST} more)" if len(problems) > _LIST else ""
        raise PlanError(f"{header.source}: shard and model disagree, nothing was filled: "
                        + "; ".join(problems[:_LIST]) + more)
    return targets, len(views)


def _check(name: str, local: torch.Tensor, held: Held, desc: dict[str, Any], shape: tuple[int, ...],
           model_layout: Callable[[], str]) -> list[str]:
    """One line if the local tensor's shape or held indices disagree with the shard tensor's."""
    select = desc.get("select")
    wrong = tuple(local.shape) != shape
    if not wrong and select is not None:
        wrong = any(h is not None and _runs(h) != _merge(sel) for h, sel in zip(held, select))
    if not wrong:
        return []
    return [f"{name}: the model has shape {list(local.shape)} ({model_layout()}), the shard has shape {list(shape)} "
            f"({_describe_shard(desc, shape)})"]


def _mesh_group(model: nn.Module) -> ProcessGroup | None:
    """The process group of the first DTensor parameter's 1-D mesh (None: the default group)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1:
            return p.device_mesh.get_group()
    return None


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _merge(intervals: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in intervals:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((int(a), int(b)))
    return out


def _spans(runs: Iterable[tuple[int, int]]) -> str:
    return "+".join(f"{a}:{b}" for a, b in runs) or "nothing"


def _describe_param(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return f"a plain {_dtype_name(t.dtype)} tensor"
    held = held_indices(t)
    dims = ", ".join(f"dim {d} {_spans(_runs(h))} of {n}" for d, (h, n) in enumerate(zip(held, t.shape))
                     if h is not None and len(h) != n)
    return (f"DTensor {tuple(t.placements)} of global {list(t.shape)} on a {t.device_mesh.size()}-rank mesh, "
            f"holding {dims or 'all of it'}")


def _describe_shard(desc: dict[str, Any], shape: tuple[int, ...]) -> str:
    kind, gshape, select = desc.get("kind", "?"), desc.get("shape", list(shape)), desc.get("select") or []
    dims = ", ".join(f"dim {d} {_spans(_merge(sel))} of {n}" for d, (sel, n) in enumerate(zip(select, gshape))
                     if _merge(sel) != [(0, n)])
    options = f" {desc['options']}" if desc.get("options") else ""
    return f"kind {kind}{options} of global {list(gshape)}, holding {dims or 'all of it'}"


def _names(names: Sequence[str]) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - _LIST} more" if len(names) > _LIST else ""
    return ", ".join(names[:_LIST]) + more


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["FillReport", "fill_model", "match_targets"]
