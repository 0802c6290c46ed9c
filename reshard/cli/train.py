"""Train the bundled model with tensor and data parallelism: `torchrun --nproc-per-node 2 -m reshard.cli.train ...`.

world = dp x fsdp x tp (`--dp`, `--fsdp`, tp innermost); gloo on CPU, NCCL when CUDA is present. Every
rank builds its model on the meta device (at fsdp > 1 sharded there with `fully_shard`,
`reshard.trainer.fsdp`) and fills it from its rank file of fsdp x tp (a directory, or the service's
URL; a source of another layout is cut as it is read); the data is
byte-level tokens of a text file, sample i a pure function of (seed, i), the global batch split across
the dp x fsdp data ranks (`reshard.trainer.loop`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from reshard.errors import ReshardError, missing_dependency, require

try:
    import torch
    import torch.distributed as dist
except ModuleNotFoundError as e:  # run as the trainer without torch: one line, not a traceback
    if __name__ != "__main__" or e.name != "torch":
        raise
    sys.exit(f"reshard.cli.train: error: {missing_dependency('torch', 'the trainer (python -m reshard.cli.train)')}")

from reshard import enable_import_cache
from reshard.settings import library_settings
from reshard.trainer.build import build_model
from reshard.trainer.cursor import local_share
from reshard.trainer.fsdp import shard_layers
from reshard.trainer.groups import DataTensorGroups, all_gather_json, make_groups
from reshard.trainer.loop import LoopOptions, RunState, StepRecord, train_steps
from reshard.trainer.peers import stop_peers_on_failure
from reshard.trainer.resume import build_options, start_step, training_state
from reshard.trainer.schedule import check_schedule, make_optimizer, make_scheduler
from reshard.trainer.snapshot import every_n_steps, save_checkpoint

T_START = time.time()


def default_data() -> Path:
    return Path(str(resources.files("reshard.trainer") / "data" / "alice.txt"))


def load_tokens(path: Path, vocab_size: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
    if vocab_size < 256:
        raise ReshardError(f"byte-level tokens need vocab_size >= 256, the model has {vocab_size}")
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m reshard.cli.train", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--shards", help="directory of rank shards, or the service's checkpoint URL")
    src.add_argument("--resume", help="continue from a training checkpoint (DIR or DIR/step-N; weights only: "
                                      "fresh optimizer); --steps stays the run's total")
    p.add_argument("--data", type=Path, default=None, help="text file (byte-level tokens); default: bundled text")
    p.add_argument("--steps", type=int, default=20, help="the run's total optimizer steps")
    p.add_argument("--save", type=Path, help="write the training state here at the end (a checkpoint)")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint to SAVE/step-N every N steps")
    p.add_argument("--keep", type=int, default=0, metavar="K", help="keep only the last K SAVE/step-N (0: all)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warmup from 0 to --lr")
    p.add_argument("--min-lr", type=float, default=None, help="cosine decay to this lr at the last step (default: --lr)")
    p.add_argument("--max-norm", type=float, default=None,
                   help="clip gradients to this global norm (the unsharded model's; default: no clipping)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas; tp = world size // (dp x fsdp)")
    p.add_argument("--fsdp", type=int, default=1,
                   help="shard parameters and optimizer state over this many ranks (torch's fully_shard)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="global batch, split evenly across the dp x fsdp data ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "keep"], default="float32",
                   help="parameter dtype for training (keep: as stored in the shards)")
    p.add_argument("--metrics", type=Path, help="rank 0 writes a JSON summary (losses, timings, bytes) here")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: torch default)")
    args = p.parse_args(argv)
    if args.save_every and not args.save:
        p.error("--save-every needs --save DIR")
    return args


def _setup(args: argparse.Namespace) -> tuple[DataTensorGroups, torch.device]:
    """Join the process group (under torchrun) and make the dp x tp groups; the device."""
    cuda = torch.cuda.is_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    data = args.dp * args.fsdp
    if args.fsdp > 1 and args.batch_size % data:
        raise ReshardError(f"--batch-size {args.batch_size} is the global batch, split across --dp {args.dp} x --fsdp "
                           f"{args.fsdp} = {data} data ranks; pick a multiple of {data}")
    local_share(args.batch_size, data, 0)  # refuse a global batch the data ranks cannot share, before any work
    groups = make_groups(args.dp, world=world, rank=rank, fsdp=args.fsdp, device_type="cuda" if cuda else "cpu")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return groups, device


def train(args: argparse.Namespace) -> dict[str, Any]:
    t0 = library_settings().t0 or T_START
    check_schedule(steps=args.steps, warmup=args.warmup, lr=args.lr, min_lr=args.min_lr)
    groups, device = _setup(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(args.seed)
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    source = str(args.resume or args.shards)
    saved = training_state(source) if args.resume else None
    model = build_model(source, device=device, dtype=dtype, group=groups.tp_group, layout=groups.files,
                        rank=groups.file_rank, shard=shard_layers(groups) if groups.fsdp > 1 else None,
                        **build_options(saved, groups.file_rank, groups.files))
    t_loaded = time.time()
    tokens = load_tokens(args.data or default_data(), model.config.vocab_size)
    optimizer = make_optimizer(model, lr=args.lr)
    scheduler = make_scheduler(optimizer, steps=args.steps, warmup=args.warmup, min_lr=args.min_lr)
    state = RunState(seed=args.seed)
    state.step, extra = start_step(saved, args.resume, model, optimizer, scheduler=scheduler, seed=args.seed,
                                   say=rank == 0)
    state.samples, state.seed = int(extra.get("samples", 0)), int(extra.get("seed", args.seed))
    first_step, t_first = state.step + 1, []
    saving = args.save is not None and groups.dp_rank == 0  # the dp replicas hold the same state: the first saves it

    def checkpoint(out: Path, step: int, *, every: int = 0, keep: int = 0) -> None:
        kw: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                              "group": groups.shard_group,  # the fsdp x tp ranks of the first replica
                              "extra": {"seed": state.seed, "samples": state.samples, "dp": groups.dp}}
        if every:
            every_n_steps(out, every=every, keep=keep, step=step, **kw)
        else:
            save_checkpoint(out, step=step, **kw)

    def on_step(rec: StepRecord) -> None:
        t_first.append(time.time())
        if rank == 0:
            extra = f"  (time to first step {t_first[0] - t0:.2f} s)" if len(t_first) == 1 else ""
            norm = f"  grad norm {rec.grad_norm:.4f}" if rec.grad_norm is not None else ""
            print(f"step {rec.step:>4}/{args.steps}  loss {rec.loss:.4f}  lr {rec.lr:.3g}{norm}{extra}", flush=True)
        if saving and args.save_every:
            checkpoint(args.save, rec.step, every=args.save_every, keep=args.keep)

    records = train_steps(model, optimizer, scheduler, state, tokens, groups=groups, options=LoopOptions(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, max_norm=args.max_norm, on_step=on_step))
    if saving:
        checkpoint(args.save, state.step)
    return _summary(args, model, groups, records, state, first_step=first_step, source=source,
                    times=(t0, t_loaded, t_first[0] if t_first else None), device=device, rank=rank)


def _summary(args: argparse.Namespace, model: torch.nn.Module, groups: DataTensorGroups, records: list[StepRecord],
             state: RunState, *, first_step: int, source: str, times: tuple[float, float, float | None],
             device: torch.device, rank: int) -> dict[str, Any]:
    """What this run did (`--metrics`): written by rank 0, returned by every rank."""
    t0, t_loaded, t_first = times
    per_rank = all_gather_json(model.rank_header.total, None, device=device)
    if dist.is_initialized():
        dist.barrier()
    summary = {
        "tp": groups.tp, "layout": groups.layout, "steps": args.steps, "first_step": first_step,
        "resumed_from": source if args.resume else None,
        "losses": [r.loss for r in records], "lrs": [r.lr for r in records],
        "grad_norms": [r.grad_norm for r in records] if args.max_norm is not None else None,
        "final_lr": records[-1].lr if records else None, "samples": state.samples,
        "time_to_first_step_s": (t_first - t0) if t_first else None, "load_s": t_loaded - t0,
        "shard_bytes_per_rank": per_rank, "saved": str(args.save) if args.save else None,
    }
    if rank == 0 and args.metrics:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        args.metrics.write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    enable_import_cache()  # before the model build imports transformers
    args = parse_args(argv)
    try:
        require("transformers", what="the trainer (python -m reshard.cli.train)")
        with stop_peers_on_failure(prog="reshard.cli.train"):  # a rank that fails stops the others too
            train(args)
    except ReshardError as e:
        print(f"reshard.cli.train: error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
