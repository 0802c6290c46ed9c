"""`reshard demo`: the whole path on one machine, in a few minutes on 2 CPU cores.

generate a checkpoint -> serve it -> 2-rank torchrun job whose workers pull their own shards over
HTTP -> train on the bundled text -> save rank shards -> merge them back -> verify -> summary.
Every process it starts is stopped on success, failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.cli.common import add_json_flag, command, print_json
from reshard.cli.serve import check_port
from reshard.errors import ReshardError
from reshard.format.checkpoint import Checkpoint
from reshard.io.progress import human
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.source.rank_dir import ShardSet

if TYPE_CHECKING:
    import torch

NAME = "demo-llama"


class DemoError(ReshardError):
    """A step of the demo failed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OUT = sys.stdout  # where the demo's account goes: stdout, or stderr under --json (stdout is the JSON summary then)


def say(msg: str = "") -> None:
    print(msg, file=OUT, flush=True)


def step(msg: str) -> None:
    say(f"==> {msg}")


@contextmanager
def process(cmd: list[str], *, log: Path | None = None, env: dict[str, str] | None = None):
    """Start `cmd` in its own process group; on exit stop the whole group."""
    out = open(log, "wb") if log else None
    proc = subprocess.Popen(cmd, stdout=out or None, stderr=subprocess.STDOUT if out else None,
                            env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if out:
            out.close()


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the service exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise DemoError(f"the service did not become healthy in {timeout:.0f} s; see {log}")


def place(full: torch.Tensor, local: torch.Tensor, select: Any) -> None:
    """Put a rank's piece (global indices `select`, padding past the end dropped) into `full`."""
    import torch

    index = []
    for d, dim in enumerate(select):
        idx = torch.cat([torch.arange(a, b) for a, b in dim])
        keep = (idx < full.shape[d]).nonzero().flatten()
        local = local.index_select(d, keep)
        index.append(idx[keep])
    if index:
        full[torch.meshgrid(*index, indexing="ij")] = local
    else:
        full.copy_(local)


def verify_merge(original: Path, trained: Path, merged: Path) -> int:
    """Independent check: every merged tensor equals the trained rank pieces put together with torch,
    and names, shapes and the config match the original checkpoint. Returns the tensor count."""
    import torch
    from safetensors import safe_open

    from reshard.format.torch_side import TORCH_DTYPES

    src, out = Checkpoint.open(original), Checkpoint.open(merged)
    if set(src.tensors) != set(out.tensors):
        raise DemoError(f"merged names differ from the original: {sorted(set(src.tensors) ^ set(out.tensors))[:3]}")
    shards = ShardSet.open(trained)
    for name, gt in shards.tensors.items():
        full = torch.zeros(gt.shape, dtype=torch.float64)
        for piece in gt.pieces:
            with safe_open(piece.info.file, "pt") as f:
                place(full, f.get_tensor(name).double(), piece.select)
        with safe_open(out.tensors[name].file, "pt") as f:
            got = f.get_tensor(name).double()
        if tuple(got.shape) != src.tensors[name].shape or not torch.equal(got, full):
            raise DemoError(f"merged {name} does not match the trained rank shards")
    # the trainer saves in the dtype it trained in, and its config.json says which (trainer.build.with_dtype)
    stored = {str(TORCH_DTYPES[t.dtype]).removeprefix("torch.") for t in out.tensors.values()}
    named = {out.config[k] for k in DTYPE_KEYS if k in out.config}
    if _but_dtype(out.config) != _but_dtype(src.config) or not named <= stored:
        raise DemoError(f"merged config.json differs from the original (its dtype {sorted(named)}, tensors {sorted(stored)})")
    return len(out.tensors)


DTYPE_KEYS = ("dtype", "torch_dtype")


def _but_dtype(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in DTYPE_KEYS}


def ascii_plot(values: list[float], width: int = 60, height: int = 10) -> str:
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    n = min(width, len(values))
    cols = [values[round(i * (len(values) - 1) / max(n - 1, 1))] for i in range(n)]
    rows = []
    for r in range(height, -1, -1):
        level = lo + span * r / height
        line = "".join("*" if abs(v - level) <= span / height / 2 else " " for v in cols)
        rows.append(f"{level:8.3f} |{line}")
    return "\n".join(rows + [" " * 9 + "+" + "-" * len(cols), " " * 10 + f"steps 1..{len(values)}"])


def save_png(values: list[float], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(values) + 1), values, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("reshard demo: tp=2 training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_demo(workdir: Path, *, steps: int, tp: int, preset: str, seq_len: int, batch_size: int, port: int = 0,
             log_level: str | None = None) -> dict[str, Any]:
    """The demo in `workdir`; the service on `port` (0: a free one), at uvicorn's `log_level`."""
    import torch

    from reshard.testing.synth import make_checkpoint, preset_config

    workdir = workdir.resolve()
    ckpt_root = workdir / "checkpoints"
    ckpt = ckpt_root / NAME
    trained, merged, logs = workdir / "trained-shards", workdir / "merged", workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    step(f"1/6 generating a random-weight {preset} Llama checkpoint in {ckpt}")
    make_checkpoint(ckpt, preset_config(preset), dtype=torch.bfloat16, num_files=2, seed=0)
    full_bytes = Checkpoint.open(ckpt).total_bytes()
    say(f"    {human(full_bytes)} of tensors in 2 files + index.json; config.json carries base_model_tp_plan")
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        step(f"2/6 starting the service on {base} (log: {logs / 'serve.log'})")
        serve = stack.enter_context(process(
            [sys.executable, "-m", "reshard.cli", "serve", "--root", str(ckpt_root), "--host", "127.0.0.1",
             "--port", str(port), "--out", str(workdir / "jobs"), *(["--log-level", log_level] if log_level else [])],
            log=logs / "serve.log"))
        wait_healthy(base, serve, logs / "serve.log")
        url = f"{base}/v1/checkpoints/{NAME}"
        step(f"3/6 torchrun: {tp} ranks pull their own shards from {url} and train {steps} steps")
        env = {**os.environ, "RESHARD_T0": f"{time.time():.6f}", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // tp))}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "reshard.cli.train", "--shards", url, "--steps", str(steps),
               "--seq-len", str(seq_len), "--batch-size", str(batch_size), "--save", str(trained),
               "--metrics", str(workdir / "metrics.json")]
        train = stack.enter_context(process(cmd, env=env, log=None if OUT is sys.stdout else logs / "train.log"))
        if train.wait() != 0:
            raise DemoError(f"the torchrun job failed with exit status {train.returncode}")
    step(f"4/6 merging the trained tp={tp} shards into {merged}")
    merge(trained, merged)
    step("5/6 verifying the merge against the rank shards, the original names, shapes and config")
    count = verify_merge(ckpt, trained, merged)
    metrics = json.loads((workdir / "metrics.json").read_text())
    losses = metrics["losses"]
    png = save_png(losses, workdir / "loss.png")
    step("6/6 summary")
    per_rank = metrics["shard_bytes_per_rank"]
    for r, n in enumerate(per_rank):
        say(f"    rank {r} pulled {human(n)} = {n / full_bytes:.1%} of the {human(full_bytes)} checkpoint")
    say(f"    time to first step: {metrics['time_to_first_step_s']:.2f} s (launch to model filled: {metrics['load_s']:.2f} s)")
    say(f"    loss: first {losses[0]:.4f}, last {losses[-1]:.4f} over {len(losses)} steps")
    say(ascii_plot(losses))
    say(f"    merged checkpoint verified: {count} tensors, in {merged}")
    say(f"    outputs: {ckpt} (source), {trained} (trained shards), {merged} (merged), "
          f"{workdir / 'metrics.json'}{', ' + str(png) if png else ''}")
    return {**metrics, "full_bytes": full_bytes, "merged": str(merged), "verified_tensors": count}


def cmd_demo(args: argparse.Namespace) -> int:
    global OUT
    if args.port is not None:
        check_port("127.0.0.1", args.port)
    OUT = sys.stderr if args.json else sys.stdout
    try:
        summary = run_demo(Path(args.workdir), steps=args.steps, tp=args.tp, preset=args.preset, seq_len=args.seq_len,
                           batch_size=args.batch_size, port=args.port or 0, log_level=args.log_level)
    finally:
        OUT = sys.stdout
    if args.json:
        print_json(summary)
    return 0


def add_commands(sub: Any) -> None:
    p = command(sub, "demo", help="end to end: generate, serve, train under torchrun, merge, verify", examples_=(
        "reshard demo                                  # ./reshard-demo, a free port, 30 steps at tp=2",
        "reshard demo --port 8000 --steps 10 --workdir /tmp/demo",
        "reshard demo --preset tiny --steps 5 --json > summary.json"))
    p.add_argument("--workdir", default="reshard-demo", help="where everything goes (default ./reshard-demo)")
    p.add_argument("--port", type=int, default=None, help="the service's port on 127.0.0.1 (default: a free one)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--preset", default="demo", help="model size: demo (34M parameters) or tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    add_json_flag(p, "the summary (losses, timings, bytes pulled per rank, the merged checkpoint); the account "
                  "of each step goes to stderr, the trainer's lines to WORKDIR/logs/train.log")
    p.set_defaults(func=cmd_demo)
