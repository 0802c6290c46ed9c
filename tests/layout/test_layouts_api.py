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
from reshard.format.rank_file import rank_file_name
from reshard.io.sinks.write import write_shards
from reshard.io.sinks.writer import MANIFEST_NAME
from reshard.io.source.opener import open_source
from reshard.layout import Layout
from reshard.layout.roles import layer_range
from reshard.plan.planner import make_plan
from reshard.plan.types import plan_to_json
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
    """One rank file of pp=2 is not the tp=1 model's file; a layout beyond fsdp x tp is refused."""
    from reshard.trainer import build_model

    src, manifest = open_source(moe / "moe")
    write_shards(src, make_plan(src, manifest, Layout(pp=2)), tmp_path, progress=False)
    with pytest.raises(CheckpointError, match=r"is the shard of rank 0 of pp=2 x tp=1, but this process is rank 0 "
                                              r"of tp=1; give it rank 0's shard of tp=1"):
        build_model(tmp_path / rank_file_name(0, 2))
    with pytest.raises(CheckpointError, match=r"fills fsdp x tp layouts .* not pp=2 x tp=1"):
        build_model(tmp_path, layout=Layout(pp=2), rank=0)


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


def test_service_tp_defaults_to_one(client: TestClient, moe: Path, tmp_path: Path) -> None:
    """A request without `?tp=` is tp=1, as every other size: the plan and the shard of `Layout(pp=2)`."""
    src, manifest = open_source(moe / "moe")
    plan = make_plan(src, manifest, Layout(pp=2))
    body = client.get("/v1/checkpoints/moe/plan?pp=2&tensors=false").json()
    assert (body["tp"], body["layout"], body["plan"]) == (1, Layout(pp=2).sizes(), plan_to_json(plan)["plan"])
    write_shards(src, plan, tmp_path / "pp2", progress=False)
    r = client.get("/v1/checkpoints/moe/shards/1?pp=2")
    assert r.status_code == 200 and r.content == (tmp_path / "pp2" / rank_file_name(1, 2)).read_bytes()
    write_shards(src, make_plan(src, manifest, 1), tmp_path / "tp1", progress=False)
    assert client.get("/v1/checkpoints/moe/shards/0").content == (tmp_path / "tp1" / rank_file_name(0, 1)).read_bytes()


def _names_of_stages(model: torch.nn.Module, names: set[str], pp: int) -> list[set[str]]:
    """What each pipeline stage holds of checkpoint `names`, from transformers' own model: its pipeline plan's
    modules in order, the one that is a ModuleList the layers (split by `layer_range_for_rank`), those before
    it on the first stage, those after it and `lm_head` on the last."""
    from transformers.distributed.pipeline_parallel import PipelineStage

    base, prefix = model.base_model, model.base_model_prefix
    modules = list(model.config.base_model_pp_plan)
    at = next(i for i, m in enumerate(modules) if isinstance(getattr(base, m), torch.nn.ModuleList))
    stages: list[set[str]] = [set() for _ in range(pp)]
    for stage in range(pp):
        lo, hi = PipelineStage.layer_range_for_rank(SimpleNamespace(pp_size=pp), stage, len(getattr(base, modules[at])))
        for name in names:
            module = next((i for i, m in enumerate(modules) if name.startswith(f"{prefix}.{m}.")), None)
            if name.startswith("lm_head.") or (module is not None and module > at):
                held = stage == pp - 1
            elif module is not None and module < at:
                held = stage == 0
            elif module == at:
                held = lo <= int(name.split(".")[2]) < hi
            else:
                held = True
            if held:
                stages[stage].add(name)
    return stages


