"""`fill_model` from local rank files without a copy (`reshard.fill.mapped_params`) and the sha256 off the critical
path (`reshard.io.verified`): parameters that are views of the file where claimed, copies where a cast or
a fused expert parameter needs one, values equal to transformers' own load; a corrupt, truncated or
rewritten file refused in every mode that verifies; a writer of a mapped file waits until the model has
its own copy; the fill path importing neither httpx nor pydantic-settings; a corrupt stream refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.errors import IntegrityError
from reshard.fill.into_params import read_header_from
from reshard.io.client.body import file_body
from tests.support.fill_checks import ids_for
from tests.support.live import LoopbackProxy

transformers = pytest.importorskip("transformers")

RANK1 = "rank-00000-of-00001.safetensors"
REPO = Path(__file__).resolve().parents[2]


def _mapped_regions(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path.resolve()):
            a, b = (int(x, 16) for x in parts[0].split("-"))
            out.append((a, b))
    return out


def _in_file(t: torch.Tensor, regions: list[tuple[int, int]]) -> bool:
    return any(a <= t.data_ptr() < b for a, b in regions)


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: p._local_tensor if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _logits(model: Any, vocab: int = 256) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_for(vocab)).logits


@pytest.mark.pure
def test_parameters_are_views_of_the_rank_file(fill_root: Path, llama_shards: dict[str, Path]) -> None:
    shards = llama_shards["tp1"]
    model = reshard.empty_tp_model(shards)
    report = reshard.fill_model(model, shards)
    header, _ = read_header_from(file_body(shards / RANK1), str(shards))
    data = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.entries.values())
    assert report.mapped == data and report.verified == "identity"  # recorded by `reshard write`
    regions = _mapped_regions(shards / RANK1)
    assert regions and all(_in_file(t, regions) for t in _locals(model).values())  # not copied: the file's pages
    want = load_file(shards / RANK1)
    state = model.state_dict()
    assert all(torch.equal(state[k], want[k]) for k in want)
    ref = transformers.AutoModelForCausalLM.from_pretrained(fill_root / "llama", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(model), _logits(ref), atol=1e-6, rtol=0)
    copied = reshard.empty_tp_model(shards)
    assert reshard.fill_model(copied, shards, mapped=False).mapped == 0
    assert not any(_in_file(t, regions) for t in _locals(copied).values())


@pytest.mark.pure
def test_casts_and_fused_experts_are_copied(fill_root: Path, tmp_path: Path) -> None:
    """The MoE checkpoint is bf16 on disk: filled as float32 nothing is mapped; as bf16 every tensor but the
    per-expert ones (views into transformers' fused expert parameters) is."""
    from reshard.cli import main

    shards = tmp_path / "moe-tp1"
    assert main(["write", str(fill_root / "moe"), "--tp", "1", "-o", str(shards)]) == 0
    sizes = {k: v.nbytes for k, v in load_file(shards / RANK1).items()}
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    for dtype, mapped in ((torch.float32, 0), (torch.bfloat16, sum(sizes.values()) - experts)):
        model = reshard.empty_tp_model(shards, dtype=dtype)
        report = reshard.fill_model(model, shards)
        assert report.mapped == mapped and experts > 0, (dtype, report)
        ref = transformers.AutoModelForCausalLM.from_pretrained(fill_root / "moe", dtype=dtype).eval()
        torch.testing.assert_close(_logits(model), _logits(ref), atol=1e-6, rtol=0)


@pytest.mark.pure
def test_a_changed_file_is_refused_in_every_mode_that_verifies(llama_shards: dict[str, Path], tmp_path: Path) -> None:
    shards = _copy_dir(llama_shards["tp1"], tmp_path / "copy")  # new inodes: no record of them yet
    path = shards / RANK1
    runs = [reshard.fill_model(reshard.empty_tp_model(shards), shards, verify=v).verified
            for v in ("auto", "auto", "always")]
    assert runs == ["sha256", "identity", "sha256"]  # hashed and recorded, then trusted; "always" hashes
    st = os.stat(path)
    header, _ = read_header_from(file_body(path), str(path))
    with open(path, "r+b") as f:  # one byte of the data changed in place, the mtime put back
        f.seek(len(header.raw) + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    for kw in ({"verify": "auto"}, {"verify": "always"}, {"mapped": False}):
        with pytest.raises(IntegrityError, match="does not match the recorded"):
            reshard.fill_model(reshard.empty_tp_model(shards), shards, **kw)
    os.truncate(path, st.st_size - 10)
    for kw in ({"verify": "auto"}, {"mapped": False}):
        with pytest.raises(IntegrityError, match="truncated or corrupt"):
            reshard.fill_model(reshard.empty_tp_model(shards), shards, **kw)


@pytest.mark.multiproc
def test_a_writer_waits_until_the_model_has_its_own_copy(llama_shards: dict[str, Path], tmp_path: Path) -> None:
    """Truncating a mapped rank file (another process) breaks the lease: the model's tensors are copied out
    of the mapping first, so it keeps its values and never touches a page that is gone (SIGBUS)."""
    shards = _copy_dir(llama_shards["tp1"], tmp_path / "copy")
    model = reshard.empty_tp_model(shards)
    assert reshard.fill_model(model, shards).mapped > 0
    before = {n: t.clone() for n, t in _locals(model).items()}
    logits = _logits(model)
    regions = _mapped_regions(shards / RANK1)
    code = f"import os; os.truncate({str(shards / RANK1)!r}, 0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # held until the handler has run
    assert (shards / RANK1).stat().st_size == 0
    after = _locals(model)
    assert not any(_in_file(t, regions) for t in after.values())
    assert all(torch.equal(after[n], before[n]) for n in before)
    torch.testing.assert_close(_logits(model), logits, atol=0, rtol=0)


@pytest.mark.servers
def test_the_fill_path_imports_no_http_or_settings_stack(llama_shards: dict[str, Path], fill_server: Any) -> None:
    """A plain torch model filled from a rank file and from the service (http.client) in a fresh interpreter."""
    path = llama_shards["tp1"] / RANK1
    proc = subprocess.run([sys.executable, "-m", "tests.support.fill_imports", str(path), fill_server.ckpt_url("llama")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["after_import"] == [] and out["after_fill"] == [], out
    file_run, url_run = out["sources"].values()
    assert file_run["equal"] and file_run["mapped"] > 0 and file_run["verified"] == "identity"
    assert url_run["equal"] and url_run["mapped"] == 0 and url_run["verified"] == "sha256"


class _FlippingProxy(LoopbackProxy):
    """Relays the service's answers with one byte of each shard's body changed, 64 bytes before its end: in
    the tensor data, past the shard's header (the HTTP headers, and so the digest, intact; JSON answers as sent)."""

    def _relay(self, up: Any, client: Any, state: Any) -> None:
        sent, body_at, length = 0, None, 0
        while data := up.recv(65536):
            buf = bytearray(data)
            if body_at is None and b"\r\n\r\n" in buf:
                body_at = sent + buf.index(b"\r\n\r\n") + 4
                head = bytes(buf[: buf.index(b"\r\n\r\n")]).lower()
                m = re.search(rb"content-length: *(\d+)", head)
                length = int(m.group(1)) if m and b"application/json" not in head else -(1 << 40)
            flip = None if body_at is None else body_at + length - 64 - sent
            if flip is not None and 0 <= flip < len(buf):
                buf[flip] ^= 0xFF
            client.sendall(bytes(buf))
            sent += len(buf)


@pytest.mark.servers
def test_a_corrupt_stream_from_the_service_is_refused(fill_server: Any) -> None:
    host, port = fill_server.url.removeprefix("http://").split(":")
    with _FlippingProxy((host, int(port))) as proxy:
        url = f"{proxy.url}/v1/checkpoints/llama"
        with pytest.raises(IntegrityError, match="sha256"):
            reshard.fill_model(reshard.empty_tp_model(fill_server.ckpt_url("llama")), url)


@pytest.mark.servers
def test_launch_prefetch_fills_from_the_fetched_shard(fill_server: Any, llama_shards: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """`reshard launch --prefetch URL`: each rank's shard fetched while the launcher imports, then mapped by the
    rank's fill (the same logits as from rank files); through a link that corrupts it, refused (the fetcher
    refuses it, the rank's own pull then too)."""
    host, port = fill_server.url.removeprefix("http://").split(":")
    with _FlippingProxy((host, int(port))) as proxy:
        for url, ok in ((fill_server.ckpt_url("llama"), True), (f"{proxy.url}/v1/checkpoints/llama", False)):
            out = tmp_path / ("ok" if ok else "corrupt")
            out.mkdir()
            cmd = [sys.executable, "-m", "reshard.cli.launch", "--nproc-per-node", "2", "--preload", str(llama_shards["tp2"]),
                   "--prefetch", url, "-m", "tests.support.launch_fill", url, str(llama_shards["tp2"]), str(out)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                                  env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
            if not ok:
                assert proc.returncode != 0 and "does not match" in proc.stderr, proc.stderr[-3000:]
                continue
            assert proc.returncode == 0, proc.stderr[-3000:]
            for rank in range(2):
                r = json.loads((out / f"rank-{rank}.json").read_text())
                assert r["equal"] and r[url]["name"].endswith("(prefetched)") and r[url]["verified"] == "sha256"
                assert r[url]["mapped"] > 0 and r[str(llama_shards["tp2"])]["verified"] == "identity"
