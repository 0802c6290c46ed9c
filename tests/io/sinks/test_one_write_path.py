"""One write path: `reshard.write_shards`, `reshard write` and a service write job of the same source and
layout give byte-identical rank files, config.json and `reshard.json`, and each records its rank files
as verified (`reshard.io.verified`), so a later fill does not hash them again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import reshard
from reshard.cli import main
from reshard.format.rank_file import rank_file_name
from reshard.io import verified
from tests.support.live import live_server, make_ckpt, run_job

pytestmark = pytest.mark.servers

TP = 2


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _recorded(out: Path, name: str) -> bool:
    """Whether `out/name` is recorded as verified with the sha256 of its bytes as they are now."""
    sha = hashlib.sha256((out / name).read_bytes()).hexdigest()
    fd = os.open(out / name, os.O_RDONLY)
    try:
        return verified.trusted(fd, sha)
    finally:
        os.close(fd)


def test_library_cli_and_job_write_the_same_bytes(tmp_path: Path) -> None:
    root = tmp_path.resolve() / "root"
    src = make_ckpt(root / "tiny")
    source, manifest = reshard.open_source(str(src))
    plan = reshard.make_plan(source, manifest, TP)
    lib = tmp_path / "lib"
    record = reshard.write_shards(source, plan, lib, progress=False)
    assert record["written"] == [0, 1] and record["kept"] == []

    cli = tmp_path / "cli"
    assert main(["write", str(src), "--tp", str(TP), "-o", str(cli), "--no-progress"]) == 0

    with live_server(root, out=tmp_path / "out") as srv:
        job = run_job(srv.url, "tiny", TP)
        assert job["state"] == "done", job
    served = Path(job["output_dir"])
    assert served == tmp_path / "out" / "tiny" / f"tp-{TP}"
    assert job["plan"] == plan.digest and job["bytes_done"] == job["bytes_total"] == sum(rp.size for rp in plan.ranks)

    ranks = [rank_file_name(r, TP) for r in range(TP)]
    want = _files(lib)
    assert sorted(want) == sorted(["config.json", "reshard.json", *ranks])  # no partial record, no temp file
    assert _files(cli) == want
    assert _files(served) == want
    saved = json.loads(want["reshard.json"])
    assert saved["plan"] == plan.digest and saved["tp"] == TP
    assert saved["source"]["path"] == str(src)
    for name in ranks:
        assert saved["files"][name]["sha256"] == hashlib.sha256(want[name]).hexdigest()
        assert saved["files"][name]["size"] == len(want[name]) > 0
        for out in (lib, cli, served):
            assert _recorded(out, name), f"{out / name} was not recorded as verified"
