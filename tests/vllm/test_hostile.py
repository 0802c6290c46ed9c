"""load_format="reshard" against a server that lies (tests/support/hostile.py, serving the rank file `reshard
write --engine vllm` made): 4 KiB flipped under the true advertised sha256, the true bytes under a digest
of zeros, a header that declares a 2 GiB tensor, and credentials in the URL. vLLM's own model is built and
filled in this process, as its worker does (tests/support/vllm_models.py; no engine start)."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from reshard.errors import IntegrityError, PlanError
from reshard.format.rank_file import rank_file_name
from tests.support.hostile import HostileServer
from tests.support.vllm_models import loaded, loaded_by_reshard

pytestmark = [pytest.mark.servers, pytest.mark.timeout(300)]


@pytest.fixture
def shard(vwritten: Callable[..., Path]) -> bytes:
    return (vwritten("llama", 1) / rank_file_name(0, 1)).read_bytes()


@pytest.fixture
def srv(shard: bytes) -> Iterator[HostileServer]:
    with HostileServer(shards={(0, 1): shard}, config={}) as s:
        yield s


@pytest.mark.parametrize("lie", ["flipped", "zeros"])
def test_the_plugin_checks_the_advertised_digest(srv: HostileServer, shard: bytes, meta_dir: Callable[[str], Path],
                                                 lie: str) -> None:
    if lie == "flipped":
        at = len(shard) // 2
        srv.digest[(0, 1)] = hashlib.sha256(shard).hexdigest()
        srv.body[(0, 1)] = shard[:at] + bytes(b ^ 0xFF for b in shard[at : at + 4096]) + shard[at + 4096 :]
    else:
        srv.digest[(0, 1)] = "0" * 64
    with pytest.raises(IntegrityError, match=rf"{srv.url} rank 0/1: sha256 \w+ does not match the recorded "
                                             rf"{srv.sha((0, 1))}"):
        loaded_by_reshard(meta_dir("llama"), url=srv.url)


def _declaring(shard: bytes, name: str, shape: list[int]) -> bytes:
    """The header of `shard` with tensor `name` declared at `shape` (the offsets after it moved along)."""
    (n,) = struct.unpack("<Q", shard[:8])
    header = json.loads(shard[8 : 8 + n])
    at = 0
    for key in sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]):
        e = header[key]
        if key == name:
            e["shape"] = shape
        size = 4 * int(torch.tensor(e["shape"]).prod()) if key == name else e["data_offsets"][1] - e["data_offsets"][0]
        e["data_offsets"] = [at, at + size]
        at += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, at


def test_a_declared_tensor_is_compared_with_its_place_before_it_is_allocated(
        srv: HostileServer, shard: bytes, meta_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The header declares the embedding at [524288, 1024] float32 (2 GiB); the server sends the header and
    waits. The shape is refused against vLLM's [1024, 128] parameter before a tensor is allocated or read."""
    monkeypatch.setenv("RESHARD_CLIENT_STALL", "5")  # without the check: the fill would wait for the 2 GiB
    head, data = _declaring(shard, "model.embed_tokens.weight", [524288, 1024])
    srv.body[(0, 1)], srv.extra_length = head, data  # Content-Length: the header and all it declares
    t0 = time.monotonic()
    with pytest.raises(PlanError, match=r"model.embed_tokens.weight: has shape \[524288, 1024\] in the shard, but its "
                                        r"place in vLLM's model.embed_tokens.weight \(block None\) has shape \[1024, 128\]"):
        loaded_by_reshard(meta_dir("llama"), url=srv.url)
    assert time.monotonic() - t0 < 60


def test_credentials_in_the_url_are_sent_but_never_logged(srv: HostileServer, shard: bytes, vroot: Path,
                                                          meta_dir: Callable[[str], Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard.integrations.vllm import loader

    lines: list[str] = []  # what the loader logs (vLLM's logging set-up resets handlers, so its `info` is watched)
    monkeypatch.setattr(loader.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    got = loaded_by_reshard(meta_dir("llama"), url=srv.url.replace("http://", "http://alice:s3cret@"))
    want = loaded(vroot / "llama")
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    assert any(srv.url in line for line in lines) and not any("s3cret" in line for line in lines), lines
    assert {r[2].get("Authorization", "")[:6] for r in srv.requests} == {"Basic "}
