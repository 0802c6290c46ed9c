"""One side of `bench/compare_checkpoint.py`: the training-state saves under torchrun, or one resume at tp=1.

    torchrun --nproc-per-node 2 -m bench.checkpoint_worker save SHARDS WORK --reps N --steps S
    python -m bench.checkpoint_worker resume-reshard|resume-dcp WORK OUT.json

`save` (every rank of a tp=2 gloo group): the bundled trainer's model filled from SHARDS, S training steps
(so AdamW's moments exist), then rounds of the saves of the same state, interleaved, each timed between two
barriers and sampled for this rank's RssAnon: reshard's `save_checkpoint`, `dcp.save` of the same tensors
as DTensors placed as the rank header says (Shard(d) where the rank holds a slice of dim d, else
Replicate), `dcp.save` of plain tensors under per-rank keys (each rank its own, no resharding possible)
and `dcp.async_save` of the DTensors (the time until it returns, and until its future is done). Each rank
writes `WORK/save-rank-R.json`; the last round's reshard and DTensor checkpoints stay for the resumes.

`resume-*` (one process, tp=1): reshard's `build_model` (cutting as it reads) + `restore_training` on the tp=2
checkpoint, or `dcp.load` into DTensors of the tp=1 layout on a 1-rank mesh. It writes to OUT.json
the seconds, this process's RssAnon before and at its peak, and a sha256 of every loaded tensor (the
two must agree).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

from bench.measure import Sampler

MiB = 1 << 20
RESHARD, DCP_DT, DCP_PLAIN, DCP_ASYNC = "reshard save_checkpoint", "dcp.save (DTensor)", "dcp.save (plain, per rank)", \
    "dcp.async_save (DTensor)"
CKPT = {RESHARD: "reshard-ckpt", DCP_DT: "dcp-dtensor", DCP_PLAIN: "dcp-plain", DCP_ASYNC: "dcp-async"}


def placement(spec: dict[str, Any], tp: int, rank: int) -> Shard | Replicate:
    """The DTensor placement of a rank-file tensor: Shard(d) where the rank holds its even slice of dim d."""
    cut = [d for d, (ivs, size) in enumerate(zip(spec["select"], spec["shape"], strict=True))
           if [list(iv) for iv in ivs] != [[0, size]]]
    if not cut:
        return Replicate()
    d, size = cut[0], spec["shape"][cut[0]]
    if len(cut) > 1 or size % tp or [list(iv) for iv in spec["select"][d]] != [[rank * size // tp, (rank + 1) * size // tp]]:
        raise SystemExit(f"{spec}: not one even slice of one dim at tp={tp}: no DTensor placement says it; "
                         "pick a model whose sizes tp divides (no padding, no packed tensors)")
    return Shard(d)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """Every tensor a training checkpoint holds, under its rank-file name, with its parameter's spec."""
    from reshard.format.rank_file import OPTIMIZER_SLOTS, optimizer_tensor_name
    from reshard.trainer.names import shard_targets
    from reshard.trainer.snapshot import moment_targets

    specs = model.rank_header.tensors
    out = {n: (t, specs[n]) for n, t in shard_targets(model, specs).items()}
    for slot in OPTIMIZER_SLOTS:
        out.update({optimizer_tensor_name(n, slot): (t, specs[n]) for n, t in moment_targets(model, optimizer, slot).items()})
    return out


