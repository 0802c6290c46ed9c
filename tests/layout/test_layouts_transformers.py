"""Every rank of an n-D layout holds what that rank of transformers' own n-D model holds.

For llama, qwen3, mixtral, qwen3_moe, deepseek_v3 and olmoe (and qwen3 with tied embeddings, llama of 3
layers on 2 stages, gpt_oss and granitemoe with experts fused on disk), each checkpoint is loaded by
transformers with `DistributedConfig(...)` in real gloo worlds of 2, 3 and 4 processes (one launch
each), and every tensor of every reshard rank file is compared with that rank's local tensors
(per-expert tensors fused as transformers' conversion mapping fuses them). Where transformers refuses a
combination, the rank files are compared with the composition of what it does for each dimension
alone; FSDP alone also with `torch.chunk` of the unsharded parameters (uneven and empty chunks, where
transformers cannot load the rank holding no expert). The same workers then zero their models
(parameters and persistent buffers), refill them with `fill_model` from a running `reshard serve`, and
compare every local tensor and the logits with transformers' own load, and the bytes the service sent
each rank with its rank file; one model is first offered shards it must refuse. Every layout merges
back to the checkpoint byte for byte.

With RESHARD_LAYOUTS_OUT set, the session writes what it found per combination (docs/layouts.md's
table, `scripts/gen_docs.py`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.hf_checkpoint import merge
from reshard.io.sinks.write import write_shards
from reshard.io.source.opener import open_source
from reshard.layout import Layout
from reshard.plan.planner import make_plan
from tests.support.dist import run_distributed
from tests.support.live import LiveServer, live_server
from tests.support.nd import load_nd
from tests.support.plan_archs import ARCHS, HFNames, fuse_experts, same_tensor

pytestmark = [pytest.mark.servers, pytest.mark.timeout(1500)]

RESULTS_ENV = "RESHARD_LAYOUTS_OUT"
MODEL_TYPES = ["llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "olmoe"]
# checkpoint name -> (model_type, config beyond the architecture's test sizes)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    **{mt: (mt, {}) for mt in MODEL_TYPES},
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),  # embeddings on the first and the last stage
    "llama_3layers": ("llama", {"num_hidden_layers": 3}),  # 2 + 1 layers on 2 stages
    "gpt_oss": ("gpt_oss", {}), "granitemoe": ("granitemoe", {}),  # experts fused on disk
}
ALL, MOE = tuple(MODEL_TYPES), ("mixtral", "qwen3_moe", "deepseek_v3", "olmoe")
# name -> (DistributedConfig sizes, the checkpoints tried); the world size is their product (ep aside)
LAYOUTS: dict[str, tuple[dict[str, int], tuple[str, ...]]] = {
    "pp2": ({"pp_size": 2}, (*ALL, "qwen3_tied", "llama_3layers")),
    "tp2": ({"tp_size": 2}, ALL),
    "fsdp2": ({"fsdp_size": 2}, ALL),
    "ep2_fsdp2": ({"ep_size": 2, "fsdp_size": 2}, (*MOE, "gpt_oss")),
    "ep2_tp2": ({"ep_size": 2, "tp_size": 2}, (*MOE, "granitemoe")),
    "fsdp3": ({"fsdp_size": 3}, ("llama", "qwen3_moe")),  # 43/43/42 rows; 2/2/0 experts
    "tp2_fsdp2": ({"tp_size": 2, "fsdp_size": 2}, ALL),
    "dpr2_fsdp2": ({"dp_replicate_size": 2, "fsdp_size": 2}, ("llama",)),
    "ep2_tp2_fsdp2": ({"ep_size": 2, "tp_size": 2, "fsdp_size": 2}, ("qwen3_moe", "deepseek_v3")),  # efsdp=2
    "ep4_tp2_fsdp2": ({"ep_size": 4, "tp_size": 2, "fsdp_size": 2}, MOE),
    "pp2_tp2": ({"pp_size": 2, "tp_size": 2}, ALL),
    "pp2_fsdp2": ({"pp_size": 2, "fsdp_size": 2}, ALL),
    "pp2_ep2_tp2": ({"pp_size": 2, "ep_size": 2, "tp_size": 2}, MOE),
    "pp2_dpr2": ({"pp_size": 2, "dp_replicate_size": 2}, ("llama",)),
}
# where transformers cannot load a combination: pipeline stages of another one (pp outermost; None: the
# stage alone, its dp_replicate replicas holding the same)
COMPOSED: dict[str, str | None] = {"pp2_tp2": "tp2", "pp2_fsdp2": "fsdp2", "pp2_ep2_tp2": "ep2_tp2", "pp2_dpr2": None}
# FSDP alone: every rank also compared with torch.chunk of the unsharded parameters (FSDP2's Shard(0));
# transformers loads qwen3_moe at fsdp=3 on the ranks holding experts only (the empty chunk: torch.stack of none)
CHUNKED = {"fsdp3"}
TRANSFORMERS_FAILS = {("qwen3_moe", "fsdp3")}
REFUSE = ("llama", "tp2_fsdp2", "pp2_fsdp2")  # the model, and another layout's shards of the same world
TAMPERED = "model.norm.weight"  # its FSDP chunk moved to the other fsdp rank's in the shard refused
NATIVE = {"native/fsdp2": ("llama", 2), "native/qwen3_moe-fsdp3": ("qwen3_moe", 3)}


def layout_of(sizes: dict[str, int]) -> Layout:
    return Layout(**{k.removesuffix("_size"): v for k, v in sizes.items()})


def model_type(ckpt: str) -> str:
    return CHECKPOINTS[ckpt][0]


def arch_of(ckpt: str) -> Any:
    return next(a for a in ARCHS if a.model_type == model_type(ckpt))


CASES = [(ck, name) for name, (_, cks) in LAYOUTS.items() for ck in cks]
FILLED = [(ck, name) for ck, name in CASES if name not in COMPOSED and (ck, name) not in TRANSFORMERS_FAILS]


def _tamper(shards: Path, out: Path, world: int) -> None:
    """`shards` written again to `out` with every value + 1 and the selection of `TAMPERED` swapped with the
    other fsdp rank's (tp=2: rank ^ 2), its shape unchanged."""
    out.mkdir(parents=True)
    for rank in range(world):
        with safe_open(str(shards / rank_file_name(rank, world)), "pt") as f, \
                safe_open(str(shards / rank_file_name(rank ^ 2, world)), "pt") as g:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) + 1 for k in f.keys()}
            desc, other = json.loads(meta["tensors"]), json.loads(g.metadata()["tensors"])
        assert desc[TAMPERED]["select"] != other[TAMPERED]["select"]
        desc[TAMPERED]["select"] = other[TAMPERED]["select"]
        save_file(tensors, str(out / rank_file_name(rank, world)), metadata={**meta, "tensors": json.dumps(desc)})


