"""`fill_parameters` from a body that reads into memory (`reshard.io.client.body`): the bytes land in the
parameters' own storage, a file cut short mid-way says which tensors were filled, a wrong digest is
refused after the last byte."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard.errors import IntegrityError
from reshard.fill.into_params import fill_parameters, read_header_from
from reshard.fill.model import match_targets
from reshard.io.client.body import file_body

pytestmark = pytest.mark.pure

RANK_FILE = "rank-00000-of-00001.safetensors"


def _open(path: Path, sha256: str | None = None):  # type: ignore[no-untyped-def]
    model = reshard.empty_tp_model(path.parent)
    body = file_body(path, sha256=sha256)
    header, leftover = read_header_from(body, str(path))
    assert leftover == b""
    targets, _ = match_targets(model, header)
    return model, body, header, targets


def test_bytes_land_in_the_parameters_own_storage(llama_shards: dict[str, Path]) -> None:
    path = llama_shards["tp1"] / RANK_FILE
    model, body, header, targets = _open(path)
    where = {n: t.data_ptr() for n, t in targets.items()}
    fill_parameters(header, body, targets)
    body.close()
    want = load_file(path)
    assert {n: t.data_ptr() for n, t in targets.items()} == where  # filled in place, nothing replaced
    assert all(torch.equal(targets[n], want[n]) for n in want) and len(want) == len(targets)


def test_a_file_cut_mid_way_says_what_was_filled(llama_shards: dict[str, Path], tmp_path: Path) -> None:
    src = llama_shards["tp1"] / RANK_FILE
    path = tmp_path / RANK_FILE
    shutil.copy(src, path)
    shutil.copy(src.parent / "config.json", tmp_path / "config.json")
    model, body, header, targets = _open(path)
    with torch.no_grad():
        for t in targets.values():
            t.fill_(float("nan"))
    order = sorted(header.entries, key=lambda n: header.entries[n]["data_offsets"][0])
    cut = order[3]
    os.truncate(path, len(header.raw) + header.entries[cut]["data_offsets"][0] + 10)  # after the body opened
    with pytest.raises(IntegrityError, match=rf"inside its data.*3 of {len(order)} tensors had been filled "
                                             rf"and {cut} in part"):
        fill_parameters(header, body, targets)
    body.close()
    want = load_file(src)
    assert [n for n in order if torch.equal(targets[n], want[n])] == order[:3]


def test_a_wrong_digest_is_refused(llama_shards: dict[str, Path]) -> None:
    model, body, header, targets = _open(llama_shards["tp1"] / RANK_FILE, sha256="0" * 64)
    with pytest.raises(IntegrityError, match="does not match the recorded 0000"):
        fill_parameters(header, body, targets, sha256="0" * 64)
    body.close()


def test_iter_tensors_checks_the_bodys_own_digest_and_never_allocates_what_it_reads_past(
        llama_shards: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the vLLM plugin reads through: no `sha256` given, the body's recorded one is checked; a tensor left
    out of `only` is hashed but never allocated, so a flipped byte in it is still found."""
    import json

    from reshard.fill import into_params

    src = llama_shards["tp1"] / RANK_FILE
    want = load_file(src)
    recorded = json.loads((src.parent / "reshard.json").read_text())["files"][RANK_FILE]["sha256"]
    skip = "model.embed_tokens.weight"
    allocated: list[tuple[int, ...]] = []
    real_empty = torch.empty
    monkeypatch.setattr(into_params.torch, "empty", lambda shape, **kw: allocated.append(tuple(shape)) or
                        real_empty(shape, **kw))

    def pairs(path: Path) -> dict[str, torch.Tensor]:
        body = file_body(path, sha256=recorded)
        header, leftover = read_header_from(body, str(path))
        return dict(into_params.iter_tensors(header, body, leftover=leftover, only=set(want) - {skip}))

    got = pairs(src)
    assert sorted(got) == sorted(set(want) - {skip}) and all(torch.equal(got[n], want[n]) for n in got)
    assert sorted(allocated) == sorted(tuple(want[n].shape) for n in got)  # one each: none for the skipped one
    data = bytearray(src.read_bytes())
    with open(src, "rb") as f:  # a byte of the skipped tensor's data, flipped
        n = int.from_bytes(f.read(8), "little")
        begin = json.loads(f.read(n))[skip]["data_offsets"][0]
    data[8 + n + begin] ^= 0xFF
    bad = tmp_path / RANK_FILE
    bad.write_bytes(data)
    with pytest.raises(IntegrityError, match=rf"sha256 \w+ does not match the recorded {recorded}"):
        pairs(bad)
