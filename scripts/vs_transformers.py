"""Side by side with transformers: a run saved at tp=2 and resumed at tp=2, fsdp=2, dp=2 and tp=1, by transformers'
own distributed path and by reshard's trainer, on the same model, data and hyperparameters.

    .venv/bin/python scripts/vs_transformers.py                # the full run: tests/trainer/results/vs_transformers.json
    .venv/bin/python scripts/vs_transformers.py --size test    # what tests/trainer/test_vs_transformers.py runs
    .venv/bin/python scripts/gen_docs.py                       # docs/trainer-vs-transformers.md's table from the JSON

Two tiny llamas made as the tests make them (`from_config`, random weights, `save_pretrained`; vocabulary 301,
odd at tp=2): `llama`, and `llama_tied` (tied embeddings and attention biases). Both sides train `steps` steps
from the same weights on the same global data order (sample i a pure function of (seed, i)), with the warmup +
cosine schedule and clipping on, and save after step `save_at`: transformers with `save_pretrained(...,
distributed_checkpoint=True)` + `save_optimizer_distributed`, reshard with `--save-every`. Each checkpoint is then
resumed at every layout and the run continued to its end (`scripts/vs_transformers_worker.py`: every world-2 phase
in one torchrun launch, the tp=1 ones in one process). For each resume this records transformers' outcome:
`agrees` (its reloaded optimizer state equals what it saved, and its continued losses equal reshard's continued
losses within `TOLERANCE`), `diverges` (the state came back equal but the losses part), `wrong state` (the
reloaded parameters or AdamW state differ from the saved ones), `error` (the error's first line) or `hang` (no
answer within the time limit); and reshard's resume against its own uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, "") and str(ROOT) not in sys.path:  # run as `python scripts/vs_transformers.py`
    sys.path.insert(0, str(ROOT))

from scripts.vs_transformers_table import RESULTS  # noqa: E402
from scripts.vs_transformers_worker import LAYOUTS, SAVED_AT, phase_file  # noqa: E402

TOLERANCE = 1e-5  # |loss difference| between two runs of the same math: float32 reduction-order noise
SMALL = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
         "bos_token_id": 1, "eos_token_id": 2}
MODELS: dict[str, dict[str, Any]] = {"llama": {}, "llama_tied": {"tie_word_embeddings": True, "attention_bias": True}}
TRAIN = {"seed": 3, "lr": 1e-3, "warmup": 2, "min_lr": 1e-4, "max_norm": 0.5}
SIZES: dict[str, dict[str, int]] = {"full": {"steps": 12, "save_at": 6, "seq_len": 32, "batch_size": 4},
                                    "test": {"steps": 6, "save_at": 3, "seq_len": 16, "batch_size": 2}}
RESUMED = ("tp2", "fsdp2", "dp2", "tp1")
TIMEOUT_S = 120  # a collective that a peer never joins fails after this (the worker's process group timeout)


def make_model(name: str, out: Path) -> Path:
    """transformers' `from_config` llama with random weights (std 0.1; norms in [0.5, 1.5]), `save_pretrained`,
    and its tp=2 rank shards `shards-tp2` beside (reshard write with transformers' own plan for llama)."""
    import torch
    import transformers

    from reshard.io.sinks.write import write_shards
    from reshard.io.source.opener import open_source
    from reshard.plan.planner import make_plan

    config = transformers.AutoConfig.for_model("llama", **{**SMALL, **MODELS[name]})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out / "full")
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    ckpt, manifest = open_source(out / "full")
    write_shards(ckpt, make_plan(ckpt, manifest, 2), out / "shards-tp2", progress=False)
    return out