def test_pipeline_plan_places_a_stack_of_another_name(tmp_path: Path) -> None:
    """GPT-J's decoder layers are `transformer.h.N` (pipeline plan wte, drop, h, ln_f), not `PREFIX.layers.N`:
    each stage holds its own layers, the embedding the first, the final norm and head the last
    (transformers' own pp cannot load it: `'GPTJModel' object has no attribute 'layers'`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.plan_archs import ARCHS

    arch = next(a for a in ARCHS if a.model_type == "gptj")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gptj", **{**arch.config_kwargs, "n_layer": 3, "num_hidden_layers": 3}))
    model.save_pretrained(tmp_path / "gptj")
    full = full_checkpoint(tmp_path / "gptj")
    src, manifest = open_source(tmp_path / "gptj")
    plan = make_plan(src, manifest, Layout(pp=2))
    want = _names_of_stages(model, set(full), 2)
    assert [{t.name for t in rp.tensors} for rp in plan.ranks] == want
    assert "transformer.h.1.attn.q_proj.weight" in want[0] and "transformer.h.2.mlp.fc_in.weight" in want[1]


def test_pp_without_a_layer_stack_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    (tmp_path / "odd").mkdir()
    save_file({f"model.blocks.{i}.weight": torch.ones(4, 4) for i in range(2)}, str(tmp_path / "odd" / "model.safetensors"))
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert main(["plan", str(tmp_path / "odd"), "--pp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pp=2: no tensor of this llama checkpoint is in a decoder layer of its pipeline " \
        "plan (model.{embed_tokens,layers,norm}.N), so its stages are unknown; use pp=1" in err, err
    assert main(["plan", str(tmp_path / "odd"), "--pp", "1"]) == 0


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", "3", "num_hidden_layers='3' must be a positive integer"),
    ("num_hidden_layers", 0, "num_hidden_layers=0 must be a positive integer"),
    ("num_hidden_layers", 2.0, "num_hidden_layers=2.0 must be a positive integer"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
    ("tie_word_embeddings", 0, "tie_word_embeddings=0 must be true or false"),
])
def test_config_fields_are_checked(moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str,
                                   value: Any, message: str) -> None:
    """`bool("false")` is True: a config.json field of the wrong type is one error naming it, not a guess."""
    ckpt = tmp_path / "moe"
    ckpt.mkdir()
    for p in (moe / "moe").iterdir():
        (ckpt / p.name).symlink_to(p)
    config = json.loads((moe / "moe" / "config.json").read_text())
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").write_text(json.dumps({**config, field: value}))
    assert main(["plan", str(ckpt), "--pp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"config.json: {message}; fix config.json" in err, err


def test_ranks_of_one_stage_share_a_planner(moe: Path) -> None:
    """Ranks holding the same tensors plan with one planner: without ep every rank of a stage (tp and fsdp
    cut the same tensors); with ep those holding the same experts."""
    from reshard.plan.planner import make_planner

    src, manifest = open_source(moe / "moe")
    for layout, groups in [(Layout(tp=4, pp=2), [[0, 1, 2, 3], [4, 5, 6, 7]]),
                           (Layout(tp=2, fsdp=2, pp=2), [[0, 1], [2, 3], [4, 5], [6, 7]]),  # experts chunked by fsdp
                           (Layout(tp=2, ep=2), [[0], [1]]), (Layout(tp=2, fsdp=2, ep=2), [[0], [1], [2], [3]])]:
        planner, _ = make_planner(src, manifest, layout)
        shared = {}
        for rank in range(layout.world):
            shared.setdefault(id(planner.planner(rank)), []).append(rank)
        assert sorted(shared.values()) == groups, layout


@pytest.mark.parametrize("layout", [Layout(tp=2, ep=2), Layout(pp=3), Layout(pp=2, fsdp=2, tp=2, ep=4), Layout(tp=4),
                                    Layout(fsdp=2, tp=2)], ids=lambda lay: lay.dir_name())
def test_replicated_is_held_whole_by_another_rank(moe: Path, tmp_path: Path, layout: Layout) -> None:
    """A rank's replicated bytes are those of the tensors it holds whole that another rank of its model
    replica (its stage's fsdp x tp ranks) holds whole too, read from the rank files: not an expert only it holds."""
    src, manifest = open_source(moe / "moe")
    plan = make_plan(src, manifest, layout)
    write_shards(src, plan, tmp_path, progress=False)
    whole: list[dict[str, int]] = []
    for rank in range(layout.world):
        with safe_open(str(tmp_path / rank_file_name(rank, layout.world)), "pt") as f:
            desc = json.loads(f.metadata()["tensors"])
            whole.append({n: f.get_tensor(n).nbytes for n in f.keys()
                          if desc[n]["select"] == [[[0, size]] for size in desc[n]["shape"]]})
    block = layout.fsdp * layout.tp
    for rank, rp in enumerate(plan.ranks):
        peers = [p for p in range(rank - rank % block, rank - rank % block + block) if p != rank]
        want = sum(n for name, n in whole[rank].items() if any(name in whole[p] for p in peers))
        assert rp.stats()["replicated_bytes"] == want, (rank, rp.stats())
    total = [rp.stats()["replicated_bytes"] for rp in plan.ranks]
    if layout.fsdp == 1:  # norms are replicated over tp (FSDP shards them); nothing is within one rank
        assert (min(total) > 0) == (block > 1), total
