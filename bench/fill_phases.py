"""Where a TP worker's start-up goes, per rank and per phase (issue 35, item 3): a diagnostic.

    python -m bench.fill_phases [--reps 3] [--tp 2] [--modes from_pretrained,model,shard]
    python -m bench.fill_phases --modes from_pretrained,model@/tmp/before,model   # /tmp/before/reshard: main's
    (MODE@DIR: the worker runs with DIR's reshard package, e.g. `git archive main reshard | tar -x -C DIR`)

Starts `reshard serve` on the 1 GB checkpoint (`bench/data.py`) and runs, interleaved, one worker per
mode under plain torchrun, written the way a user writes it (docs/fill-model.md's `worker.py`; no import
cache switched on by the worker): `from_pretrained(path, tp_plan="auto")`, and `empty_tp_model(URL)` +
`fill_model(model, URL, follow="model"|"shard")`. Each rank times its phases by wrapping the functions
the start-up goes through (module attributes and transformers' class methods, patched in the worker
only): the imports, the process group, the meta build, `to_empty`, the buffers' initialization, the
listing, the boxes, the request with its copy and hash. Printed: the median over rounds of each phase's
wall time on the slower rank, and of `ready` (launch until the model is ready); `--out` writes the table
(bench/results/fill_phases.md, shown in docs/performance.md). The side-by-side figures with their ratios
are `python -m bench.compare_fill --torchrun`'s.

    python -m bench.fill_phases worker MODE SOURCE OUT_DIR     # one rank (run by the above, under torchrun)
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PHASES: dict[str, float] = {}  # phase -> seconds (summed where a phase runs more than once)


@contextmanager
def phase(name: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        PHASES[name] = PHASES.get(name, 0.0) + time.perf_counter() - t


def wrap(owner: Any, attr: str, name: str) -> None:
    """Time every call of `owner.attr` (a function, method or classmethod) as phase `name`."""
    static = inspect.getattr_static(owner, attr)
    func = static.__func__ if isinstance(static, classmethod) else getattr(owner, attr)

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        with phase(name):
            return func(*args, **kwargs)

    setattr(owner, attr, classmethod(timed) if isinstance(static, classmethod) else timed)


# (module, attribute of it (a dotted path for a class's method), phase): what the start-up goes through
WRAPPED = (
    ("transformers.modeling_utils", "PreTrainedModel.prepare_distribute_model", "mesh (prepare_distribute_model)"),
    ("transformers.modeling_utils", "PreTrainedModel.maybe_distribute_model", "tp plan on meta (maybe_distribute_model)"),
    ("transformers.modeling_utils", "PreTrainedModel._load_pretrained_model", "load weights (_load_pretrained_model)"),
    ("transformers.modeling_utils", "PreTrainedModel._finalize_model_loading", "finalize (_finalize_model_loading)"),
    ("transformers.modeling_utils", "PreTrainedModel.initialize_weights", "initialize_weights"),
    ("torch.nn", "Module.to_empty", "to_empty"),
)
WRAPPED_RESHARD = (
    ("reshard.fill.empty_model", "source_config", "config (GET)"),
    ("reshard.fill.empty_model", "init_buffers", "init_buffers"),
    ("reshard.fill.follow_model", "tensor_listing", "listing (GET)"),
    ("reshard.fill.follow_model", "stored_names", "stored names"),
    ("reshard.fill.follow_model", "held_blocks", "boxes (held_blocks)"),
    ("reshard.fill.follow_model", "read_boxes_into", "request + copy + hash"),
    ("reshard.fill.box_fill", "open_boxes", "  request (POST until headers)"),
    ("reshard.io.hashing", "BackgroundHash.wait", "  hash: waits for the thread"),
    ("reshard.io.hashing", "BackgroundHash.__exit__", "  hash: waits for the thread"),
    ("reshard.io.client.box_client", "BoxBody.expected_sha256", "  digest (GET if not in headers)"),
    ("reshard.fill.model", "open_rank_stream", "open shard (GET)"),
    ("reshard.fill.model", "match_targets", "match targets"),
    ("reshard.fill.model", "fill_parameters", "shard copy + hash"),
)


def wrap_all(table: tuple[tuple[str, str, str], ...]) -> None:
    import importlib

    for module, path, name in table:
        *owners, attr = path.split(".")
        owner: Any = importlib.import_module(module)
        for o in owners:
            owner = getattr(owner, o)
        wrap(owner, attr, name)


def worker(mode: str, source: str, out_dir: str) -> None:
    t0 = float(os.environ.get("RESHARD_T0", T_START))
    with phase("import torch"):
        import torch
        import torch.distributed as dist
    if mode != "from_pretrained":
        with phase("import reshard"):
            import reshard
            import reshard.fill.empty_model  # noqa: F401  (what `reshard.empty_tp_model` imports first)
    if mode != "from_pretrained" and hasattr(sys.modules["reshard.fill.empty_model"], "importcache"):
        reshard.enable_import_cache()  # what this version of empty_tp_model does before it imports transformers
    with phase("import transformers"):
        import transformers  # noqa: F401  (empty_tp_model would import it; timed here on its own)
    wrap_all(WRAPPED)
    with phase("init_process_group"):
        dist.init_process_group("gloo")
    if mode == "from_pretrained":
        from transformers import AutoModelForCausalLM

        with phase("from_pretrained (all)"):
            model = AutoModelForCausalLM.from_pretrained(source, tp_plan="auto")
    else:
        wrap_all(WRAPPED_RESHARD)
        with phase("empty_tp_model (all)"):
            model = reshard.empty_tp_model(source)
        with phase("fill_model (all)"):
            reshard.fill_model(model, source, follow=mode)
    ready = time.time() - t0
    with torch.no_grad():
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    rank = dist.get_rank()
    result = {"rank": rank, "start": T_START - t0, "ready": ready, "phases": PHASES,
              "logits_sum": float(logits.double().sum())}
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _round(mode: str, source: str, tp: int, out: Path) -> dict[str, Any]:
    """One torchrun of `mode` ("MODE@DIR": with the reshard package of DIR, e.g. a checkout of main)."""
    import subprocess

    from bench.compare_train import torchrun
    from reshard.testing.local_servers import free_port

    mode, _, other = mode.partition("@")
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("rank-*.json"):
        p.unlink()
    env = {**os.environ, "RESHARD_T0": repr(time.time()), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if other:  # run from DIR (`-m` puts the current directory first on sys.path), bench/ from here
        env["PYTHONPATH"] = os.pathsep.join([other, str(Path(__file__).resolve().parents[1])])
    cmd = [torchrun(), "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "bench.fill_phases", "worker", mode, source, str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=other or None, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(tp)]
    names = list(dict.fromkeys(k for r in ranks for k in r["phases"]))
    row = {k: max(r["phases"].get(k, 0.0) for r in ranks) for k in names}
    row.update(start=max(r["start"] for r in ranks), ready=max(r["ready"] for r in ranks))
    row["logits_sum"] = ranks[0]["logits_sum"]
    return row


def table(rounds: dict[str, list[dict[str, Any]]]) -> str:
    from bench.measure import median

    modes = list(rounds)
    names = list(dict.fromkeys(k for m in modes for r in rounds[m] for k in r if k not in ("ready", "logits_sum")))
    lines = ["| phase (s, slower rank, median) | " + " | ".join(modes) + " |", "|---" + "|---:" * len(modes) + "|"]
    for k in [*names, "ready"]:
        cells = [f"{median([r[k] for r in rounds[m]]):.2f}" if k in rounds[m][0] else "-" for m in modes]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(*argv[1:4])
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.fill_phases", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--modes", default="from_pretrained,model,shard")
    p.add_argument("--size", default="1gb")
    p.add_argument("--out", type=Path, default=None, help="also write the table there (bench/results/fill_phases.md)")
    args = p.parse_args(argv)
    from bench import data
    from bench.compare_fill import NAME, linked_root, write_rank_files
    from bench.run import git_state, machine
    from bench.servers import reshard_serve_argv
    from reshard.testing.local_servers import free_port, server

    where = machine()  # with the load average at the start
    ckpt = data.checkpoint(args.size)
    data.warm_page_cache(ckpt)
    work = data.DATA / "work" / "phases"
    root = linked_root(ckpt, work)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/checkpoints/{NAME}"
    modes = args.modes.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with server(reshard_serve_argv(root, port), f"http://127.0.0.1:{port}/healthz", log=work / "serve.log"):
        if "shard" in modes:
            write_rank_files(root / NAME, args.tp, work / f"ranks-tp{args.tp}")
        for i in range(args.reps + 1):  # the first round warms up
            for m in modes:
                row = _round(m, str(root / NAME) if m == "from_pretrained" else url, args.tp,
                             work / m.replace("/", "_"))
                if i:
                    rounds[m].append(row)
                print(f"round {i} {m}: ready {row['ready']:.2f} s", file=sys.stderr, flush=True)
    head = (f"# `python -m bench.fill_phases --reps {args.reps} --tp {args.tp} --modes {args.modes}` "
            f"({time.strftime('%Y-%m-%d %H:%M')}, commit {git_state()['commit']}): tp={args.tp}, the {args.size} "
            f"checkpoint, medians of {args.reps} interleaved rounds after 1 warm-up round; {where}, "
            f"{os.getloadavg()[0]:.1f} at the end")
    text = f"{head}\n\n{table(rounds)}\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