def _jobs(root: Path, out: Path, srv: LiveServer) -> dict[int, list[dict[str, Any]]]:
    """reshard's rank files of every case, and the workers' jobs by world size."""
    jobs: dict[int, list[dict[str, Any]]] = {2: [], 3: [], 4: []}
    metrics = f"{srv.url}/metrics"
    for ck, name in CASES:
        sizes = LAYOUTS[name][0]
        layout = layout_of(sizes)
        src, manifest = open_source(root / ck)
        write_shards(src, make_plan(src, manifest, layout), out / ck / name, progress=False)
        jobs[layout.world].append({"name": f"{ck}/{name}", "ckpt": str(root / ck), "sizes": sizes, "metrics": metrics,
                                   "out": str(out / ck / f"hf-{name}"), "url": srv.ckpt_url(ck)})
    ck, name, other = REFUSE
    _tamper(out / ck / name, out / ck / "tampered", layout_of(LAYOUTS[name][0]).world)
    job = next(j for j in jobs[4] if j["name"] == f"{ck}/{name}")
    job["refuse"] = {"other_layout": str(out / ck / other), "wrong_chunk": str(out / ck / "tampered")}
    for key, (ck, n) in NATIVE.items():
        jobs[n].append({"name": key, "ckpt": str(root / ck), "url": srv.ckpt_url(ck), "metrics": metrics, "native": True})
    for batch in jobs.values():  # a job transformers fails on some ranks last (its peers skip the fill)
        batch.sort(key=lambda j: tuple(j["name"].split("/")) in TRANSFORMERS_FAILS)
    return jobs


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Checkpoints, reshard's rank files of every case, a server, and what transformers' workers found."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("layouts") / "root"
    out = root.parent / "out"
    for ck, (mt, extra) in CHECKPOINTS.items():
        torch.manual_seed(sum(map(ord, ck)))
        config = AutoConfig.for_model(mt, **{**arch_of(ck).config_kwargs, **extra})
        AutoModelForCausalLM.from_config(config).save_pretrained(root / ck)
    with live_server(root) as srv:
        jobs = _jobs(root, out, srv)
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


def _theirs(world: dict[str, Any], ck: str, name: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(world["out"] / ck / f"hf-{name}-rank{rank}.safetensors"))


