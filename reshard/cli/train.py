"""Train the bundled model with tensor parallelism: `torchrun --nproc-per-node 2 -m reshard.cli.train ...`.

tp = world size; gloo on CPU, NCCL when CUDA is present. Every rank builds its model on the meta
device and fills it from its own rank shard (a directory or the service's URL); the data is
byte-level tokens of a text file, the same batches on every rank, deterministic given the seed.
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

import torch
import torch.distributed as dist

from reshard import enable_import_cache
from reshard.errors import ReshardError
from reshard.settings import library_settings
from reshard.trainer.build import build_model
from reshard.trainer.loss import causal_lm_loss
from reshard.trainer.peers import stop_peers_on_failure
from reshard.trainer.resume import build_options, start_step, training_state
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save", type=Path, help="write the training state here at the end (a checkpoint)")
    p.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint to SAVE/step-N every N steps")
    p.add_argument("--keep", type=int, default=0, metavar="K", help="keep only the last K SAVE/step-N (0: all)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "keep"], default="float32",
                   help="parameter dtype for training (keep: as stored in the shards)")
    p.add_argument("--metrics", type=Path, help="rank 0 writes a JSON summary (losses, timings, bytes) here")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: torch default)")
    args = p.parse_args(argv)
    if args.save_every and not args.save:
        p.error("--save-every needs --save DIR")
    return args


def train(args: argparse.Namespace) -> dict[str, Any]:
    t0 = library_settings().t0 or T_START
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    cuda = torch.cuda.is_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    source, tp = str(args.resume or args.shards), dist.get_world_size() if distributed else 1
    state = training_state(source, tp=tp) if args.resume else None
    model = build_model(source, device=device, dtype=dtype, **build_options(state, rank, tp))
    t_loaded = time.time()
    tokens = load_tokens(args.data or default_data(), model.config.vocab_size)
    if len(tokens) <= args.seq_len + 1:
        raise ReshardError(f"{args.data}: {len(tokens)} tokens, fewer than seq-len {args.seq_len} + 2")
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = start_step(state, args.resume, model, opt, generators={"data": gen}, seed=args.seed, say=rank == 0)
    losses: list[float] = []
    t_first = None
    for step in range(start, args.steps):
        starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch_size,), generator=gen)
        window = torch.stack([tokens[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        loss = causal_lm_loss(model, window[:, :-1], window[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if t_first is None:
            t_first = time.time()
        if rank == 0:
            extra = f"  (time to first step {t_first - t0:.2f} s)" if step == 0 else ""
            print(f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.4f}{extra}", flush=True)
        every_n_steps(args.save, every=args.save_every, keep=args.keep, step=step + 1, model=model, optimizer=opt,
                      generators={"data": gen}, extra={"seed": args.seed})
    if args.save:
        save_checkpoint(args.save, model, opt, step=max(start, args.steps), generators={"data": gen},
                        extra={"seed": args.seed})
    received = model.rank_header.total
    per_rank = [None] * dist.get_world_size() if distributed else [received]
    if distributed:
        dist.all_gather_object(per_rank, received)
        dist.barrier()
    summary = {
        "tp": len(per_rank), "steps": args.steps, "first_step": start + 1, "losses": losses,
        "resumed_from": source if args.resume else None,
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
