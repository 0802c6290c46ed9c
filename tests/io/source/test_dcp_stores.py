"""A DCP checkpoint read from S3 (a moto server), over plain HTTP (a static Range server) and served by
`reshard serve`: the same rank files as from the HF checkpoint, each rank reading only part of the files;
`fill_model` from the service's URL of a DCP directory fills a transformers model with the checkpoint's
values; a crafted `.metadata` under the served root is answered 422 and runs nothing."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from reshard.cli import main
from reshard.errors import CheckpointError
from reshard.io.source.opener import open_source
from reshard.testing.local_servers import StoreServer, http_server
from tests.support.dcp_ckpts import Payload, dcp_save, hf_ckpt, hf_writer_save
from tests.support.live import LiveServer, live_server

pytestmark = pytest.mark.servers

BUCKET, PREFIX = "ckpts", "dcp-tests"  # the bucket of tests/io/conftest.py's `s3`


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp-stores")
    ckpt = hf_ckpt(root / "hf", intermediate_size=1024, vocab_size=2048)  # 2.6 MB: tensors of 260-530 KB
    dcp_save(ckpt, root / "dcp", wrap=True)
    hf_writer_save(ckpt, root / "hfw")
    shutil.copytree(root / "dcp", root / "crafted")  # a .metadata that creates a directory when unpickled
    (root / "crafted" / ".metadata").write_bytes(pickle.dumps(Payload(root / "created-by-the-server")))
    return root


@pytest.fixture
def in_bucket(root: Path, s3: StoreServer, s3_env: dict[str, str], boto: Any) -> str:
    """The three directories in the io tests' bucket (tests/io/conftest.py), under `dcp-tests/`; this process
    pointed at it."""
    if not boto.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/").get("Contents"):
        for name in ("hf", "dcp", "hfw"):
            for p in sorted((root / name).iterdir()):
                boto.upload_file(str(p), BUCKET, f"{PREFIX}/{name}/{p.name}")
    return f"s3://{BUCKET}/{PREFIX}"


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(root, out=tmp_path_factory.mktemp("out"), log_dir=tmp_path_factory.mktemp("logs")) as srv:
        yield srv
        assert "Traceback" not in srv.log(), srv.log()


def _rank_files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("rank-*.safetensors"))}


def _write(src: str | Path, out: Path, *args: str) -> dict[str, bytes]:
    assert main(["write", str(src), "--tp", "2", *args, "-o", str(out), "--no-progress"]) == 0
    return _rank_files(out)


def _weights_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith((".distcp", ".safetensors")))


def _served_for_rank_0(srv: StoreServer, url: str, out: Path) -> tuple[dict[str, bytes], int]:
    srv.reset()
    got = _write(url, out, "--ranks", "0")
    return got, srv.counts()["bytes"]


@pytest.mark.parametrize("name", ["dcp", "hfw"])
def test_from_s3(root: Path, s3: StoreServer, in_bucket: str, tmp_path: Path, name: str) -> None:
    want = _write(root / "hf", tmp_path / "want")
    got, served = _served_for_rank_0(s3, f"{in_bucket}/{name}", tmp_path / "one")
    assert got == {n: b for n, b in want.items() if n.startswith("rank-00000")}
    _, from_hf = _served_for_rank_0(s3, f"{in_bucket}/hf", tmp_path / "hf-one")
    # rank 0's part, read as from the HF checkpoint, and each item's head and tail (a few KB): not all of it
    assert served < min(1.1 * from_hf, 0.75 * _weights_bytes(root / name)), (served, from_hf)
    assert _write(f"{in_bucket}/{name}", tmp_path / "all") == want


def test_from_plain_http(root: Path, tmp_path: Path) -> None:
    """No listing needed for `dcp.save`'s directory: `.metadata` names its files. The shard files of
    HuggingFaceStorageWriter have no index, so a server that cannot list cannot offer them: one clear error."""
    with http_server(root) as web:
        _from_plain_http(root, web, tmp_path)


def _from_plain_http(root: Path, web: StoreServer, tmp_path: Path) -> None:
    want = _write(root / "hf", tmp_path / "want")
    got, served = _served_for_rank_0(web, f"{web.url}/files/dcp/", tmp_path / "one")
    assert got == {n: b for n, b in want.items() if n.startswith("rank-00000")}
    _, from_hf = _served_for_rank_0(web, f"{web.url}/files/hf/", tmp_path / "hf-one")
    assert served < min(1.1 * from_hf, 0.75 * _weights_bytes(root / "dcp")), (served, from_hf)
    with pytest.raises(CheckpointError, match="a plain HTTP server cannot list files"):
        open_source(f"{web.url}/files/hfw/")


def test_served_and_filled(root: Path, service: LiveServer, tmp_path: Path) -> None:
    want = _write(root / "hf", tmp_path / "want")
    for name in ("dcp", "hfw"):
        out = tmp_path / f"pulled-{name}"
        out.mkdir()
        for rank in range(2):
            dest = out / f"rank-{rank:05d}-of-00002.safetensors"
            assert main(["pull", service.ckpt_url(name), "--rank", str(rank), "--tp", "2", "-o", str(dest),
                         "--no-progress"]) == 0
        assert _rank_files(out) == want, name
    crafted = httpx.get(service.ckpt_url("crafted") + "/shards/0", params={"tp": 2}, timeout=60)
    assert crafted.status_code == 422 and crafted.json()["error"] == "CheckpointError"
    assert "refused: this DCP .metadata asks for os.makedirs" in crafted.json()["detail"]
    assert not (root / "created-by-the-server").exists()
    model = _fill(service.ckpt_url("dcp"), root / "hf")
    hf = load_file(root / "hf" / "model.safetensors")
    assert {n: torch.equal(t, hf[n]) for n, t in model.state_dict().items()} == dict.fromkeys(hf, True)


def _fill(url: str, ckpt: Path) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    import reshard

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    model.to_empty(device="cpu")
    for t in model.state_dict().values():
        t.fill_(float("nan"))
    reshard.fill_model(model, url, layout=reshard.Layout(tp=1))
    return model