def _expected(world: dict[str, Any], ck: str, name: str, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` of case `name` should hold: transformers' own local tensors, or for a composition
    the tensors of its pipeline stage (pp2 alone) as the other dimensions alone cut them."""
    if name not in COMPOSED:
        return _theirs(world, ck, name, rank)
    inner = COMPOSED[name]
    per_stage = layout_of(LAYOUTS[name][0]).world // 2
    stage, rest = divmod(rank, per_stage)
    if inner is None:  # replicas of the stage
        return _theirs(world, ck, "pp2", stage)
    keep = set(_theirs(world, ck, "pp2", stage))
    return {k: v for k, v in _theirs(world, ck, inner, rest).items() if k in keep}


@functools.lru_cache(maxsize=4)
def _unsharded(root: Path, ck: str) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / ck, dtype=torch.float32)
    return model.state_dict(), frozenset(n for n, _ in model.named_parameters())


def _chunked(world: dict[str, Any], ck: str, fsdp: int, rank: int) -> dict[str, torch.Tensor]:
    """What FSDP2's `fully_shard` leaves rank `rank` of `fsdp` of the unsharded model: `torch.chunk` of dim 0
    of every parameter (a shorter last chunk, none past the end), persistent buffers whole."""
    state, params = _unsharded(world["root"], ck)
    out = {}
    for name, t in state.items():
        if name in params:
            parts = torch.chunk(t, fsdp, dim=0)
            t = parts[rank] if rank < len(parts) else t[:0]
        out[name] = t.contiguous()
    return out


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


def _equal_in(ck: str, name: str, error: str | None) -> str:
    if name in COMPOSED:
        return "equal to the composition"
    if name in CHUNKED:
        return ("equal to torch.chunk of the unsharded parameters, and where transformers loads to its ranks" if error
                else "equal, and to torch.chunk of the unsharded parameters")
    return "equal"


@pytest.mark.parametrize("ckpt, name", CASES, ids=[f"{c}-{n}" for c, n in CASES])
def test_rank_files_equal_transformers(world: dict[str, Any], ckpt: str, name: str) -> None:
    sizes = LAYOUTS[name][0]
    layout = layout_of(sizes)
    found = world["found"][f"{ckpt}/{name}"]
    error = next((got["error"] for got in found if "error" in got), None)
    failed = [rank for rank, got in enumerate(found) if "error" in got]
    if name in COMPOSED or (ckpt, name) in TRANSFORMERS_FAILS:
        assert error is not None, f"transformers loads {ckpt} {name} now: compare with it"
    else:
        assert error is None, f"transformers failed to load a combination it supports: {error}"
    names = HFNames(model_type(ckpt))
    fused = 0
    for rank in range(layout.world):
        ours = load_file(str(world["out"] / ckpt / name / rank_file_name(rank, layout.world)))
        what = f"{ckpt} {name} rank {rank}"
        if name in CHUNKED:
            fused += compare(ours, _chunked(world, ckpt, layout.fsdp, rank), names, f"{what} (torch.chunk)")
        if name in COMPOSED or "error" not in found[rank]:
            fused += compare(ours, _expected(world, ckpt, name, rank), names, what)
    if arch_of(ckpt).moe and "fused_experts" not in arch_of(ckpt).traits:
        assert fused > 0, "no per-expert tensor was compared"
    record = world["results"].setdefault(name, {"sizes": sizes, "world": layout.world, "archs": {}})
    extra = ", ".join(f"{k}={v}" for k, v in CHECKPOINTS[ckpt][1].items())
    if error is not None and len(failed) < layout.world:
        error += f" on rank{'s' * (len(failed) > 1)} {', '.join(map(str, failed))} of {layout.world}"
    record["archs"][ckpt] = {"transformers": error or "loads", "reshard": _equal_in(ckpt, name, error),
                             "label": model_type(ckpt) + (f" ({extra})" if extra else "")}


@pytest.mark.parametrize("ckpt, name", FILLED, ids=[f"{c}-{n}" for c, n in FILLED])
def test_fill_model_from_the_service(world: dict[str, Any], ckpt: str, name: str) -> None:
    """transformers' n-D model, every parameter and persistent buffer zeroed, refilled from `reshard serve`:
    every local tensor and the logits are transformers' own, and the service sent each rank its rank file
    and no more (its /metrics, one rank filling at a time)."""
    layout = layout_of(LAYOUTS[name][0])
    for rank, got in enumerate(world["found"][f"{ckpt}/{name}"]):
        assert "error" not in got and not got["peer_failed"] and "fill_error" not in got, got
        file = world["out"] / ckpt / name / rank_file_name(rank, layout.world)
        assert got["zeroed_diff"] > 1e-3, "zeroing the parameters changed nothing: the check would prove nothing"
        assert got["filled_equal"] and got["diff"] <= 1e-5, (rank, got)
        assert got["served"] == file.stat().st_size, (rank, got["served"], file.stat().st_size)
        assert got["layout"] == layout.describe()


def test_fill_model_refuses_a_wrong_placement(world: dict[str, Any]) -> None:
    """transformers' fsdp=2 x tp=2 model offered another layout's shards, then its own with one tensor's FSDP
    chunk moved (and every value changed): both refused in one line before a byte is copied."""
    ck, name, other = REFUSE
    for rank, got in enumerate(world["found"][f"{ck}/{name}"]):
        assert got["other_layout"].startswith(f"CheckpointError: {world['out'] / ck / other / rank_file_name(rank, 4)}: "
                                              f"is the shard of rank {rank} of pp=2 x fsdp=2 x tp=1, but this process is "
                                              f"rank {rank} of fsdp=2 x tp=2"), got["other_layout"]
        wrong = got["wrong_chunk"]
        assert wrong.startswith("PlanError: ") and "shard and model disagree, nothing was filled: " \
            f"{TAMPERED}: the model has shape [16]" in wrong and "\n" not in wrong, wrong
        assert wrong.count("the model has shape") == 1, wrong  # that parameter alone
        assert got["other_layout_unchanged"] and got["wrong_chunk_unchanged"], got


@pytest.mark.parametrize("ckpt, name", CASES, ids=[f"{c}-{n}" for c, n in CASES])
def test_merge_gives_back_the_checkpoint(world: dict[str, Any], tmp_path: Path, ckpt: str, name: str) -> None:
    merge(world["out"] / ckpt / name, tmp_path / "merged", progress=False)
    original = world["root"] / ckpt / "model.safetensors"
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == original.read_bytes()


@pytest.mark.parametrize("ckpt", ["llama", "mixtral", "deepseek_v3"])
def test_relayout_equals_a_direct_write(world: dict[str, Any], tmp_path: Path, ckpt: str) -> None:
    """Shards of one layout written again as another equal rank files written from the checkpoint."""
    start = "ep4_tp2_fsdp2" if ckpt != "llama" else "tp2_fsdp2"
    for target in ("pp2_tp2", "fsdp2", "tp2"):
        src, manifest = open_source(world["out"] / ckpt / start)
        layout = layout_of(LAYOUTS[target][0])
        write_shards(src, make_plan(src, manifest, layout), tmp_path / target, progress=False)
        for rank in range(layout.world):
            file = rank_file_name(rank, layout.world)
            assert (tmp_path / target / file).read_bytes() == (world["out"] / ckpt / target / file).read_bytes()


def test_sixteen_ranks_served_as_written(world: dict[str, Any], tmp_path: Path) -> None:
    """Every rank of a 16-rank layout (pp 2 x dp_replicate 2 x fsdp 2 x tp 2, experts on ep 4) pulled from the
    service is byte-identical to `reshard write`'s file; replicas (dp_replicate) hold the same tensors."""
    from reshard.io.client.shard_client import ShardClient

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


@pytest.mark.parametrize("key", list(NATIVE))
def test_fill_model_into_torch_native_fsdp(world: dict[str, Any], key: str) -> None:
    """A model sharded by torch's own `fully_shard` (no transformers DistributedConfig) filled from the rank
    files of `--fsdp N` (qwen3_moe at 3: the last rank's expert chunk is empty): its logits equal the
    unsharded model's, each rank received its file."""
    ckpt, n = NATIVE[key]
    for rank, got in enumerate(world["found"][key]):
        assert "fill_error" not in got, got
        assert got["zeroed_diff"] > 1e-3 and got["diff"] <= 1e-5 and got["unsharded_diff"] <= 1e-5, (rank, got)
        assert got["filled_equal"], (rank, got)
        assert got["served"] == (world["out"] / ckpt / f"fsdp{n}" / rank_file_name(rank, n)).stat().st_size


def test_cli_pull_of_a_layout(world: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.cli import main

    srv: LiveServer = world["server"]
    dest = tmp_path / "r3.safetensors"
    args = ["pull", srv.ckpt_url("mixtral"), "--rank", "3", "--tp", "2", "--fsdp", "2", "--ep", "4", "-o", str(dest)]
    assert main([*args, "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("pulled rank 3 of fsdp=2 x tp=2 x ep=4")
    assert dest.read_bytes() == (world["out"] / "mixtral" / "ep4_tp2_fsdp2" / rank_file_name(3, 4)).read_bytes()
    assert main([*args[:3], "4", *args[4:], "--no-progress"]) == 1  # rank 4 of a world of 4
    assert "rank=4 is out of range for fsdp=2 x tp=2 x ep=4 (0..3)" in capsys.readouterr().err

