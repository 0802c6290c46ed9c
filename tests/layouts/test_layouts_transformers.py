"""Every rank of an n-D layout holds what that rank of transformers' own n-D model holds.

For llama, qwen3, mixtral, qwen3_moe, deepseek_v3 and olmoe, each checkpoint is loaded by transformers
with `DistributedConfig(...)` in real gloo worlds of 2 and 4 processes (one launch each), and every
tensor of every reshard rank file is compared with that rank's local tensors (per-expert tensors
fused as transformers' conversion mapping fuses them). Where transformers refuses a combination,
the rank files are compared with the composition of what it does for each dimension alone. The same
workers then zero their models, refill them with `fill_model` from a running `reshard serve`, and
compare logits with transformers' own load. Every layout merges back to the checkpoint byte for byte.

With RESHARD_LAYOUTS_OUT set, the session writes what it found per combination (docs/layouts.md's
table, `scripts/gen_docs.py`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from reshard.io.merge import merge
from reshard.io.sources import open_source
from reshard.io.writer import write_shards
from reshard.layout import Layout
from reshard.plan.planner import make_plan
from reshard.plan.types import rank_file_name
from tests.support.dist import run_distributed
from tests.support.live import LiveServer, live_server
from tests.support.nd import load_nd
from tests.support.plan_archs import ARCHS, HFNames, fuse_experts, same_tensor

pytestmark = [pytest.mark.servers, pytest.mark.timeout(1500)]

RESULTS_ENV = "RESHARD_LAYOUTS_OUT"
MODEL_TYPES = ["llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "olmoe"]
# name -> (DistributedConfig sizes, MoE only); the world size is their product (ep aside)
LAYOUTS: dict[str, tuple[dict[str, int], bool]] = {
    "pp2": ({"pp_size": 2}, False),
    "tp2": ({"tp_size": 2}, False),
    "fsdp2": ({"fsdp_size": 2}, False),
    "ep2_fsdp2": ({"ep_size": 2, "fsdp_size": 2}, True),
    "ep2_tp2": ({"ep_size": 2, "tp_size": 2}, True),
    "tp2_fsdp2": ({"tp_size": 2, "fsdp_size": 2}, False),
    "ep4_tp2_fsdp2": ({"ep_size": 4, "tp_size": 2, "fsdp_size": 2}, True),
    "pp2_tp2": ({"pp_size": 2, "tp_size": 2}, False),
    "pp2_fsdp2": ({"pp_size": 2, "fsdp_size": 2}, False),
    "pp2_ep2_tp2": ({"pp_size": 2, "ep_size": 2, "tp_size": 2}, True),
}
# where transformers cannot load a combination: pipeline stages of another one (pp outermost)
COMPOSED = {"pp2_tp2": "tp2", "pp2_fsdp2": "fsdp2", "pp2_ep2_tp2": "ep2_tp2"}


def layout_of(sizes: dict[str, int]) -> Layout:
    return Layout(**{k.removesuffix("_size"): v for k, v in sizes.items()})


CASES = [(mt, name) for mt in MODEL_TYPES for name, (_, moe_only) in LAYOUTS.items()
         if not moe_only or next(a for a in ARCHS if a.model_type == mt).moe]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Checkpoints, reshard's rank files of every case, a server, and what transformers' workers found."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("layouts") / "root"
    out = root.parent / "out"
    for mt in MODEL_TYPES:
        arch = next(a for a in ARCHS if a.model_type == mt)
        torch.manual_seed(sum(map(ord, mt)))
        AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **arch.config_kwargs)).save_pretrained(root / mt)
    jobs: dict[int, list[dict[str, Any]]] = {2: [], 4: []}
    with live_server(root) as srv:
        for mt, name in CASES:
            sizes = LAYOUTS[name][0]
            layout = layout_of(sizes)
            src, manifest = open_source(root / mt)
            write_shards(src, make_plan(src, manifest, layout), out / mt / name, progress=False)
            jobs[layout.world].append({"name": f"{mt}/{name}", "ckpt": str(root / mt), "sizes": sizes,
                                       "out": str(out / mt / f"hf-{name}"), "url": srv.ckpt_url(mt)})
        jobs[2].append({"name": "native/fsdp2", "ckpt": str(root / "llama"), "url": srv.ckpt_url("llama"),
                        "native": True})
        found: dict[str, list[dict[str, Any]]] = {}
        for n, batch in jobs.items():
            for per_rank in run_distributed(load_nd, n, batch, timeout=1200):
                for key, value in per_rank.items():
                    found.setdefault(key, []).append(value)
        results: dict[str, Any] = {}
        yield {"root": root, "out": out, "found": found, "server": srv, "results": results}
    path = os.environ.get(RESULTS_ENV)
    if path and results:
        doc = {"transformers_version": transformers.__version__, "combinations": dict(sorted(results.items()))}
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _theirs(world: dict[str, Any], mt: str, name: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(world["out"] / mt / f"hf-{name}-rank{rank}.safetensors"))


def _expected(world: dict[str, Any], mt: str, name: str, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of case `name` should hold: transformers' own local tensors, or for a composition
    the tensors of its pipeline stage (pp2 alone) as the other dimensions alone cut them."""
    if name not in COMPOSED:
        return _theirs(world, mt, name, rank)
    inner = COMPOSED[name]
    per_stage = layout_of(LAYOUTS[inner][0]).world
    stage, rest = divmod(rank, per_stage)
    keep = set(_theirs(world, mt, "pp2", stage))
    return {k: v for k, v in _theirs(world, mt, inner, rest).items() if k in keep}


