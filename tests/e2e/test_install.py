"""The base install: reshard's wheel in a fresh virtual environment with no torch and no transformers runs
`plan`, `write`, `serve` (two workers) + `pull` and a write job, and `merge` end to end, and never tries to
import either; and `./run`'s choice of torch build (scripts/torch_choice.py).

The environment (tests/support/installs.py) holds the wheel built from this checkout and exactly the
distributions its metadata requires; every import of torch or transformers in any of its processes is
recorded and refused. The checkpoint is made here, by this process (bfloat16, two files + index), and
every output is checked against it with torch on this side: rank tensors against `torch.chunk` of the
full tensors, the pulled shard against the written one byte for byte, the merged checkpoint against the
source tensor for tensor.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.support.installs import HEAVY, BaseVenv, fake_wheel, torch_choice
from tests.support.live import live_server, make_ckpt, run_job

pytestmark = pytest.mark.e2e

TP = 2
NOT_IN_BASE = ("torch", "transformers", "triton", "nvidia-", "cuda-")  # nor any CUDA wheel
SPLIT_DIM = {"column": 0, "vocab_embed": 0, "row": 1}  # the kinds a llama plan uses, and `replicate`


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BaseVenv]:
    tmp = tmp_path_factory.mktemp("install")
    venv = BaseVenv.create(tmp / "venv", wheel_dir=tmp / "dist")
    yield venv
    assert venv.imports_attempted() == "", f"the base install tried to import {' or '.join(HEAVY)}"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("install-root")
    make_ckpt(root / "tiny", dtype=torch.bfloat16, num_files=2, vocab_size=256, num_key_value_heads=2)
    return root


def _full(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def _clean(r: subprocess.CompletedProcess[str]) -> None:
    """Exit status 0 and no traceback."""
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.args, r.returncode, r.stderr)


def _assert_no_imports(base: BaseVenv) -> None:
    assert base.imports_attempted() == ""


def test_the_base_install_has_no_torch(base: BaseVenv) -> None:
    names = sorted(base.deps)
    assert [n for n in names if n.startswith(NOT_IN_BASE)] == []
    assert "fastapi" in names and "safetensors" in names and "uvloop" in names  # uvicorn[standard]'s extras followed
    check = base.pip("check")  # every requirement of reshard and of its dependencies met, torch absent
    assert check.returncode == 0, check.stdout + check.stderr
    listed = {d["name"].lower() for d in json.loads(base.pip("list", "--format", "json").stdout)}
    assert "reshard" in listed and [n for n in listed if n.startswith(NOT_IN_BASE)] == []
    where = base.python_run("import reshard, importlib.metadata as m; print(reshard.__file__); "
                            "print([d for d in ('torch', 'transformers') if any(m.distributions(name=d))]); "
                            "(ep,) = m.entry_points(group='vllm.general_plugins', name='reshard'); "
                            "print(callable(ep.load()))")  # the vLLM plugin's entry point loads (register runs in vLLM)
    _clean(where)
    file, found, plugin = where.stdout.splitlines()
    assert Path(file).is_relative_to(base.root), file  # the wheel's copy, not this checkout's
    assert (found, plugin) == ("[]", "True"), where.stdout
    _assert_no_imports(base)
    refused = base.python_run("import torch")
    assert refused.returncode == 1 and "refused in a base install" in refused.stderr
    base.log.unlink()  # that attempt was this test's own


def test_plan_and_write_without_torch(base: BaseVenv, root: Path, tmp_path: Path) -> None:
    plan = base.run("plan", root / "tiny", "--tp", TP, "--json")
    _clean(plan)
    ranks = json.loads(plan.stdout)["ranks"]
    written = base.run("write", root / "tiny", "--tp", TP, "-o", tmp_path / "out", "--no-progress")
    _clean(written)
    full = _full(root / "tiny")
    for r in ranks:
        got = load_file(tmp_path / "out" / r["file"])
        assert sorted(got) == sorted(full)
        for t in r["tensors"]:
            dim = SPLIT_DIM.get(t["kind"])
            want = full[t["name"]] if t["kind"] == "replicate" else torch.chunk(full[t["name"]], TP, dim)[r["rank"]]
            assert torch.equal(got[t["name"]].view(torch.int16), want.view(torch.int16)), t["name"]
    kinds = {t["name"]: t["kind"] for t in ranks[0]["tensors"]}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "column"
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "row"
    _assert_no_imports(base)


def test_merge_without_torch(base: BaseVenv, root: Path, tmp_path: Path) -> None:
    _clean(base.run("write", root / "tiny", "--tp", TP, "-o", tmp_path / "out", "--no-progress"))
    merged = base.run("merge", tmp_path / "out", "-o", tmp_path / "merged", "--json")
    _clean(merged)
    full, back = _full(root / "tiny"), {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        back.update(load_file(f))
    assert sorted(back) == sorted(full)
    for name, t in full.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name].view(torch.int16), t.view(torch.int16)), name
    assert json.loads((tmp_path / "merged" / "config.json").read_text()) == json.loads((root / "tiny" / "config.json").read_text())
    _assert_no_imports(base)


def test_serve_pull_and_jobs_without_torch(base: BaseVenv, root: Path, tmp_path: Path) -> None:
    _clean(base.run("write", root / "tiny", "--tp", TP, "-o", tmp_path / "out", "--no-progress"))
    with live_server(root, command=base.command(), environ=base.env(), workers=2, log_dir=tmp_path) as srv:
        for rank in range(TP):
            dest = tmp_path / f"pulled-{rank}.safetensors"
            _clean(base.run("pull", srv.ckpt_url("tiny"), "--tp", TP, "--rank", rank, "-o", dest, "--no-progress"))
            written = tmp_path / "out" / f"rank-{rank:05d}-of-{TP:05d}.safetensors"
            assert dest.read_bytes() == written.read_bytes()
        _clean(base.run("pull", srv.ckpt_url("tiny"), "--meta", "-o", tmp_path / "meta"))
        assert (tmp_path / "meta" / "config.json").read_bytes() == (root / "tiny" / "config.json").read_bytes()
        with safe_open(str(tmp_path / "pulled-1.safetensors"), "np") as f:  # its self-description
            assert (f.metadata()["rank"], f.metadata()["tp"]) == ("1", str(TP))
        job = run_job(srv.url, "tiny", TP)  # a write job in the service's worker
        assert job["state"] == "done", job
        for path in map(Path, job["outputs"]):
            assert path.read_bytes() == (tmp_path / "out" / path.name).read_bytes()
        assert srv.alive(), srv.log()
    assert "Traceback" not in srv.log(), srv.log()
    _assert_no_imports(base)


# --- ./run's torch build (scripts/torch_choice.py), on wheels pip finds in a folder ---------------------------

CUDA_REQS = ["nvidia-cublas; platform_system == 'Linux'", "triton==9.9; platform_system == 'Linux'"]


@pytest.mark.parametrize(("wheels", "gpu", "how", "says"), [
    ({"9.0.0+cpu": []}, False, "default", "torch==9.0.0+cpu (it needs no CUDA package)"),
    ({"9.0.0": CUDA_REQS}, False, "cpu-index", "torch==9.0.0, a CUDA build (it requires 2 CUDA packages): the CPU build from"),
    ({"9.0.0": CUDA_REQS}, True, "default", "torch==9.0.0 (a CUDA build: nvidia-smi sees a GPU)"),
    # a local CPU wheel beside the index's CUDA one (this machine's set-up): its local version sorts higher
    ({"9.0.0": CUDA_REQS, "9.0.0+cpu": []}, False, "default", "torch==9.0.0+cpu"),
    # CUDA packages for another platform only
    ({"9.0.0": ["nvidia-cublas; platform_system == 'Windows'"]}, False, "default", "it needs no CUDA package"),
])
def test_torch_choice(tmp_path: Path, wheels: dict[str, list[str]], gpu: bool, how: str, says: str) -> None:
    for version, reqs in wheels.items():
        fake_wheel(tmp_path / "wheels", "torch", version, reqs)
    (tmp_path / "pins.txt").write_text("torch==9.0.0\n")
    got = torch_choice(tmp_path, "pins.txt", gpu=gpu)
    assert got.split("\t")[0] == how and says in got, got


def test_torch_choice_keeps_an_installed_torch(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "pins.txt").write_text(f"torch=={torch.__version__.split('+')[0]}\n")  # this environment's torch
    assert torch_choice(tmp_path, "pins.txt", gpu=False) == f"keep\ttorch {torch.__version__} is installed and meets the pin"
