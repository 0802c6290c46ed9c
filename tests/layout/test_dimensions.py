"""The parallel dimensions are one tuple (`reshard.layout.mesh.DIMENSIONS`): the CLI's flags, the
service's query parameters and job body, a DistributedConfig's sizes and the names of rank directories
all come from it, and `Layout.from_sizes` builds a layout from any of them."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from reshard.cli.commands import add_layout_flags, layout_of
from reshard.errors import PlanError
from reshard.layout.mesh import DIMENSIONS, DIMS, DIR_NAME, MESH_ORDER, Layout
from reshard.rules.engines import known_engines
from reshard.service import Settings, create_app
from reshard.service.api.schemas import JobIn

pytestmark = pytest.mark.pure


def test_one_tuple_names_every_dimension() -> None:
    assert DIMS == ("tp", "pp", "fsdp", "ep", "dp_replicate") == tuple(f for f in Layout.__dataclass_fields__)
    assert MESH_ORDER == ("pp", "dp_replicate", "fsdp", "tp", "ep")
    assert all(d.default == 1 and d.help for d in DIMENSIONS)


def test_from_sizes() -> None:
    assert Layout.from_sizes({"tp": 2, "fsdp": 2}) == Layout(tp=2, fsdp=2)
    assert Layout.from_sizes({}) == Layout()
    assert Layout.from_sizes(SimpleNamespace(tp=2, pp=3, other="x")) == Layout(tp=2, pp=3)
    config = SimpleNamespace(tp_size=2, pp_size=1, fsdp_size=2, ep_size=4, dp_replicate_size=3)
    assert Layout.from_sizes({d: getattr(config, f"{d}_size") for d in DIMS}) == Layout(2, 1, 2, 4, 3)
    with pytest.raises(PlanError, match="ep=3 is not a multiple of tp=2"):
        Layout.from_sizes({"tp": 2, "ep": 3, "fsdp": 3})


def test_cli_flags_from_the_tuple() -> None:
    p = argparse.ArgumentParser()
    add_layout_flags(p)
    args = p.parse_args(["--tp", "2", "--pp", "2", "--fsdp", "2", "--ep", "4", "--dp-replicate", "3"])
    assert layout_of(args) == Layout(tp=2, pp=2, fsdp=2, ep=4, dp_replicate=3)
    assert layout_of(p.parse_args([])) == Layout()


def test_rank_directory_names() -> None:
    names = [Layout(tp=2).dir_name(), Layout(tp=2, pp=2, fsdp=2, ep=4).dir_name(),
             Layout(tp=1, dp_replicate=2, fsdp=3).dir_name()]
    assert names == ["tp-2", "pp-2-fsdp-2-tp-2-ep-4", "dp_replicate-2-fsdp-3-tp-1"]
    assert all(DIR_NAME.match(n) for n in names)
    assert not DIR_NAME.match("ep-2-tp-2") and not DIR_NAME.match("tp-2-pp-2")
    assert Layout(tp=2, pp=2, fsdp=2, ep=4).describe() == "pp=2 x fsdp=2 x tp=2 x ep=4"


def test_service_parameters_from_the_tuple(tmp_path: object) -> None:
    schema = create_app(Settings(root=str(tmp_path))).openapi()
    params = schema["paths"]["/v1/checkpoints/{name}/plan"]["get"]["parameters"]
    layout = [(q["name"], q["schema"]["default"], q["description"]) for q in params if q["name"] in DIMS]
    assert layout == [(d.name, d.default, d.help) for d in DIMENSIONS]
    engine = next(q for q in params if q["name"] == "engine")["schema"]["anyOf"][0]
    assert [engine["const"]] == known_engines() == ["vllm"]
    assert list(JobIn.model_fields)[:len(DIMS)] == list(DIMS)
    assert JobIn(tp=2, ep=2).model_dump(include=set(DIMS)) == {"tp": 2, "pp": 1, "fsdp": 1, "ep": 2, "dp_replicate": 1}


def test_service_answers_unknown_engines_and_bad_sizes_with_422(tmp_path: object) -> None:
    client = TestClient(create_app(Settings(root=str(tmp_path))))
    r = client.get("/v1/checkpoints/m/plan", params={"tp": 2, "engine": "sglang"})
    assert r.status_code == 422 and r.json()["error"] == "ValidationError" and "engine" in r.json()["detail"]
    r = client.get("/v1/checkpoints/m/plan", params={"fsdp": 0})
    assert r.status_code == 422 and r.json()["detail"].startswith("query.fsdp:")