def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], names: HFNames, what: str) -> int:
    """Every tensor of `theirs` (a rank of transformers' model) equals reshard's rank file `ours` (per-expert
    tensors fused); nothing of `ours` is left over. Returns how many per-expert tensors were fused."""
    groups: dict[str, tuple[Any, dict[int, dict[int, torch.Tensor]]]] = {}
    seen: set[str] = set()
    for name, got in ours.items():
        mem, conv, src = names(name)
        if conv is not None:
            expert = int(re.search(r"experts\.(\d+)\.", name).group(1))
            groups.setdefault(mem, (conv, {}))[1].setdefault(src, {})[expert] = got
            continue
        assert mem in theirs, f"{what}: {name} -> {mem} is not held by this rank in transformers"
        same_tensor(got, theirs[mem], f"{what}: {name}")
        seen.add(mem)
    for mem, (conv, pieces) in groups.items():
        assert mem in theirs, f"{what}: per-expert tensors of {mem}, which transformers' rank does not hold"
        same_tensor(fuse_experts(conv, pieces), theirs[mem], f"{what}: {mem} (rebuilt from per-expert tensors)")
        seen.add(mem)
    for mem in set(theirs) - seen:
        if mem.endswith("experts.gate_up_proj") or mem.endswith("experts.down_proj"):
            assert theirs[mem].shape[0] == 0, f"{what}: transformers holds {mem}, reshard's rank file nothing of it"
            continue
        tied = mem == "lm_head.weight" and "model.embed_tokens.weight" in theirs
        assert tied and torch.equal(theirs[mem], theirs["model.embed_tokens.weight"]), f"{what}: {mem} missing"
    return sum(len(p) for _, ps in groups.values() for p in ps.values())