def dtensors(tensors: dict[str, tuple[torch.Tensor, dict[str, Any]]], mesh: Any, tp: int, rank: int) -> dict[str, DTensor]:
    out = {}
    for name, (local, spec) in tensors.items():
        shape = torch.Size(spec["shape"])
        out[name] = DTensor.from_local(local.detach(), mesh, [placement(spec, tp, rank)], run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
    return out


def timed(op: Callable[[], Any], *, barrier: bool) -> dict[str, float]:
    """Seconds of `op` (between barriers when distributed), this process's RssAnon before and at its peak."""
    if barrier:
        dist.barrier()
    with Sampler({"self": os.getpid()}, interval=0.01) as s:
        t0 = time.perf_counter()
        op()
        if barrier:
            dist.barrier()
        wall = time.perf_counter() - t0
    s.sample()
    return {"s": wall, "rss_before_mib": s.base["self"] / MiB, "rss_peak_mib": max(s.peak["self"], s.base["self"]) / MiB}


def _trained(shards: str, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    from reshard.cli.train import default_data, load_tokens
    from reshard.trainer.build import build_model
    from reshard.trainer.groups import make_groups
    from reshard.trainer.loop import LoopOptions, RunState, train_steps
    from reshard.trainer.schedule import make_optimizer, make_scheduler

    groups = make_groups(1, world=dist.get_world_size(), rank=dist.get_rank())
    model = build_model(shards, dtype=torch.float32, group=groups.tp_group)
    optimizer = make_optimizer(model, lr=1e-3)
    scheduler = make_scheduler(optimizer, steps=steps + 1, warmup=1)
    tokens = load_tokens(default_data(), model.config.vocab_size)
    train_steps(model, optimizer, scheduler, RunState(seed=0), tokens, groups=groups,
                options=LoopOptions(steps=steps, batch_size=2, seq_len=32, max_norm=1.0))
    return model, optimizer, scheduler


def _timed_rank_files(spent: list[float]) -> None:
    """Where reshard's save time goes: the seconds in `write_rank_file` (write + sha256 + fsync) into `spent`."""
    import reshard.trainer.snapshot as snapshot

    real = snapshot.write_rank_file

    def write_rank_file(*args: Any) -> str:
        t0 = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent.append(time.perf_counter() - t0)

    snapshot.write_rank_file = write_rank_file


def hash_seconds(tensors: dict[str, tuple[torch.Tensor, dict[str, Any]]]) -> float:
    """The seconds sha256 of this rank's share alone takes (what reshard's save does beyond writing)."""
    from reshard.fill.into_params import byte_view

    t0, sha = time.perf_counter(), hashlib.sha256()
    for t, _ in tensors.values():
        sha.update(byte_view(t.detach().contiguous()))
    return time.perf_counter() - t0


def save_job(shards: str, work: Path, *, reps: int, steps: int) -> None:
    from reshard.trainer.snapshot import save_checkpoint

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, optimizer, scheduler = _trained(shards, steps)
    tensors = state_tensors(model, optimizer)
    mesh = init_device_mesh("cpu", (tp,))
    dt = dtensors(tensors, mesh, tp, rank)
    plain = {f"rank{rank}/{n}": t.detach() for n, (t, _) in tensors.items()}
    pending: list[Any] = []
    background = dist.new_group(backend="gloo")  # the saving thread's collectives, apart from the main thread's

    def async_save() -> None:
        pending.append(dcp.async_save(dt, storage_writer=dcp.FileSystemWriter(work / CKPT[DCP_ASYNC]),
                                      process_group=background))

    ops = {RESHARD: lambda: save_checkpoint(work / CKPT[RESHARD], model, optimizer, step=steps, scheduler=scheduler),
           DCP_DT: lambda: dcp.save(dt, storage_writer=dcp.FileSystemWriter(work / CKPT[DCP_DT])),
           DCP_PLAIN: lambda: dcp.save(plain, storage_writer=dcp.FileSystemWriter(work / CKPT[DCP_PLAIN])),
           DCP_ASYNC: async_save}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ops}
    spent: list[float] = []
    _timed_rank_files(spent)
    for r in range(reps + 1):  # round 0: the warm-up
        for name, op in ops.items():
            if rank == 0:
                shutil.rmtree(work / CKPT[name], ignore_errors=True)
                os.sync()  # the previous case's dirty pages written back outside the timing
            spent.clear()
            rec = timed(op, barrier=True)
            if name == RESHARD:
                rec["rank_files_s"] = sum(spent)
            if name == DCP_ASYNC:
                done = timed(lambda: pending.pop().result(), barrier=True)
                rec.update(blocking_s=rec["s"], s=rec["s"] + done["s"], rss_peak_mib=max(rec["rss_peak_mib"], done["rss_peak_mib"]))
            if r:
                runs[name].append(rec)
    share = sum(t.numel() * t.element_size() for t, _ in tensors.values())
    (work / f"save-rank-{rank}.json").write_text(json.dumps({"rank": rank, "tp": tp, "share_bytes": share, "runs": runs,
                                                                "sha256_s": hash_seconds(tensors)}))
    shutil.rmtree(work / CKPT[DCP_ASYNC], ignore_errors=True) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16] for n, t in sorted(tensors.items())}


