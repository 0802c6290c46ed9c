"""A vLLM model's parameters filled from this rank's shard: vLLM's own name mapping, no narrowing.

vLLM's default loader hands every rank each full checkpoint tensor; `model.load_weights` maps its name
to a parameter (stacking q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, experts into `w13`/`w2`)
and the parameter's `weight_loader` narrows it by `tp_rank`. Here the tensors are this rank's slices
already, so for the duration of one `model.load_weights` call every parameter's `weight_loader` is
replaced by a `PreSharded` one: it finds the same place in the parameter that vLLM's loader would
(`qkv_proj`'s "k" block, expert 3's gate half of `w13_weight`), checks that the slice fits it exactly,
and copies. Afterwards every parameter must have been filled whole, once: anything else is one
`PlanError` naming the parameters. The original loaders are put back, so vLLM's own reloads work.

A shard's header says what it holds before a byte of it is read, and nothing it declares is allocated
before it was compared with its destination: `model.load_weights` first runs on tensors of the
declared shapes on the meta device (no memory), which finds each one's place and checks its shape, and
that every parameter is filled whole, with nothing copied; only then are the tensors read, one at a
time, each already known to fit (a tensor vLLM does not ask for is read past, never allocated). The
bytes are hashed as they arrive and checked against the sha256 of `reshard.json` beside rank files or
the service's digest for its answer (`iter_tensors`) before the last tensor is handed to vLLM.

A quantized model in a packed format reshard cuts (GPTQ, AWQ, compressed-tensors int4, NVFP4 from ModelOpt
or compressed-tensors, gpt-oss' MXFP4: `packed_format`) is filled the same way (gpt-oss' experts and sinks,
which its `load_weights` narrows itself, through gpt_oss.py): its packed parameters take the shard's packed
tensors as stored (places.py), the shard must hold that format's tensors and no other, and the attention's
KV-cache scales vLLM adds to a quantized model may stay as vLLM made them when the checkpoint has none (as
its default loader leaves them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reshard.errors import CheckpointError, ManifestError, PlanError, ReshardError
from reshard.fill.into_params import RankHeader, iter_tensors, read_header_from
from reshard.fill.open import open_rank_stream
from reshard.format.torch_side import TORCH_DTYPES
from reshard.integrations.vllm.gpt_oss import take_over
from reshard.integrations.vllm.places import place_for
from reshard.rules.engines import VLLM_VOCAB_ALIGN, is_vocab_split
from reshard.rules.quant.scheme import QuantScheme, scheme_from_config, scheme_of_kind

_LIST = 6  # names shown per list in an error
_FP8 = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})


@dataclass
class VllmFillReport:
    """What `fill_vllm_model` did: shard tensors loaded, vLLM parameters filled, bytes, seconds."""

    source: str
    rank: int
    tp: int
    tensors: int
    parameters: int
    bytes: int
    seconds: float
    skipped: list[str] = field(default_factory=list)  # shard tensors vLLM's load_weights did not ask for

    def __str__(self) -> str:
        skipped = f"; vLLM skipped {len(self.skipped)} ({', '.join(self.skipped[:_LIST])})" if self.skipped else ""
        return (f"reshard: filled {self.parameters} vLLM parameters from {self.tensors} tensors, "
                f"{self.bytes / 1e6:.1f} MB from {self.source} (rank {self.rank} of tp={self.tp}) "
                f"in {self.seconds:.2f} s{skipped}")


class _Ledger:
    """Which shard tensor is being loaded, and how much of each parameter has been written."""

    def __init__(self, params: dict[int, tuple[str, nn.Parameter]]) -> None:
        self.params = params
        self.current = ""
        self.written: dict[int, int] = {}
        self.regions: dict[int, set[Any]] = {}
        self.used: set[str] = set()

    def record(self, param: nn.Parameter, region: Any, numel: int) -> None:
        name = self.params[id(param)][0]
        seen = self.regions.setdefault(id(param), set())
        if region in seen:
            raise PlanError(f"{self.current}: {name} (block {region!r}) was filled twice; the shard has two tensors "
                            "for one place in vLLM's model")
        seen.add(region)
        whole = isinstance(region, tuple) and region[:1] == ("whole",)  # fills all of it (places.py), padding too
        self.written[id(param)] = _want(param) if whole else self.written.get(id(param), 0) + numel
        self.used.add(self.current)

    def unfilled(self, optional: Collection[int] = ()) -> list[str]:
        """The parameters not filled whole; those in `optional` may also be left as vLLM made them."""
        out = []
        for pid, (name, p) in self.params.items():
            want = _want(p)
            got = self.written.get(pid, 0)
            if got != want and not (got == 0 and pid in optional):
                out.append(f"{name} ({got} of {want} elements)")
        return out


def _want(p: nn.Parameter) -> int:
    return int(getattr(p, "weight_loader_numel", p.numel()))


def _named_params(model: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    """Each parameter once (a tied lm_head shares embed_tokens' parameter), by identity."""
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (name, p))
    return out