def phases(models: list[str]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(the world-2 phases, the tp=1 phases): reshard's first (a transformers phase that hangs ends its launch)."""
    def p(model: str, side: str, what: str, layout: str) -> dict[str, str]:
        return {"model": model, "side": side, "what": what, "layout": layout}

    two = [p(m, "reshard", "run", SAVED_AT) for m in models]
    two += [p(m, "reshard", "resume", lay) for m in models for lay in RESUMED if lay != "tp1"]
    two += [p(m, "transformers", "run", lay) for m in models for lay in LAYOUTS if lay != "tp1"]
    two += [p(m, "transformers", "resume", lay) for m in models for lay in RESUMED if lay != "tp1"]
    one = [p(m, "reshard", "resume", "tp1") for m in models]
    one += [p(m, side, what, "tp1") for m in models for side, what in (("transformers", "run"), ("transformers", "resume"))]
    return two, one


def _launch(work: Path, train: dict[str, Any], todo: list[dict[str, str]], world: int) -> None:
    plan = work / f"plan-{world}.json"
    plan.write_text(json.dumps({"work": str(work), "train": train, "timeout_s": TIMEOUT_S, "phases": todo}))
    from reshard.testing.local_servers import free_port

    run = ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port())] if world > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    limit = 2 * TIMEOUT_S + 30 * len(todo)  # a backstop: a hung phase fails its collective after TIMEOUT_S
    with open(work / f"log-{world}.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, *run, "-m", "scripts.vs_transformers_worker", str(plan)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:  # the launcher and its ranks: the session it leads
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\nkilled after {limit} s\n")


def outcome(work: Path, phase: dict[str, str]) -> dict[str, Any]:
    """What a phase recorded; a phase started and never ended is a hang, one never started was not run."""
    path = phase_file(work, phase)
    if path.is_file():
        return json.loads(path.read_text())
    if path.with_suffix(".started").is_file():
        return {"ok": False, "hang": True, "error": "started and never ended: its launch was killed at the time limit"}
    return {"ok": False, "error": "not run: its launch ended before it (see WORK/log-N.txt)"}


def _losses(result: dict[str, Any]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result.get("records", [])}


def max_diff(a: dict[str, Any], b: dict[str, Any], steps: range) -> float | None:
    """The largest |loss difference| of two runs over `steps` (None unless both took every one of them)."""
    la, lb = _losses(a), _losses(b)
    if not all(s in la and s in lb for s in steps):
        return None
    return max(abs(la[s] - lb[s]) for s in steps)


def tied_rows(result: dict[str, Any]) -> dict[str, Any] | None:
    """Where the output head of a tied model computed with other rows than the embedding (`_TiedWeights`): the
    first such step, how many rows, the first and the last; None when the tie held at every step."""
    for r in result.get("records", []):
        rows = r.get("tied_rows_differ")
        if rows:
            return {"from_step": r["step"], "rows": len(rows), "first": rows[0], "last": rows[-1]}
    return None


def verdict(tf: dict[str, Any], diff: float | None) -> str:
    """transformers' outcome for one resume."""
    if tf.get("hang") or "timed out" in (tf.get("error") or "").lower():  # gloo gave up on a collective
        return "hang"
    if not tf["ok"]:
        return "error"
    if any(s["max_abs_diff"] or s["missing"] or s["shape"] for s in tf["reloaded"].values()):
        return "wrong state"
    return "agrees" if diff is not None and diff <= TOLERANCE else "diverges"


def summarize(work: Path, models: list[str], train: dict[str, Any]) -> dict[str, Any]:
    """The comparison's findings per model and resumed layout (the JSON the docs' table is made from)."""
    import torch
    import transformers

    after, every = range(train["save_at"] + 1, train["steps"] + 1), range(1, train["steps"] + 1)
    found: dict[str, Any] = {}
    for m in models:
        get = {(side, what, lay): outcome(work, {"model": m, "side": side, "what": what, "layout": lay})
               for side in ("reshard", "transformers") for what in ("run", "resume") for lay in LAYOUTS}
        ref = get["reshard", "run", SAVED_AT]
        runs = {lay: {"ok": get["transformers", "run", lay]["ok"], "error": get["transformers", "run", lay].get("error"),
                      "max_abs_diff_vs_reshard": max_diff(get["transformers", "run", lay], ref, every),
                      "tied_head_rows_differ": tied_rows(get["transformers", "run", lay])} for lay in LAYOUTS}
        cases = {}
        for lay in RESUMED:
            tf, rs = get["transformers", "resume", lay], get["reshard", "resume", lay]
            diff = max_diff(tf, rs, after)
            cases[lay] = {
                "transformers": verdict(tf, diff), "error": tf.get("error"), "max_abs_diff_vs_reshard": diff,
                "max_abs_diff_vs_own_run": max_diff(tf, get["transformers", "run", SAVED_AT], after),
                "tied_head_rows_differ": tied_rows(tf),
                "reloaded": {k: {f: v[f] for f in ("max_abs_diff", "missing", "shape")} | {"differ": len(v["differ"])}
                             for k, v in (tf.get("reloaded") or {}).items()},
                "reshard_ok": rs["ok"], "reshard_error": rs.get("error"),
                "reshard_vs_uninterrupted": max_diff(rs, ref, after),
                "losses": {"transformers": _losses(tf), "reshard": _losses(rs)}}
        found[m] = {"config": MODELS[m], "runs": runs, "resumed": cases, "reference_losses": _losses(ref),
                    "reshard_run_error": ref.get("error")}
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "train": train, "saved_at": SAVED_AT, "tolerance": TOLERANCE, "models": found}


def compare(work: Path, *, size: str = "full", models: list[str] | None = None) -> dict[str, Any]:
    """Make the models, run both sides in `work` and return the findings."""
    models = models or list(MODELS)
    train = {**TRAIN, **SIZES[size]}
    for m in models:
        make_model(m, work / m)
    two, one = phases(models)
    _launch(work, train, two, 2)
    _launch(work, train, one, 1)
    return json.loads(json.dumps({"size": size, **summarize(work, models, train)}))  # as the JSON file holds it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path, default=None, help=f"the JSON (default with --size full: {RESULTS})")
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoints and logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    out = args.out or (RESULTS if args.size == "full" else Path(f"vs_transformers-{args.size}.json"))
    work = args.work or Path(tempfile.mkdtemp(prefix="vs-transformers-"))
    try:
        results = compare(work, size=args.size)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{out}: written; `scripts/gen_docs.py` makes docs/trainer-vs-transformers.md's table from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