def import_model_code() -> None:
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401

    transformers.AutoModelForCausalLM  # noqa: B018  (its lazy module resolved)


def resume_reshard(work: Path) -> dict[str, Any]:
    from reshard.trainer.build import build_model
    from reshard.trainer.resume import restore_training, training_state
    from reshard.trainer.schedule import make_optimizer

    import_model_code()  # what a trainer has imported before it loads (DCP's side imported its code at the top)
    src = work / CKPT[RESHARD]
    got: dict[str, Any] = {}

    def load() -> None:
        t0 = time.perf_counter()
        state = training_state(src)
        model = build_model(src, dtype=torch.float32)  # a tp=2 checkpoint, cut to tp=1 as read
        got["build_s"] = time.perf_counter() - t0
        optimizer = make_optimizer(model, lr=1e-3)
        restore_training(state, src, model, optimizer)
        got["model"], got["optimizer"] = model, optimizer

    rec = timed(load, barrier=False)
    rec["build_s"] = got["build_s"]
    tensors = {n: t for n, (t, _) in state_tensors(got["model"], got["optimizer"]).items()}
    return {**rec, "share_bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "sha256": digest(tensors)}


def saved_specs(src: Path) -> dict[str, dict[str, Any]]:
    """Name -> spec of every tensor of a reshard checkpoint (rank 0's headers: the global shapes)."""
    from safetensors import safe_open

    from reshard.format.rank_file import (
        OPTIMIZER_SLOTS,
        decode_metadata,
        optimizer_tensor_name,
        rank_file_name,
    )

    name = rank_file_name(0, 2)
    with safe_open(str(src / name), "pt") as f:
        specs = decode_metadata(f.metadata(), name).tensors
    return {**specs, **{optimizer_tensor_name(n, s): v for s in OPTIMIZER_SLOTS for n, v in specs.items()}}


def resume_dcp(work: Path) -> dict[str, Any]:
    from reshard.testing.local_servers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    specs = saved_specs(work / CKPT[RESHARD])
    got: dict[str, Any] = {}

    def load() -> None:
        sd = {n: DTensor.from_local(torch.empty(spec["shape"]), mesh, [Shard(0)], run_check=False) for n, spec in specs.items()}
        dcp.load(sd, storage_reader=dcp.FileSystemReader(work / CKPT[DCP_DT]))
        got["sd"] = sd

    rec = timed(load, barrier=False)
    tensors = {n: t.to_local() for n, t in got["sd"].items()}
    dist.destroy_process_group()
    return {**rec, "share_bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "sha256": digest(tensors)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save"]:
        reps, steps = int(argv[argv.index("--reps") + 1]), int(argv[argv.index("--steps") + 1])
        save_job(argv[1], Path(argv[2]), reps=reps, steps=steps)
        return 0
    if argv[:1] in (["resume-reshard"], ["resume-dcp"]):
        torch.set_num_threads(1)
        run = resume_reshard if argv[0] == "resume-reshard" else resume_dcp
        Path(argv[2]).write_text(json.dumps(run(Path(argv[1]))))
        return 0
    raise SystemExit("usage: python -m bench.checkpoint_worker save SHARDS WORK --reps N --steps S | "
                     "resume-reshard|resume-dcp WORK OUT.json")


if __name__ == "__main__":
    sys.exit(main())
