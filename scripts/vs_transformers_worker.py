"""The ranks of `scripts/vs_transformers.py`: transformers' own distributed training path and reshard's trainer on
the same model, data and hyperparameters, one phase after another in one process group.

    python -m torch.distributed.run --nproc-per-node 2 -m scripts.vs_transformers_worker PLAN.json   # world 2
    python -m scripts.vs_transformers_worker PLAN.json                                                # tp=1

PLAN.json: {"work": DIR, "train": {the run's hyperparameters}, "timeout_s": T, "phases": [...]}, a phase
`{"model": NAME, "side": "transformers" | "reshard", "what": "run" | "resume", "layout": "tp2" | "fsdp2" |
"dp2" | "tp1"}`. Rank 0 writes `WORK/MODEL/SIDE/WHAT-LAYOUT.json` when a phase ends (what each step did, or the
error it ended with) and `.started` beside it before it begins, so a phase that never ends (a hang) shows.

transformers' side is what it offers a user: `from_pretrained(..., distributed_config=DistributedConfig(
tp_size=2 | fsdp_size=2 | dp_replicate_size=2))` (tp1: no config, no process group), the model saved with
`save_pretrained(..., distributed_checkpoint=True)` and the optimizer with `save_optimizer_distributed`, both
on every rank as their docstrings ask; a resume is `from_pretrained` of that directory, then
`load_optimizer_distributed`. The loop around it is the bundled trainer's, for a plain module: sample i of the
global order is `reshard.trainer.cursor.sample_windows(seed, i)`, the global batch split across the data ranks,
the loss the mean next-token cross-entropy, AdamW (no weight decay) at `reshard.trainer.schedule`'s warmup +
cosine rate, gradients clipped by the global norm of the unsharded model. The scheduler's position and the data
cursor, which transformers does not save, go in a JSON beside. At the save the gathered parameters and AdamW
state are kept too (`expected.safetensors`): a resume compares what `load_optimizer_distributed` gave it with
them. reshard's side is `reshard.cli.train` (`--save-every`, `--resume DIR/step-N`) from the tp=2 rank shards.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SLOTS = ("exp_avg", "exp_avg_sq", "step")
# layout -> transformers' DistributedConfig sizes (tp1: a plain model, no process group), reshard's flags
LAYOUTS: dict[str, dict[str, int]] = {"tp2": {"tp_size": 2}, "fsdp2": {"fsdp_size": 2}, "dp2": {"dp_replicate_size": 2},
                                      "tp1": {}}
RESHARD_FLAGS: dict[str, list[str]] = {"tp2": [], "fsdp2": ["--fsdp", "2"], "dp2": ["--dp", "2"], "tp1": []}
SAVED_AT = "tp2"  # the layout both sides save their checkpoint at
DATA_PARALLEL = ("fsdp2", "dp2")  # the layouts whose ranks read different shares of the global batch


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (collective), or the plain tensor, as a float32 CPU copy."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().float().clone()


# --- transformers' side -------------------------------------------------------------------------------


def _tf_model(path: Path, layout: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    sizes = LAYOUTS[layout]
    config = DistributedConfig(**sizes) if sizes else None
    return AutoModelForCausalLM.from_pretrained(str(path), distributed_config=config, dtype=torch.float32)


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` by the unsharded model's gradient norm: each DTensor gradient gathered, a plain one
    (a replicated parameter, the same on every rank) counted once; the norm."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is not None:
            total += _full(p.grad).pow(2).sum()
    norm = total.sqrt()
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return float(norm)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW state, gathered to full tensors (collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _full(p)
        for slot in SLOTS:
            value = optimizer.state.get(p, {}).get(slot)
            if value is not None:
                out[f"{slot}/{name}"] = _full(value).reshape(-1) if slot == "step" else _full(value)
    return out


def compare_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The reloaded state against the saved one, per slot (param, exp_avg, exp_avg_sq, step): the largest
    |difference| and the tensors that differ, are missing or have another shape."""
    out: dict[str, Any] = {}
    for slot in ("param", *SLOTS):
        names = sorted(k.split("/", 1)[1] for k in expected if k.startswith(f"{slot}/"))
        missing = [n for n in names if f"{slot}/{n}" not in got]
        shapes = [n for n in names if n not in missing and got[f"{slot}/{n}"].shape != expected[f"{slot}/{n}"].shape]
        diffs = {n: float((got[f"{slot}/{n}"] - expected[f"{slot}/{n}"]).abs().max()) for n in names
                 if n not in missing and n not in shapes}
        out[slot] = {"tensors": len(names), "max_abs_diff": max(diffs.values(), default=0.0),
                     "differ": sorted(n for n, d in diffs.items() if d > 0), "missing": missing, "shape": shapes}
    return out


