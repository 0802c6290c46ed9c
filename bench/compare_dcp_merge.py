"""`reshard merge DCP_DIR -o HF_DIR` against torch's and transformers' own consolidation: time and peak RSS.

    python -m bench.compare_dcp_merge [--size quick|1gb|tiny] [--reps 3]

One bf16 Llama checkpoint (`quick`: 310 MB; `1gb`: bench/data.py's 1.07 GB one), saved by 2 gloo ranks
under torchrun as FSDP2 saves it (each tensor cut into `torch.chunk(2, dim 0)` DTensor shards): once by
`dcp.save` (`.metadata` + `__R_0.distcp`, items in torch.save serialization) and once by
`HuggingFaceStorageWriter(save_distributed=True)` (the shard files transformers' `save_pretrained(...,
distributed_checkpoint=True)` writes). Each is merged back into an HF checkpoint, interleaved rounds after a
warm-up, one fresh process per run, dirty pages flushed before each:

  dcp.save's directory:   `reshard merge`  against  `dcp_to_torch_save` + `torch.load` + `save_file`
                          (torch's documented path: one .pt of the whole state dict, then safetensors)
  the shard files:        `reshard merge`  against  transformers' `consolidate_distributed_checkpoint`
                          (torch's `consolidate_safetensors_files` underneath)

The warm-up round's outputs are checked tensor by tensor (sha256 of each tensor's bytes) against the
original checkpoint. Peak RssAnon is of each command's process tree. Writes `bench/results/dcp_merge.{md,json}`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench import data
from bench.compare_train import torchrun
from bench.interleave import Case, drop_dirty, interleave
from bench.measure import run_command
from bench.report import targets_table, write_md_json
from reshard.testing.local_servers import free_port

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
ENV = {"OMP_NUM_THREADS": "1"}
MODELS: dict[str, dict[str, Any]] = {
    "quick": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
}
RESHARD = "reshard merge"
TORCH = "dcp_to_torch_save + torch.load + save_file"
TRANSFORMERS = "transformers consolidate_distributed_checkpoint"


def checkpoint(size: str, root: Path = data.DATA) -> Path:
    """The HF checkpoint of `size` (bench/data.py's for 1gb), made once under `root`."""
    if size == "1gb":
        return data.checkpoint("1gb", root=root)
    import torch

    from reshard.testing.synth import llama_config, make_checkpoint

    path = root / f"llama-dcp-{size}"
    stamp = path / data.STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == MODELS[size]:
        return path
    shutil.rmtree(path, ignore_errors=True)
    make_checkpoint(path, llama_config(**MODELS[size]), dtype=torch.bfloat16, num_files=2, seed=0)
    stamp.write_text(json.dumps(MODELS[size], sort_keys=True))
    return path


def save_ranks(src: Path, dcp_dir: Path, hf_dir: Path) -> None:
    """(Each torchrun rank) the checkpoint as FSDP2 DTensors (Shard(0), torch.chunk's cut), saved both ways."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    sd = {}
    for name in sorted(index):
        with safe_open(src / index[name], "pt") as f:
            full = f.get_tensor(name)
        local = torch.chunk(full, world, dim=0)[rank].clone() if full.shape[0] >= world else full[:0].clone()
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride(), run_check=False)
    dcp.save(sd, checkpoint_id=str(dcp_dir))
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(hf_dir), save_distributed=True))
    dist.barrier()
    dist.destroy_process_group()


def saved(src: Path) -> tuple[Path, Path]:
    """`dcp.save`'s directory and HuggingFaceStorageWriter's shard files of `src` (made once per checkpoint)."""
    dcp_dir, hf_dir = src.parent / f"{src.name}-dcp", src.parent / f"{src.name}-dcp-hf"
    stamp = {"source": (src / data.STAMP).read_text()}
    if all((d / data.STAMP).exists() and json.loads((d / data.STAMP).read_text()) == stamp for d in (dcp_dir, hf_dir)):
        return dcp_dir, hf_dir
    for d in (dcp_dir, hf_dir):
        shutil.rmtree(d, ignore_errors=True)
    argv = [torchrun(), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "bench.compare_dcp_merge", "save-ranks", str(src), str(dcp_dir), str(hf_dir)]
    run_command("save DCP", argv, env=ENV, cwd=ROOT, timeout=3600)
    for d in (dcp_dir, hf_dir):
        shutil.copy(src / "config.json", d / "config.json")
        (d / data.STAMP).write_text(json.dumps(stamp))
    return dcp_dir, hf_dir


def baseline(how: str, src: Path, out: Path) -> None:
    """(One process) the baselines as their users write them."""
    if how == "torch":
        import torch
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out.mkdir(parents=True)
        dcp_to_torch_save(src, out / "model.pt")
        save_file(torch.load(out / "model.pt"), out / "model.safetensors", metadata={"format": "pt"})
        (out / "model.pt").unlink()
    else:
        from transformers.distributed import consolidate_distributed_checkpoint

        consolidate_distributed_checkpoint(src, out)
    shutil.copy(src / "config.json", out / "config.json")


def tensor_digests(d: Path) -> dict[str, str]:
    """sha256 of each tensor's bytes in an HF checkpoint directory (one tensor in memory at a time)."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = st.get_tensor(name).contiguous().view(-1).view(torch.uint8)
                out[name] = hashlib.sha256(t.numpy()).hexdigest()
    return out


def cases(src: Path, work: Path, which: str, want: dict[str, str], checked: dict[str, bool]) -> list[Case]:
    py = sys.executable
    out = {RESHARD: work / "reshard", TORCH: work / "torch", TRANSFORMERS: work / "transformers"}
    argv = {RESHARD: [py, "-m", "reshard.cli", "merge", str(src), "-o", str(out[RESHARD]), "--no-progress"],
            TORCH: [py, "-m", "bench.compare_dcp_merge", "baseline", "torch", str(src), str(out[TORCH])],
            TRANSFORMERS: [py, "-m", "bench.compare_dcp_merge", "baseline", "transformers", str(src), str(out[TRANSFORMERS])]}
    names = [RESHARD, TORCH if which == "dcp" else TRANSFORMERS]

    def setup(name: str) -> Any:
        return lambda: (shutil.rmtree(out[name], ignore_errors=True), drop_dirty())

    def teardown(name: str) -> Any:
        def done() -> None:
            if name not in checked:  # the warm-up round: the output holds the checkpoint's tensors
                checked[name] = tensor_digests(out[name]) == want
            shutil.rmtree(out[name], ignore_errors=True)
        return done

    return [Case(n, argv[n], env=ENV, setup=setup(n), teardown=teardown(n)) for n in names]


def run(size: str, reps: int, work: Path, root: Path = data.DATA) -> dict[str, Any]:
    from bench.run import git_state, machine

    src = checkpoint(size, root)
    dcp_dir, hf_dir = saved(src)
    want = tensor_digests(src)
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    comparisons, checked = [], {}
    for which, d, base in (("dcp", dcp_dir, TORCH), ("hf", hf_dir, TRANSFORMERS)):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        seen: dict[str, bool] = {}
        title = "dcp.save directory" if which == "dcp" else "HuggingFaceStorageWriter shard files"
        res = interleave(title, cases(d, work, which, want, seen), reps=reps, baseline=base)
        res["outputs_equal_the_checkpoint"] = seen
        checked.update({f"{title}: {k}": v for k, v in seen.items()})
        comparisons.append(res)
    shutil.rmtree(work, ignore_errors=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "git": git_state(), "machine": machine(), "reps": reps, "size": size,
            "checkpoint_bytes": total, "tensors": len(want), "load_at_end": os.getloadavg()[0]}
    return {"meta": meta, "comparisons": comparisons, "checked": checked, "targets": targets(comparisons, total, checked)}


def targets(comparisons: list[dict[str, Any]], total: int, checked: dict[str, bool]) -> list[dict[str, Any]]:
    rows = []
    for c in comparisons:
        ours = c["cases"][RESHARD]
        rows.append({"target": f"{c['title']}: `reshard merge` vs {c['baseline']}", "value": f"{ours['ratio_to_baseline']:.2f}x",
                     "goal": "<= 0.5x", "met": ours["ratio_to_baseline"] <= 0.5})
        rss = ours["peak_rss_anon_mib"] * MiB / total
        rows.append({"target": f"{c['title']}: `reshard merge` peak RssAnon / checkpoint", "value": f"{rss:.3f}",
                     "goal": "<= 0.25", "met": rss <= 0.25})
    rows.append({"target": "every output holds the checkpoint's tensors", "value": str(all(checked.values())),
                 "goal": "True", "met": all(checked.values())})
    return rows


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"# merging a DCP checkpoint into an HF checkpoint (`python -m bench.compare_dcp_merge --size {m['size']} "
             f"--reps {m['reps']}`, {m['date']}; bf16 Llama, {m['checkpoint_bytes'] / 1e6:.0f} MB, {m['tensors']} tensors, "
             f"saved by 2 FSDP2 ranks; medians of {m['reps']} interleaved rounds after a warm-up; {m['machine']})", "",
             "| source | command | median s | x baseline | peak RssAnon MiB |", "|---|---|---:|---:|---:|"]
    for c in res["comparisons"]:
        for name, case in c["cases"].items():
            lines.append(f"| {c['title']} | {name} | {case['median_s']:.2f} | {case['ratio_to_baseline']:.2f}x | "
                         f"{case['peak_rss_anon_mib']:.0f} |")
    return "\n".join([*lines, "", *targets_table(res["targets"])]) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save-ranks"]:
        save_ranks(*map(Path, argv[1:4]))
        return 0
    if argv[:1] == ["baseline"]:
        baseline(argv[1], Path(argv[2]), Path(argv[3]))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench.compare_dcp_merge", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["quick", "1gb", "tiny"], default="quick")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "dcp_merge.md")
    args = p.parse_args(argv)
    res = run(args.size, args.reps, data.DATA / "work-dcp-merge")
    write_md_json(args.out, markdown(res), res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
