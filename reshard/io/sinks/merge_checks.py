"""What `reshard merge` checks before it writes anything: that the pieces it is given make one checkpoint.

The rank files' digests (`hf_checkpoint.check_recorded`) say the files are the ones a write made, where
they are recorded. Beyond them, three checks any set of pieces must pass:

- **the plan**: every rank file of one write or save records the same plan identity
  (`reshard.format.rank_file.plan_identity`; files older than header revision 3 record none), and a
  set whose files record different ones is refused as it is opened (`reshard.io.source.rank_dir`),
  naming both; the rank files describe themselves (kind, options, global shape per tensor; the
  layout), so their plan is re-derived (`make_planner` of the recorded kinds at the recorded layout,
  config.json placing pipeline stages and experts) and every rank's tensor descriptions must be that
  plan's for its rank: a tensor the layout puts on every rank of its group that some ranks lack, a
  piece at another place than its rule gives it, is refused, naming the tensor and the ranks;
- **the replicas**: pieces of one tensor that several ranks hold (a replicated norm, a row layer's bias,
  kv heads shared at tp > kv heads, every tensor of a `dp_replicate` copy) must be the same bytes: each
  copy is hashed in blocks (never held), and copies that differ are refused, naming the ranks;
- **the model**: where transformers can build config.json's architecture, every tensor's global shape
  must be the one its model gives it (`reshard.rules.tp_plans.built.model_shapes`): ranks that all
  understate a shape would otherwise make a consistent, truncated tensor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from reshard.errors import CheckpointError, IntegrityError
from reshard.format.checkpoint import GlobalTensor, PiecedSource
from reshard.format.rank_file import decode_metadata
from reshard.io.source.rank_dir import ShardSet
from reshard.io.source.readers import open_reader
from reshard.plan.planner import make_planner
from reshard.plan.types import source_files
from reshard.rules.tp_plans.built import model_shapes

BLOCK = 8 << 20  # bytes hashed at a time: what the replica check holds
_FIX = "the rank files are of different writes, or damaged; write or save them again"


def check_merge(shards: PiecedSource, *, config: dict[str, Any] | None = None,
                names: Mapping[str, str] | None = None) -> None:
    """The checks of the module docstring (the plan and the replicas for rank files; the model's shapes
    for any source). `names`: the model's name of each tensor checked (AdamW moments: their parameter's),
    `config`: the config.json that describes them (default the source's own)."""
    if isinstance(shards, ShardSet):
        check_plan(shards)
        check_replicas(shards)
    check_shapes(shards, config if config is not None else getattr(shards, "config", None), names)


def check_plan(shards: ShardSet) -> None:
    """Every rank's tensor descriptions are the ones the plan re-derived from them gives its rank."""
    planner, _ = make_planner(shards, shards.manifest(), shards.layout)
    placed: dict[str, list[int]] = {}
    held: dict[str, dict[int, Any]] = {}
    for rank, info in enumerate(shards.files):
        found = decode_metadata(info.metadata, str(info.path)).tensors
        for name, planned in planner.descriptions(rank).items():
            placed.setdefault(name, []).append(rank)
            if name in found and found[name] != (d := json.loads(planned)):
                raise CheckpointError(f"{info.path}: tensor {name!r} is described as {_brief(found[name])}; the "
                                      f"{shards.layout.describe()} plan gives rank {rank} {_brief(d)}: {_FIX}")
        for name in found:
            held.setdefault(name, {})[rank] = True
    for name, ranks in placed.items():
        lacking = [r for r in ranks if r not in held.get(name, {})]
        if lacking:
            raise CheckpointError(f"{shards.root}: tensor {name!r}: the {shards.layout.describe()} layout puts it "
                                  f"on ranks {_ranks(ranks)}, but ranks {_ranks(lacking)} lack it: {_FIX}")
    for name, by_rank in held.items():
        extra = sorted(set(by_rank) - set(placed.get(name, ())))
        if extra:
            raise CheckpointError(f"{shards.root}: tensor {name!r}: ranks {_ranks(extra)} hold it, but the "
                                  f"{shards.layout.describe()} layout puts it on ranks {_ranks(placed.get(name, []))}: {_FIX}")


def check_replicas(shards: ShardSet) -> None:
    """Pieces of a tensor that several ranks hold (the same selection) hash the same, block by block."""
    rank_of = {str(f.path): r for r, f in enumerate(shards.files)}
    keys = source_files(shards)
    readers: dict[str, Any] = {}
    buf = bytearray(BLOCK)

    def reader(f: str) -> Any:
        if f not in readers:
            readers[f] = open_reader(f, keys[f])
        return readers[f]

    try:
        for gt in shards.tensors.values():
            copies: dict[Any, list[Any]] = {}
            for p in gt.pieces:
                copies.setdefault(p.select, []).append(p)
            for pieces in copies.values():
                if len(pieces) > 1:
                    _compare(gt, pieces, rank_of, reader, buf)
    finally:
        for r in readers.values():
            r.close()


def _compare(gt: GlobalTensor, pieces: list[Any], rank_of: Mapping[str, int], reader: Any, buf: bytearray) -> None:
    """`IntegrityError` unless every piece (one selection of `gt`, on several ranks) hashes the same."""
    digests: dict[str, list[int]] = {}
    for p in pieces:
        h = hashlib.blake2b(digest_size=16)
        f = str(p.info.file)
        for at in range(0, p.info.nbytes, BLOCK):
            view = memoryview(buf)[:min(BLOCK, p.info.nbytes - at)]
            reader(f).pread(view, p.info.start + at)
            h.update(view)
        digests.setdefault(h.hexdigest(), []).append(rank_of[f])
    if len(digests) > 1:
        groups = sorted(digests.values(), key=lambda rs: (-len(rs), rs))
        raise IntegrityError(f"tensor {gt.name!r}: its replicated copies differ: ranks {_ranks(groups[0])} hold one, "
                             + ", ".join(f"ranks {_ranks(g)} another" for g in groups[1:]) + f": {_FIX}")


def check_shapes(shards: PiecedSource, config: dict[str, Any] | None, names: Mapping[str, str] | None = None) -> None:
    """Each tensor's global shape is the one transformers' model of `config` gives it (where it can say)."""
    tensors = shards.global_tensors()
    own = names if names is not None else {n: n for n in tensors}
    expected = model_shapes(config, own.values())
    for name, model_name in own.items():
        want = expected.get(model_name)
        if want is not None and tuple(tensors[name].shape) != want:
            raise CheckpointError(f"{shards.root}: tensor {name!r} has global shape {list(tensors[name].shape)} in its "
                                  f"pieces, but config.json ({config['model_type']}) implies {list(want)}: the pieces "  # type: ignore[index]
                                  "understate it, or are of another model; nothing merged")


def _brief(d: Mapping[str, Any]) -> str:
    return f"{d.get('kind')} of global shape {d.get('shape')}, selecting {d.get('select')}"


def _ranks(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)]"


__all__ = ["check_merge", "check_plan", "check_replicas", "check_shapes"]