def _loader_key(p: nn.Parameter) -> str:
    """Where a parameter keeps its weight_loader: vLLM's quantized parameters (`BasevLLMParameter`) behind a
    property, in `_weight_loader`; the others as a plain attribute."""
    return "_weight_loader" if "_weight_loader" in p.__dict__ else "weight_loader"


def _install(params: dict[int, tuple[str, nn.Parameter]], ledger: _Ledger) -> dict[int, Any]:
    """Swap every parameter's weight_loader for a pre-sharded one; the originals, to put back."""
    originals: dict[int, Any] = {}
    for pid, (name, p) in params.items():
        key = _loader_key(p)
        originals[pid] = key, p.__dict__.get(key, _ABSENT)
        p.__dict__[key] = PreSharded(name, p, getattr(p, "weight_loader", None), ledger)
    return originals


_ABSENT = object()


def _restore(params: dict[int, tuple[str, nn.Parameter]], originals: dict[int, Any]) -> None:
    for pid, (_name, p) in params.items():
        key, old = originals[pid]
        if old is _ABSENT:
            p.__dict__.pop(key, None)
        else:
            p.__dict__[key] = old


def _optional(model: nn.Module) -> set[int]:
    """Parameters a checkpoint may leave out: the KV-cache and attention quantization scales a quantized
    layer's attention gets (vLLM keeps its own values when the checkpoint has none)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return {id(p) for m in model.modules() if isinstance(getattr(m, "quant_method", None), BaseKVCacheMethod)
            for p in m.parameters(recurse=False)}


class PreSharded:
    """A parameter's weight_loader for tensors that are this rank's slice already (see the module docstring)."""

    def __init__(self, name: str, param: nn.Parameter, original: Callable[..., Any] | None, ledger: _Ledger) -> None:
        self.name, self.ledger = name, ledger
        self.place = place_for(name, param, original)

    def __call__(self, param: nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Called as vLLM calls the loader it stands for: `(param, loaded_weight[, shard_id])`, or for fused
        experts `(param, loaded_weight, weight_name, shard_id, expert_id[, return_success])`, by position or
        by keyword."""
        loaded = loaded_weight
        shard_id = kwargs.get("shard_id", kwargs.get("loaded_shard_id"))
        expert_id, success = kwargs.get("expert_id"), kwargs.get("return_success", False)
        if self.place.moe and len(args) >= 3:  # (weight_name, shard_id, expert_id[, return_success])
            shard_id, expert_id = args[1], args[2]
            success = args[3] if len(args) > 3 else success
        elif args and shard_id is None:
            shard_id = args[0]
        dest, region = self.place(param, loaded, shard_id, expert_id)
        if dest is None:  # an expert another rank holds (expert parallelism)
            return False if success else None
        if tuple(dest.shape) != tuple(loaded.shape):
            raise PlanError(
                f"{self.ledger.current}: has shape {list(loaded.shape)} in the shard, but its place in vLLM's "
                f"{self.name} (block {region!r}) has shape {list(dest.shape)}: the shard was cut for another "
                f"engine; pull it with engine=vllm (reshard write --engine vllm) or fix the stored rules")
        if not loaded.is_meta:  # a rehearsal's tensor (`_rehearse`) has no bytes to copy
            with torch.no_grad():
                dest.copy_(loaded)
        self.ledger.record(param, region, dest.numel())
        return True if success else None


