"""Layouts in process: rank coordinates as torch's device meshes number them, transformers' pipeline
stage ranges, refusals with one line naming the rule, the CLI, the service routes and jobs, the trainer's
refusal, and every rank file's tensors as the selections it records cut them from the checkpoint."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open

from reshard.cli import main
from reshard.errors import CheckpointError, PlanError
from reshard.io.sources import open_source
from reshard.io.writer import MANIFEST_NAME, write_shards
from reshard.layout import Layout
from reshard.layout.roles import layer_range
from reshard.plan.planner import make_plan
from reshard.plan.types import plan_to_json, rank_file_name
from reshard.service import Settings, create_app
from tests.support.plan_archs import full_checkpoint

pytestmark = pytest.mark.pure

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "num_experts": 4, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("layouts-api") / "root"
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SIZES)).save_pretrained(root / "moe")
    return root


GRID = [Layout(**dict(zip(("pp", "dp_replicate", "fsdp", "tp", "ep"), s)))
        for s in [(1, 1, 1, 4, 1), (2, 1, 1, 2, 1), (1, 1, 2, 2, 4), (2, 2, 2, 2, 2), (3, 1, 4, 1, 2), (1, 2, 2, 1, 2)]]


@pytest.mark.parametrize("layout", GRID, ids=lambda lay: lay.dir_name() + f"-dpr{lay.dp_replicate}")
def test_coordinates_are_the_meshes(layout: Layout) -> None:
    """`init_device_mesh(shape)` lays ranks out as `arange(world).view(shape)`: each rank's position in the
    dense (pp, dp_replicate, fsdp, tp) and expert (pp, dp_replicate, efsdp, ep) views is its coordinates."""
    dense = torch.arange(layout.world).view(layout.pp, layout.dp_replicate, layout.fsdp, layout.tp)
    expert = torch.arange(layout.world).view(layout.pp, layout.dp_replicate, layout.efsdp, layout.ep)
    for idx in itertools.product(*map(range, dense.shape)):
        c = layout.coords(int(dense[idx]))
        assert (c.pp, c.dp_replicate, c.fsdp, c.tp) == idx
    for idx in itertools.product(*map(range, expert.shape)):
        c = layout.coords(int(expert[idx]))
        assert (c.pp, c.dp_replicate, c.efsdp, c.ep) == idx
    for rank in range(layout.world):
        twins = layout.replicas(rank)
        assert len(twins) == layout.dp_replicate and rank in twins
        assert {(layout.coords(t).pp, layout.coords(t).fsdp, layout.coords(t).tp) for t in twins} == \
            {(layout.coords(rank).pp, layout.coords(rank).fsdp, layout.coords(rank).tp)}


@pytest.mark.parametrize("layers, pp", [(4, 2), (5, 2), (7, 3), (32, 3), (3, 3), (61, 8)])
def test_stage_ranges_are_transformers(layers: int, pp: int) -> None:
    from transformers.distributed.pipeline_parallel import PipelineStage

    for stage in range(pp):
        want = PipelineStage.layer_range_for_rank(SimpleNamespace(pp_size=pp), stage, layers)
        assert layer_range(stage, layers, pp) == want


@pytest.mark.parametrize("sizes, message", [
    ({"ep": 3, "tp": 2, "fsdp": 3}, "ep=3 is not a multiple of tp=2"),
    ({"ep": 4, "tp": 2}, "ep=4 does not divide fsdp x tp = 2 (the expert mesh spans the same ranks as fsdp x tp); "
                         "pick ep in {2} or a larger fsdp"),
    ({"tp": 0}, "tp=0 must be an integer from 1 to 4096"),
    ({"pp": 64, "tp": 128}, "pp=64 x tp=128 is a world of 8192 ranks; at most 4096"),
])
def test_impossible_meshes_are_one_error(sizes: dict[str, int], message: str) -> None:
    with pytest.raises(PlanError) as e:
        Layout(**sizes)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("args, needle", [
    (["--pp", "4"], "pp=4 is more pipeline stages than the 3 layers of this model"),
    (["--ep", "3", "--fsdp", "3"], "ep=3 does not divide the 4 experts of a layer"),
    (["--ep", "2", "--tp", "2"], None),
])
def test_cli_plan_layouts(moe: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str | None) -> None:
    rc = main(["plan", str(moe / "moe"), *args])
    out, err = capsys.readouterr()
    if needle is None:
        assert rc == 0 and "ep=2" in out and "rank" in out, (out, err)
        return
    assert rc == 1 and err.count("\n") == 1 and needle in err, err


def test_dense_model_refuses_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.testing.synth import make_checkpoint, preset_config

    make_checkpoint(tmp_path / "tiny", preset_config("tiny"))
    assert main(["write", str(tmp_path / "tiny"), "--ep", "2", "--fsdp", "2", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "declares no expert-parallel plan" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", [Layout(pp=3), Layout(fsdp=4, ep=4), Layout(pp=3, fsdp=2, tp=2, ep=2),
                                    Layout(fsdp=3, tp=2)], ids=lambda lay: lay.dir_name())
def test_every_tensor_is_its_recorded_selection(moe: Path, tmp_path: Path, layout: Layout) -> None:
    """Each rank file tensor is exactly `full[selection]` of the checkpoint (the unsharded math, uneven FSDP
    chunks included), and reshard.json records the layout."""
    src, manifest = open_source(moe / "moe")
    write_shards(src, make_plan(src, manifest, layout), tmp_path, progress=False)
    full = full_checkpoint(moe / "moe")
    held: dict[str, int] = {}
    for rank in range(layout.world):
        with safe_open(str(tmp_path / rank_file_name(rank, layout.world)), "pt") as f:
            meta = f.metadata()
            assert json.loads(meta["layout"]) == {k: v for k, v in layout.sizes().items() if v != 1 or k == "tp"}
            c = layout.coords(rank)
            assert json.loads(meta["coords"]) == {"pp": c.pp, "dp_replicate": c.dp_replicate, "fsdp": c.fsdp,
                                                  "tp": c.tp, "efsdp": c.efsdp, "ep": c.ep}
            desc = json.loads(meta["tensors"])
            for name in f.keys():
                index = tuple(torch.cat([torch.arange(a, b) for a, b in dim]) if dim else torch.arange(0)
                              for dim in desc[name]["select"])
                want = full[name][torch.meshgrid(*index, indexing="ij")] if index else full[name]
                assert torch.equal(f.get_tensor(name), want), (rank, name)
                held[name] = held.get(name, 0) + want.numel()
    assert set(held) == set(full)  # every tensor somewhere
    record = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert record["layout"] == layout.sizes() and record["world"] == layout.world


def test_trainer_refuses_other_layouts(moe: Path, tmp_path: Path) -> None:
    from reshard.trainer import build_model

    src, manifest = open_source(moe / "moe")
    write_shards(src, make_plan(src, manifest, Layout(pp=2)), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"is a shard of pp=2 x tp=1; the bundled trainer runs tensor "
                                              r"parallelism only: write rank files of tp=1 alone"):
        build_model(tmp_path / rank_file_name(0, 2))


@pytest.fixture
def client(moe: Path, tmp_path: Path) -> Any:
    with TestClient(create_app(Settings(root=moe, out=tmp_path / "out"))) as c:
        yield c


def test_service_plan_shard_and_job(client: TestClient, moe: Path, tmp_path: Path) -> None:
    layout = Layout(pp=2, fsdp=2, tp=2, ep=4)
    q = "tp=2&pp=2&fsdp=2&ep=4"
    src, manifest = open_source(moe / "moe")
    plan = make_plan(src, manifest, layout)
    body = client.get(f"/v1/checkpoints/moe/plan?{q}&tensors=false").json()
    want = plan_to_json(plan, tensors=False)
    assert (body["layout"], body["world"], body["plan"]) == (layout.sizes(), 8, want["plan"])
    assert [r["bytes"] for r in body["ranks"]] == [r["bytes"] for r in want["ranks"]]
    write_shards(src, plan, tmp_path / "written", progress=False)
    r = client.get(f"/v1/checkpoints/moe/shards/5?{q}")
    assert r.status_code == 200 and r.content == (tmp_path / "written" / rank_file_name(5, 8)).read_bytes()
    assert 'filename="rank-00005-of-00008.safetensors"' in r.headers["content-disposition"]
    bad = client.get("/v1/checkpoints/moe/plan?tp=2&ep=3")
    assert bad.status_code == 422 and bad.json()["error"] == "PlanError" and "ep=3" in bad.json()["detail"]
    job = client.post("/v1/checkpoints/moe/jobs", json={"tp": 2, "pp": 2, "fsdp": 2, "ep": 4, "ranks": [3]}).json()
    assert job["layout"] == layout.sizes() and job["output_dir"].endswith("moe/pp-2-fsdp-2-tp-2-ep-4")
    for _ in range(200):
        job = client.get(f"/v1/jobs/{job['id']}").json()
        if job["state"] in ("done", "failed"):
            break
        time.sleep(0.05)
    assert job["state"] == "done", job
    written = Path(job["outputs"][0])
    assert written.name == rank_file_name(3, 8) and written.read_bytes() == (tmp_path / "written" / written.name).read_bytes()
