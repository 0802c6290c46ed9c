"""One source notion everywhere: `plan`, `write`, `merge` and `pull` take the service's checkpoint URL as they
take a path, and give the same answer. The reference for each is the same command on the local directory
the server serves (plans equal but for the service's ETags, rank files byte-identical, the merged tensors
equal the original's, every small file kept)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.core import assert_one_error_line, run_cli
from tests.support.live import LiveServer, live_server, make_ckpt

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]

NAME = "llama"
SMALL = {"generation_config.json": {"max_new_tokens": 9, "do_sample": False},
         "tokenizer_config.json": {"model_max_length": 128}}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sources") / "root"
    ckpt = make_ckpt(root / NAME, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=256, num_files=2)
    for name, obj in SMALL.items():
        (ckpt / name).write_text(json.dumps(obj))
    return root


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(root, out=tmp_path_factory.mktemp("jobs"), log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert "Traceback" not in srv.log(), srv.log()


def test_plan_of_the_service_url_is_the_local_plan(server: LiveServer, root: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = server.ckpt_url(NAME)
    rc, remote, err = run_cli(["plan", url, "--tp", "2", "--json"], capsys)
    assert rc == 0 and err == ""
    rc, local, _ = run_cli(["plan", root / NAME, "--tp", "2", "--json"], capsys)
    got, want = json.loads(remote), json.loads(local)
    for entry in got["ranks"]:
        assert entry.pop("etag").startswith(f'"{got["plan"][:40]}-r')
    assert got == want  # the same plan, digest included (the source identity is the files', not their path)
    rc, text, err = run_cli(["plan", url, "--tp", "4"], capsys)
    assert rc == 0 and err == "" and text.startswith(f"checkpoint: {url} (")
    assert len([line for line in text.splitlines() if line.strip()[:1].isdigit()]) == 4  # a line per rank
    rc, _, err = run_cli(["plan", url, "--tp", "3"], capsys)
    assert_one_error_line(rc, err, "pick a tp that plans this checkpoint: 1, 2, 4")


def test_write_from_the_service_url_is_the_local_write(server: LiveServer, root: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    url = server.ckpt_url(NAME)
    rc, out, err = run_cli(["write", url, "--tp", "2", "-o", tmp_path / "remote", "--no-progress", "--json"], capsys)
    assert rc == 0 and err == "", err
    assert run_cli(["write", root / NAME, "--tp", "2", "-o", tmp_path / "local", "--no-progress"], capsys)[0] == 0
    names = sorted(p.name for p in (tmp_path / "local").iterdir() if p.name != "reshard.json")
    assert names == sorted(p.name for p in (tmp_path / "remote").iterdir() if p.name != "reshard.json")
    assert names == ["config.json", "generation_config.json", "rank-00000-of-00002.safetensors",
                     "rank-00001-of-00002.safetensors", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    record = json.loads((tmp_path / "remote" / "reshard.json").read_text())
    assert record["source"] == {"url": url} and record["tp"] == 2
    assert json.loads(out)["files"] == record["files"]
    # the folder now holds tp=2 files: tp=4 from the service is refused as from a path, then --force replaces
    rc, _, err = run_cli(["write", url, "--tp", "4", "-o", tmp_path / "remote", "--no-progress"], capsys)
    assert_one_error_line(rc, err, "holds 2 rank files of tp=2, not tp=4; write into a new folder, or add --force")
    rc, _, err = run_cli(["write", url, "--tp", "4", "-o", tmp_path / "remote", "--no-progress", "--force"], capsys)
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "remote").glob("rank-*")) == [
        f"rank-0000{r}-of-00004.safetensors" for r in range(4)]


def test_merge_of_the_service_url_is_the_checkpoint_whole(server: LiveServer, root: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["merge", server.ckpt_url(NAME), "-o", tmp_path / "merged", "--no-progress", "--json"], capsys)
    assert rc == 0 and err == "", err
    got = json.loads(out)
    assert got["kept"] == ["config.json", "generation_config.json", "tokenizer_config.json"]
    src = root / NAME
    want = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    have = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(have) == set(want) and all(bool((have[k] == want[k]).all()) and have[k].dtype == want[k].dtype
                                          for k in want)
    for name in got["kept"]:
        assert (tmp_path / "merged" / name).read_bytes() == (src / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # the pulled tp=1 file is gone


def test_pull_of_a_path_and_of_the_url_give_the_same_file(server: LiveServer, root: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a" / "r.safetensors", tmp_path / "b" / "r.safetensors"
    rc, out, err = run_cli(["pull", server.ckpt_url(NAME), "--tp", "4", "--rank", "3", "-o", a, "--no-progress",
                            "--json"], capsys)
    assert rc == 0 and err == ""
    assert json.loads(out)["sha256"] == json.loads(run_cli(["pull", root / NAME, "--tp", "4", "--rank", "3", "-o", b,
                                                            "--no-progress", "--json"], capsys)[1])["sha256"]
    assert a.read_bytes() == b.read_bytes()