@pytest.mark.parametrize("model_type, name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_rank_files_equal_transformers(world: dict[str, Any], model_type: str, name: str) -> None:
    sizes = LAYOUTS[name][0]
    layout = layout_of(sizes)
    found = world["found"][f"{model_type}/{name}"]
    error = found[0].get("error")
    record = world["results"].setdefault(name, {"sizes": sizes, "world": layout.world, "archs": {}})
    record["transformers"] = error or "loads"
    if error is not None:
        assert name in COMPOSED, f"transformers failed to load a combination it supports: {error}"
    else:
        assert name not in COMPOSED, f"transformers loads {name} now: compare with it, not a composition"
    names = HFNames(model_type)
    fused = 0
    for rank in range(layout.world):
        ours = load_file(str(world["out"] / model_type / name / rank_file_name(rank, layout.world)))
        fused += compare(ours, _expected(world, model_type, name, rank), names, f"{model_type} {name} rank {rank}")
    if LAYOUTS[name][1] or "ep" in name:
        assert fused > 0, "no per-expert tensor was compared"
    record["archs"][model_type] = "equal" if error is None else "equal to the composition"


@pytest.mark.parametrize("model_type, name", [c for c in CASES if c[1] not in COMPOSED],
                         ids=[f"{m}-{n}" for m, n in CASES if n not in COMPOSED])
def test_fill_model_from_the_service(world: dict[str, Any], model_type: str, name: str) -> None:
    """transformers' n-D model, zeroed, refilled from `reshard serve`: its logits are transformers' own, and
    each rank pulled exactly its rank file."""
    layout = layout_of(LAYOUTS[name][0])
    for rank, got in enumerate(world["found"][f"{model_type}/{name}"]):
        assert "error" not in got, got
        file = world["out"] / model_type / name / rank_file_name(rank, layout.world)
        assert got["zeroed_diff"] > 1e-3, "zeroing the parameters changed nothing: the check would prove nothing"
        assert got["diff"] <= 1e-5, (rank, got)
        assert got["bytes"] == file.stat().st_size, (rank, got["bytes"], file.stat().st_size)
        assert got["layout"] == layout.describe()


@pytest.mark.parametrize("model_type, name", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_merge_gives_back_the_checkpoint(world: dict[str, Any], tmp_path: Path, model_type: str, name: str) -> None:
    merge(world["out"] / model_type / name, tmp_path / "merged", progress=False)
    original = world["root"] / model_type / "model.safetensors"
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == original.read_bytes()


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "deepseek_v3"])
def test_relayout_equals_a_direct_write(world: dict[str, Any], tmp_path: Path, model_type: str) -> None:
    """Shards of one layout written again as another equal rank files written from the checkpoint."""
    start = "ep4_tp2_fsdp2" if model_type != "llama" else "tp2_fsdp2"
    for target in ("pp2_tp2", "fsdp2", "tp2"):
        src, manifest = open_source(world["out"] / model_type / start)
        layout = layout_of(LAYOUTS[target][0])
        write_shards(src, make_plan(src, manifest, layout), tmp_path / target, progress=False)
        for rank in range(layout.world):
            file = rank_file_name(rank, layout.world)
            assert (tmp_path / target / file).read_bytes() == (world["out"] / model_type / target / file).read_bytes()


def test_sixteen_ranks_served_as_written(world: dict[str, Any], tmp_path: Path) -> None:
    """Every rank of a 16-rank layout (pp 2 x dp_replicate 2 x fsdp 2 x tp 2, experts on ep 4) pulled from the
    service is byte-identical to `reshard write`'s file; replicas (dp_replicate) hold the same tensors."""
    from reshard.io.client import ShardClient

    srv: LiveServer = world["server"]
    layout = Layout(tp=2, pp=2, fsdp=2, ep=4, dp_replicate=2)
    assert layout.world == 16
    src, manifest = open_source(world["root"] / "qwen3_moe")
    write_shards(src, make_plan(src, manifest, layout), tmp_path / "written", progress=False)
    with ShardClient(srv.ckpt_url("qwen3_moe")) as client:
        for rank in range(16):
            file = (tmp_path / "written" / rank_file_name(rank, 16)).read_bytes()
            assert bytes(client.read_shard(rank, layout)) == file, rank
            twin = load_file(str(tmp_path / "written" / rank_file_name(layout.replicas(rank)[-1], 16)))
            mine = load_file(str(tmp_path / "written" / rank_file_name(rank, 16)))
            assert twin.keys() == mine.keys() and all(torch.equal(twin[k], mine[k]) for k in mine)


def test_fill_model_into_torch_native_fsdp(world: dict[str, Any]) -> None:
    """A model sharded by torch's own `fully_shard` (no transformers DistributedConfig) filled from the rank
    files of `--fsdp 2`: its logits equal the unsharded model's."""
    for rank, got in enumerate(world["found"]["native/fsdp2"]):
        assert got["zeroed_diff"] > 1e-3 and got["diff"] <= 1e-5 and got["unsharded_diff"] <= 1e-5, (rank, got)
        assert got["bytes"] == (world["out"] / "llama" / "fsdp2" / rank_file_name(rank, 2)).stat().st_size


def test_cli_pull_of_a_layout(world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli import main

    srv: LiveServer = world["server"]
    dest = tmp_path / "r3.safetensors"
    args = ["pull", srv.ckpt_url("mixtral"), "--rank", "3", "--tp", "2", "--fsdp", "2", "--ep", "4", "-o", str(dest)]
    assert main([*args, "--no-progress"]) == 0
    assert capsys.readouterr().err.startswith("pulled rank 3 of fsdp=2 x tp=2 x ep=4")
    assert dest.read_bytes() == (world["out"] / "mixtral" / "ep4_tp2_fsdp2" / rank_file_name(3, 4)).read_bytes()
    assert main([*args[:3], "4", *args[4:], "--no-progress"]) == 1  # rank 4 of a world of 4
    assert "rank=4 is out of range for fsdp=2 x tp=2 x ep=4 (0..3)" in capsys.readouterr().err