def _tf_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, train: dict[str, Any],
              layout: str, first: int, on_step: Any = None) -> list[dict[str, float]]:
    """Steps `first` .. `train["steps"]` of the run (1-based): what each did."""
    from reshard.cli.train import default_data, load_tokens
    from reshard.trainer.cursor import local_share, sample_windows

    tokens = load_tokens(default_data(), model.config.vocab_size)
    ranks = dist.get_world_size() if layout in DATA_PARALLEL else 1
    offset, count = local_share(train["batch_size"], ranks, _rank() if ranks > 1 else 0)
    params = [p for p in model.parameters() if p.requires_grad]
    tied = _TiedWeights(model) if model.config.tie_word_embeddings else None
    records = []
    for step in range(first, train["steps"] + 1):
        window = sample_windows(tokens, seed=train["seed"], first=(step - 1) * train["batch_size"] + offset,
                                count=count, seq_len=train["seq_len"])
        logits = model(input_ids=window[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, -2).float(), window[:, 1:].flatten())
        loss.backward()
        norm = _clip(params, train["max_norm"])
        lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if ranks > 1:  # the global batch's loss: the data ranks' shares have the same number of tokens
            dist.all_reduce(mean)
            mean /= ranks
        records.append({"step": step, "loss": float(mean), "lr": lr, "grad_norm": norm,
                        **({"tied_rows_differ": tied.rows_differ()} if tied is not None else {})})
        if on_step is not None:
            on_step(step)
    return records


