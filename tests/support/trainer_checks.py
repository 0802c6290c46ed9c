"""Worker-side code and helpers for the TP trainer tests (`test_tp_trainer.py`).

The functions named `*_job` run inside ranks spawned by `tests/support/dist.py` (module level: they are
pickled by name as `tests.support.trainer_checks.*`; the spawned ranks inherit this process's sys.path,
which holds the repository root). Each job does every check of
one world size in one process group and returns plain values; the tests assert on them.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from reshard.cli.train import main as train_main
from reshard.fill.experts import shard_layout
from reshard.format.rank_file import OPTIMIZER_DIR, rank_file_name
from reshard.trainer import build_model, causal_lm_loss, save_rank_shard
from tests.support.dist import run_distributed

__all__ = ["run_distributed"]

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


# --- inside the ranks ---------------------------------------------------------------------------


def arch_job(
    rank: int, world_size: int, cases: dict[str, str], ids: torch.Tensor, save_root: str | None,
    grad_cases: list[str], other_tp_dirs: list[str],
) -> dict[str, Any]:
    """Per case: build the model from its shard dir; logits, loss, local shapes; gradients for
    `grad_cases`; save the (untrained) shards under `save_root`. From `other_tp_dirs` (shards of another
    tp, cut as read): the stream's name and the logits."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"logits": {}, "loss": {}, "local_shapes": {}, "grads": {}, "selects": {}, "cut": {},
                           "new_groups": {}, "classes": {}}
    new_group = torch.distributed.new_group
    for name, shard_dir in cases.items():
        made: list[Any] = []

        def counting(*args: Any, _made: list[Any] = made, **kw: Any) -> Any:
            _made.append(args)
            return new_group(*args, **kw)

        torch.distributed.new_group = counting
        try:
            model = build_model(shard_dir)
        finally:
            torch.distributed.new_group = new_group
        out["new_groups"][name] = len(made)
        out["classes"][name] = type(model).__name__
        model.eval()
        with torch.no_grad():
            out["logits"][name] = model(input_ids=ids).logits
        loss = causal_lm_loss(model, ids[:, :-1], ids[:, 1:])
        out["loss"][name] = loss.item()
        params = dict(model.named_parameters())
        out["local_shapes"][name] = {k: tuple(p.shape) for k, p in params.items()}
        if name in grad_cases:
            loss.backward()
            out["grads"][name] = {k: p.grad.clone() for k, p in params.items()}
            on_disk = {v: k for k, v in shard_layout(model, list(model.rank_header.tensors)).renamed.items()}
            out["selects"][name] = {k: model.rank_header.tensors[on_disk[k]]["select"] for k in params}
        if save_root is not None:
            save_rank_shard(model, Path(save_root) / name, config=model.hf_config)
    for shard_dir in other_tp_dirs:  # rank files of another tp: cut for this tp as they are read
        model = build_model(shard_dir).eval()
        with torch.no_grad():
            out["cut"][shard_dir] = (model.rank_header.source, model(input_ids=ids).logits)
    return out


def _status_kib() -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values