# the packed formats whose vLLM parameters the places fill (checked against vLLM's loaders: tests/vllm/test_int4.py,
# tests/vllm/test_fp4.py)
VLLM_PACKED = ("gptq", "awq", "pack-quantized", "nvfp4", "nvfp4-ct", "mxfp4")
_VLLM_METHODS = {"gpt_oss_mxfp4": "mxfp4"}  # vLLM's names for a checkpoint's quant_method (it rewrites gpt-oss')


def packed_format(quantization: str | None, quantization_config: Any) -> QuantScheme | None:
    """The packed format (`QuantScheme` with parts: GPTQ, AWQ, compressed-tensors int4, ...) of a checkpoint
    vLLM calls `quantization`, from its config.json `quantization_config`; None for an unquantized one. A
    quantization reshard does not cut into vLLM's packed parameters (FP8, int8, an unknown method) is one
    error naming it."""
    if quantization is None:
        return None
    qc = quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else quantization_config
    if isinstance(qc, dict) and qc.get("quant_method") in _VLLM_METHODS:
        qc = {**qc, "quant_method": _VLLM_METHODS[qc["quant_method"]]}
    why = ""
    try:
        scheme = scheme_from_config({"quantization_config": qc}) if isinstance(qc, dict) else None
    except ManifestError as e:
        scheme, why = None, f" ({e})"
    if scheme is None or scheme.packed.name not in VLLM_PACKED:
        why = why or ("" if scheme is None else f" ({scheme.packed.description or scheme.packed.name})")
        raise ReshardError(f"load_format='reshard' loads unquantized checkpoints and the packed formats "
                           f"{', '.join(VLLM_PACKED)}; this one is {quantization!r}{why}: use load_format='auto'")
    return scheme.packed


def _check_packed(header: RankHeader, packed: QuantScheme | None, name: str) -> None:
    """The shard holds the packed format vLLM's model was built for, and no other."""
    held = {q.name: q for d in header.tensors.values() if (q := scheme_of_kind(str(d.get("kind")))) is not None}
    if packed is not None and packed.name not in held:
        raise CheckpointError(f"{name}: vLLM's model holds {packed.description}, but the shard has none of its "
                              "tensors: it was written from another checkpoint; nothing was loaded")
    other = sorted(set(held) - {packed.name if packed else ""})
    if other:
        raise CheckpointError(f"{name}: the shard holds {held[other[0]].description}, which vLLM's model was not "
                              "built for: give vLLM the checkpoint's config.json with its quantization_config "
                              "(reshard pull URL --meta); nothing was loaded")


def _check_header(header: RankHeader, rank: int, tp: int, name: str) -> None:
    if not header.layout.tp_only:
        raise CheckpointError(f"{name}: is a shard of {header.layout.describe()}; vLLM workers load tensor-parallel "
                              f"shards: write them with `reshard write CKPT --tp {tp} --engine vllm -o DIR`; nothing "
                              "was loaded")
    if (header.tp, header.rank) != (tp, rank):
        raise CheckpointError(f"{name}: is the shard of rank {header.rank} of tp={header.tp}, but this vLLM worker is "
                              f"rank {rank} of tensor_parallel_size={tp}; give it rank {rank}'s shard of tp={tp} "
                              f"(reshard write CKPT --tp {tp} --engine vllm -o DIR); nothing was loaded")
    fp8 = sorted(n for n, e in header.entries.items() if e["dtype"] in _FP8 and not _packed_kind(header, n))
    if fp8:
        raise CheckpointError(f"{name}: {fp8[0]} (and {len(fp8) - 1} more) is FP8; load_format='reshard' loads "
                              "unquantized checkpoints only (FP8 needs vLLM's quantized parameters): use "
                              "load_format='auto' for FP8 checkpoints")
    misfit = [n for n, d in header.tensors.items() if _vocab_unaligned(d)]
    if misfit:
        raise CheckpointError(
            f"{name}: {misfit[0]} was cut with transformers' vocabulary split, not vLLM's (padded to a multiple of "
            f"{VLLM_VOCAB_ALIGN}, then split evenly); write the rank files with `reshard write CKPT --tp {tp} "
            f"--engine vllm -o DIR` (or pull with engine=vllm); nothing was loaded")