class _TiedWeights:
    """For tied embeddings: the rows in which the weight the output head computed with differs from the one the
    input embedding looked up in the same forward (none, when the tie holds)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: dict[str, torch.Tensor] = {}
        for key, module in (("in", model.get_input_embeddings()), ("out", model.get_output_embeddings())):
            module.register_forward_hook(lambda mod, args, out, key=key: self.seen.__setitem__(key, _full(mod.weight)))

    def rows_differ(self) -> list[int]:
        a, b = self.seen["in"], self.seen["out"]
        return (a != b).any(dim=1).nonzero().flatten().tolist()


def _optimizer(model: torch.nn.Module, train: dict[str, Any]) -> tuple[torch.optim.Optimizer, Any]:
    from reshard.trainer.schedule import make_optimizer, make_scheduler

    optimizer = make_optimizer(model, lr=train["lr"])
    return optimizer, make_scheduler(optimizer, steps=train["steps"], warmup=train["warmup"], min_lr=train["min_lr"])


def tf_run(root: Path, train: dict[str, Any], layout: str) -> dict[str, Any]:
    """From the HF checkpoint, the whole run; at the saved layout, model + optimizer saved with transformers'
    functions after step `save_at`."""
    from safetensors.torch import save_file
    from transformers.distributed import save_optimizer_distributed

    model = _tf_model(root / "full", layout)
    optimizer, scheduler = _optimizer(model, train)
    ckpt = root / "transformers" / "ckpt"
    saved: dict[str, Any] = {}

    def on_step(step: int) -> None:
        if step != train["save_at"] or layout != SAVED_AT:
            return
        t0 = time.perf_counter()
        model.save_pretrained(str(ckpt / "model"), distributed_checkpoint=True)
        save_optimizer_distributed(model, optimizer, str(ckpt / "optimizer"))
        saved["save_s"] = time.perf_counter() - t0
        expected = _snapshot(model, optimizer)
        if _rank() == 0:
            save_file({k: v.contiguous() for k, v in expected.items()}, str(ckpt / "expected.safetensors"))
            state = {"step": step, "samples": step * train["batch_size"], "scheduler": scheduler.state_dict()}
            (ckpt / "loop.json").write_text(json.dumps(state))
        if dist.is_initialized():
            dist.barrier()

    return {"records": _tf_steps(model, optimizer, scheduler, train=train, layout=layout, first=1, on_step=on_step),
            **saved}


def tf_resume(root: Path, train: dict[str, Any], layout: str) -> dict[str, Any]:
    """From the checkpoint `tf_run` saved: the model and the optimizer (compared with what was saved), the
    schedule, then the remaining steps."""
    from safetensors.torch import load_file
    from transformers.distributed import load_optimizer_distributed

    ckpt = root / "transformers" / "ckpt"
    loop = json.loads((ckpt / "loop.json").read_text())
    model = _tf_model(ckpt / "model", layout)
    optimizer, scheduler = _optimizer(model, train)
    load_optimizer_distributed(model, optimizer, str(ckpt / "optimizer"))
    scheduler.load_state_dict(loop["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    reloaded = compare_state(load_file(str(ckpt / "expected.safetensors")), _snapshot(model, optimizer))
    records = _tf_steps(model, optimizer, scheduler, train=train, layout=layout, first=loop["step"] + 1)
    return {"records": records, "reloaded": reloaded}


# --- reshard's side ------------------------------------------------------------------------------------


def reshard_phase(root: Path, train: dict[str, Any], what: str, layout: str) -> dict[str, Any]:
    """`reshard.cli.train` in this process group: the run from the tp=2 shards (checkpointed every `save_at`
    steps), or the resume from its step-`save_at` checkpoint at `layout`."""
    from reshard.cli.train import parse_args
    from reshard.cli.train import train as run

    args = ["--steps", str(train["steps"]), "--seq-len", str(train["seq_len"]), "--batch-size", str(train["batch_size"]),
            "--seed", str(train["seed"]), "--lr", str(train["lr"]), "--warmup", str(train["warmup"]),
            "--min-lr", str(train["min_lr"]), "--max-norm", str(train["max_norm"]), "--dtype", "float32",
            "--threads", "1", *RESHARD_FLAGS[layout]]
    ckpt = root / "reshard" / "ckpt"
    if what == "run":
        args += ["--shards", str(root / "shards-tp2"), "--save", str(ckpt), "--save-every", str(train["save_at"])]
    else:
        args += ["--resume", str(ckpt / f"step-{train['save_at']}")]
    s = run(parse_args(args))
    return {"records": [{"step": s["first_step"] + i, "loss": loss, "lr": lr, "grad_norm": norm} for i, (loss, lr, norm)
                        in enumerate(zip(s["losses"], s["lrs"], s["grad_norms"], strict=True))]}


# --- the phases ------------------------------------------------------------------------------------------


def phase_file(work: Path, phase: dict[str, str]) -> Path:
    """Where a phase's outcome is written (`.started` beside it while it runs)."""
    return work / phase["model"] / phase["side"] / f"{phase['what']}-{phase['layout']}.json"


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def run_phase(work: Path, train: dict[str, Any], phase: dict[str, str]) -> None:
    out = phase_file(work, phase)
    if _rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".started").write_text(str(time.time()))
    root, t0 = work / phase["model"], time.perf_counter()
    try:
        if phase["side"] == "reshard":
            result = reshard_phase(root, train, phase["what"], phase["layout"])
        else:
            result = (tf_run if phase["what"] == "run" else tf_resume)(root, train, phase["layout"])
        result["ok"] = True
    except Exception as exc:  # the outcome is what is recorded: the library's own error, on this rank
        result = {"ok": False, "error": error_line(exc), "traceback": traceback.format_exc(limit=-4)}
    result["seconds"] = time.perf_counter() - t0
    if dist.is_initialized():
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, result.get("error"))
        result["rank_errors"] = errors
        result["ok"] = result["ok"] and not any(errors)
    if _rank() == 0:
        out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    plan = json.loads(Path((argv if argv is not None else sys.argv[1:])[0]).read_text())
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # a collective a peer never joins fails after timeout_s
        dist.init_process_group("gloo", timeout=timedelta(seconds=plan["timeout_s"]))
    try:
        for phase in plan["phases"]:
            run_phase(Path(plan["work"]), plan["train"], phase)
        return 0
    finally:
        if dist.is_initialized():  # every phase ran in this group (each records its own failure)
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