def build_memory_job(rank: int, world_size: int, shard_dir: str) -> dict[str, int]:
    """Peak RSS increase (bytes) of this rank while `build_model` runs and its parameters are read
once (those mapped from the rank file are resident only then), and its parameter bytes.

    The kernel's peak-RSS counter is reset right before the build (`clear_refs` 5), so the peak is
    the build's own, not that of importing torch or joining the group. A tiny meta -> `to_empty`
    first pays torch's one-time cost of that path (it imports sympy: ~40 MB, whatever the model), and
    a tiny model of the same architecture transformers' import cost.
    """
    import json

    from reshard.fill.empty_model import hf_config, init_buffers
    from reshard.trainer.meta_model import meta_model

    torch.set_num_threads(1)
    torch.nn.Linear(2, 2, device="meta").to_empty(device="cpu")
    # pay the one-time cost of importing transformers' modeling code for this model type (~100 MB of
    # Python modules, whatever the model's size) with a 1-layer, 64-wide copy of the architecture
    config = json.loads((Path(shard_dir) / "config.json").read_text())
    tiny = meta_model(hf_config({**config, "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                 "vocab_size": 256}), dtype=torch.float32)
    tiny.to_empty(device="cpu")
    init_buffers(tiny)
    del tiny
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib()
    model = build_model(shard_dir)
    with torch.no_grad():  # parameters mapped from the rank file become resident as they are read: read them all
        for p in model.parameters():
            p.sum()
    after = _status_kib()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rss_before": before["VmRSS"] * 1024,
        "hwm_before": before["VmHWM"] * 1024,
        "peak_increase": (after["VmHWM"] - before["VmRSS"]) * 1024,
        "param_bytes": param_bytes,
    }


# --- in the test process --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_slice(full: torch.Tensor, select: list[list[list[int]]]) -> torch.Tensor:
    """The piece of `full` a rank holds: per dim, the concatenated [start, end) intervals of its
    selection; indices past the end of a dim (tp padding) read as zeros."""
    ends = [max(end for _, end in dim) for dim in select]
    padded = full.new_zeros([max(e, s) for e, s in zip(ends, full.shape, strict=True)])
    padded[tuple(slice(0, s) for s in full.shape)] = full
    out = padded
    for d, dim in enumerate(select):
        index = torch.cat([torch.arange(a, b) for a, b in dim])
        out = out.index_select(d, index)
    return out


def run_train(
    shards: Path, tp: int, *, steps: int, save: Path, metrics: Path, lr: float, seq_len: int = 32,
    batch_size: int = 4, timeout: float = 180.0, launcher: str = "torchrun",
) -> subprocess.CompletedProcess[str]:
    """`reshard.cli.train.main` in this process (tp=1, no torchrun: stdout in the result), or
    `python -m reshard.cli.train` under `torch.distributed.run` (tp > 1), or under `reshard launch`
    (`launcher="reshard"`)."""
    args = ["--shards", str(shards), "--steps", str(steps), "--save", str(save),
            "--metrics", str(metrics), "--seq-len", str(seq_len), "--batch-size", str(batch_size),
            "--seed", "3", "--lr", str(lr), "--dtype", "float32", "--threads", "1"]
    if tp == 1:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            rc = train_main(args)
        assert rc == 0, f"tp=1 training failed ({rc}):\n{stdout.getvalue()}"
        return subprocess.CompletedProcess(["reshard.cli.train", *args], rc, stdout.getvalue(), "")
    start = ["-m", "reshard.cli.launch"] if launcher == "reshard" else ["-m", "torch.distributed.run"]
    launcher_args = [*start, "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1",
                     "--master-port", str(free_port()), "-m", "reshard.cli.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([PYTHON, *launcher_args, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"tp={tp} training failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def rank_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one rank file."""
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def checkpoint_tensors(ckpt: Path, tp: int) -> dict[str, torch.Tensor]:
    """Every tensor of a training checkpoint's tp rank files, parameters and optimizer moments, keyed
    `SUBDIR/RANK/NAME`."""
    out = {}
    for r in range(tp):
        for sub in (".", OPTIMIZER_DIR):
            out.update({f"{sub}/{r}/{k}": v for k, v in rank_tensors(ckpt / sub / rank_file_name(r, tp)).items()})
    return out


# a run with the schedule and clipping on: a resume must restore the scheduler and continue the data cursor exactly
RESUME_ARGS = ["--seq-len", "16", "--batch-size", "2", "--seed", "3", "--lr", "1e-3", "--warmup", "2", "--min-lr", "1e-4",
               "--max-norm", "0.5", "--dtype", "float32", "--threads", "1"]
RESUME_STEPS = 6


def train_here(*args: str) -> tuple[int, str, str]:
    """`reshard.cli.train.main` in this process with `RESUME_ARGS`: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train_main([*args, *RESUME_ARGS])
    return rc, out.getvalue(), err.getvalue()


def read_metrics(path: Path) -> dict[str, Any]:
    """A run's `--metrics` JSON."""
    return json.loads(Path(path).read_text())