def _packed_kind(header: RankHeader, name: str) -> bool:
    """A tensor of a packed format the plugin fills (NVFP4's F8_E4M3 group scales), not an FP8 weight."""
    scheme = scheme_of_kind(str(header.tensors.get(name, {}).get("kind")))
    return scheme is not None and scheme.name in VLLM_PACKED


def _vocab_unaligned(desc: dict[str, Any]) -> bool:
    options = desc.get("options") or {}
    return is_vocab_split(str(desc.get("kind")), options) and options.get("align") != VLLM_VOCAB_ALIGN


def fill_vllm_model(model: nn.Module, source: str | Path, *, rank: int, tp: int, token: str | None = None,
                    rules: str | None = None, packed: QuantScheme | None = None) -> VllmFillReport:
    """Fill `model` (built by vLLM, not yet loaded) with rank `rank` of `tp`'s shard of `source`: the
    service's checkpoint URL (asked for `engine=vllm`) or a directory of rank files `reshard write
    --engine vllm` wrote. `packed`: the packed format vLLM's model holds (`packed_format`), None for an
    unquantized model. See the module docstring."""
    t0 = time.perf_counter()
    _config, chunks, sha, name = open_rank_stream(source, rank, tp, token=token, need_config=False,
                                                  rules=rules, engine="vllm")
    header, leftover = read_header_from(chunks, name)
    _check_header(header, rank, tp, name)
    _check_packed(header, packed, name)
    params = _named_params(model)
    asked = _rehearse(model, params, header, name)
    ledger = _Ledger(params)
    seen: list[str] = []
    _load(model, params, ledger, _tracked(iter_tensors(header, chunks, sha256=sha, leftover=leftover, only=asked),
                                          ledger, seen))
    _check_filled(ledger, model, name)
    report = VllmFillReport(name, rank, tp, len(seen), len(params), header.total, time.perf_counter() - t0,
                            skipped=[n for n in header.entries if n not in asked])
    model.reshard_fill_report = report  # for whoever asks the worker (collective_rpc), as vLLM keeps the model
    return report


def _rehearse(model: nn.Module, params: dict[int, tuple[str, nn.Parameter]], header: RankHeader, name: str) -> set[str]:
    """`model.load_weights` on meta tensors of the shapes the shard declares: each one's place found and its
    shape checked, every parameter covered, nothing allocated, read or copied. The names vLLM asked for."""
    ledger = _Ledger(params)
    order = sorted(header.entries.items(), key=lambda kv: kv[1]["data_offsets"][0])
    declared = ((n, torch.empty(e["shape"], dtype=TORCH_DTYPES[e["dtype"]], device="meta")) for n, e in order)
    _load(model, params, ledger, _tracked(declared, ledger, []))
    _check_filled(ledger, model, name, "; nothing was loaded")
    return ledger.used


def _load(model: nn.Module, params: dict[int, tuple[str, nn.Parameter]], ledger: _Ledger,
          pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`model.load_weights(pairs)` with every parameter's loader a `PreSharded` one, the originals put back."""
    originals = _install(params, ledger)
    try:
        model.load_weights(take_over(model, pairs))
    finally:
        _restore(params, originals)


def _check_filled(ledger: _Ledger, model: nn.Module, name: str, then: str = "") -> None:
    unfilled = ledger.unfilled(_optional(model))
    if unfilled:
        raise PlanError(f"{name}: {len(unfilled)} vLLM parameters were not filled whole by the shard: "
                        f"{', '.join(unfilled[:_LIST])}; the shard and vLLM's model disagree (another checkpoint, "
                        f"or rules that leave these tensors out){then}")


def _tracked(pairs: Iterable[tuple[str, torch.Tensor]], ledger: _Ledger, seen: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in pairs:
        ledger.current = name
        seen.append(name)
        yield name, t
